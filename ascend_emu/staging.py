"""Bulk transfers between dies, staged at the dies whose state they use (DESIGN.md 3.5, 10).

A transfer whose GM operand lives on another die than its mover's (``Route.stage``: WRITE, READ or RELAY) is not
timed in one piece at its start, since the other die's L2, HBM and ports are that die's state (another process's in
a partitioned run). The mover's die books its own servers at the start, and the other dies book theirs when a
message (``Engine.send``: a plain record below) reaches them, in time order with everyone else's:

- WRITE (MTE3, FIXP, a DMA out of its own die's GM): the mover samples its source at the start and books its mover
  rate (a DMA: its engine, its own L2 / HBM) and its send port; the data (``Push``) reaches the destination's die one
  link latency after the start-up, which books its receive port and L2 / HBM from then and lands the data at
  ``end``; an acknowledgement (``Reply``) carrying ``end`` reaches the mover one link latency after the push arrived.
- READ (MTE2, a DMA into its own die's GM): the mover books its mover rate (a DMA: its engine, its own L2) and its
  receive port at the start; the request (``Pull``) reaches the source's die one link latency after the start-up,
  which looks the bytes up in its L2, books its L2 / HBM and send port from then, samples the source then, and
  replies with the data one link latency later.
- RELAY (a DMA between two other dies): the engine's die books its engine; the pull reaches the source's die, which
  pushes the data on to the destination's die; that one lands it and acknowledges to the engine's die.

On an idle fabric (``flow`` = start + start-up, ``L`` the link latency, ``lat`` the L2 or, on a miss, HBM latency,
``occ`` the longest time a server on the way takes for the bytes, ``mover`` the mover's time for them):

    write:  end = max(flow + L + max(mover, occ) + lat,  flow + 2 L)           (landing, and the ack's round trip)
    read:   end = flow + max(mover, occ_here, L + occ_there) + L + lat

modeled as: a server on the mover's die takes the bytes from ``flow``, one on another die from the message's
arrival; the mover's pipe is busy until its own servers and its mover rate have passed the bytes, so contention at
another die delays the data's landing or arrival (``end``), not the pipe. A remote read's mover rate is the L2-hit
rate capped by the outstanding bytes per round trip: misses at the owner cost its HBM server and the HBM latency,
which the mover's die cannot know. A read samples its source when the request reaches the owner, not at the
instruction's start (a remote source cannot be read from the mover's die); a write samples its source at the start
and carries the sample (when one process owns both dies, it lends the source to its push instead, as the engine's
data paths do: the landing copies the source, unless a write into it took the sample first). The mover's die
learns ``end`` when the reply arrives (never after ``end``); instructions that wait for the transfer's end wait for
that reply, ones that wait for its pipe only for its own servers. Replies may arrive out of issue order; a wait for
the pipe (``after=``) waits for every earlier transfer's end. A killed mover's die (``Engine.dead_dies``) drops its
messages where they arrive. Seeded jitter (jitter.py) perturbs a staged transfer's memory latency; its fabric hops
keep the profile's latency, so no message comes sooner than the look-ahead.
"""
from __future__ import annotations

import numpy as np

from .cache import footprint, rows_footprint
from .isa import Instr, _check_rows, rows_of
from .timing import READ, WRITE


class Pull:
    """Mover's die -> the GM source's die: read ``src`` (a View on the receiving die; rows ``rows``, an np.ndarray of
    row indices for a gather, or all of it) for a transfer of ``nbytes``. ``key``: the Paths.path arguments of the
    transfer's route; ``flow``: when the request arrives (the owner's servers serve from then, ps); ``finish``: when
    the mover's side has passed the bytes (ps); ``to_die``: where the data goes (the mover's die, or a relay's
    destination); ``handle``: opaque, the instruction, handed back in the reply."""
    __slots__ = ("key", "src", "rows", "nbytes", "flow", "finish", "issuer_die", "to_die", "real", "handle")

    def __init__(self, key, src, rows, nbytes, flow, finish, issuer_die, to_die, real, handle):
        self.key, self.src, self.rows, self.nbytes, self.flow = key, src, rows, nbytes, flow
        self.finish, self.issuer_die, self.to_die, self.real, self.handle = finish, issuer_die, to_die, real, handle


class Push:
    """Data to land in GM on the receiving die. ``dsts``/``result`` are shaped like the instruction's for its
    ``OpSpec.commit`` (the destination view, the sample). ``flow``: when the bytes arrive (ps); ``finish``: when they
    have passed every server before, plus the hop (ps); ``lat``: the memory latency after the last byte (ps);
    ``l2_bytes``/``hbm_bytes``: traffic counted on the way, reported back to the mover."""
    __slots__ = ("key", "dsts", "result", "commit", "rows", "nbytes", "flow", "finish", "lat", "issuer_die", "real",
                 "l2_bytes", "hbm_bytes", "handle")

    def __init__(self, key, dsts, result, commit, rows, nbytes, flow, finish, lat, issuer_die, real, l2_bytes,
                 hbm_bytes, handle):
        self.key, self.dsts, self.result, self.commit, self.rows = key, dsts, result, commit, rows
        self.nbytes, self.flow, self.finish, self.lat, self.issuer_die = nbytes, flow, finish, lat, issuer_die
        self.real, self.l2_bytes, self.hbm_bytes, self.handle = real, l2_bytes, hbm_bytes, handle


class Reply:
    """Back to the mover's die: the transfer ends at ``end`` (ps, never before this message arrives); ``data``: a
    read's sample (None for a write's acknowledgement or a phantom)."""
    __slots__ = ("end", "data", "l2_bytes", "hbm_bytes", "handle")

    def __init__(self, end, data, l2_bytes, hbm_bytes, handle):
        self.end, self.data, self.l2_bytes, self.hbm_bytes, self.handle = end, data, l2_bytes, hbm_bytes, handle


class Staging:
    """The per-die halves of staged transfers, for one engine."""

    __slots__ = ("engine", "paths", "book", "lends", "line", "_closing", "lent")

    def __init__(self, engine):
        from .engine import _book, _lends   # the engine module imports this one
        self.engine = engine
        self.lends = _lends
        self.paths = engine.paths
        self.book = _book
        self.line = engine.line_bytes
        # instruction -> the next one of its pipe, whose pipe end (Engine._close_pipe) waits for it: a staged
        # transfer whose reply has not arrived, or one waiting for such a transfer itself
        self._closing: dict = {}
        self.lent = object()        # Instr.result of a transfer whose source is lent (the engine's, once seen)

    # ------------------------------------------------------------------ the mover's die, at the transfer's start
    def start(self, ins) -> None:
        """Time transfer ``ins`` on its mover's die now (its start) and send its first message."""
        eng = self.engine
        r = ins.path
        core = ins.core
        spec = ins.spec
        stage = r.stage
        book = self.book
        nbytes = ins.nbytes
        dma = r.engine
        start = eng.now if dma is None else ins.start
        flow = start + r.startup
        finish = flow
        l2_bytes = hbm_bytes = 0
        lat = self.paths.l2_lat
        if dma is not None:
            mover = nbytes / dma.bw
        else:
            mover = nbytes / (r.rate_write if stage == WRITE else r.rate_hit)
            if nbytes / r.remote_rate > mover:
                mover = nbytes / r.remote_rate
        if stage == WRITE:
            if r.read_cache is not None:        # a DMA out of its own die's GM
                finish, l2_bytes, hbm_bytes, missed = self._memory(r.read_cache, r.read_l2, r.read_hbm,
                                                                   self._fp(ins.srcs[0], ins), False, nbytes, flow,
                                                                   finish)
                if missed:
                    lat = self.paths.hbm_lat
            links = r.send_links
        elif stage == READ:
            if r.write_cache is not None:       # a DMA into its own die's GM
                finish, l2_bytes, hbm_bytes, _ = self._memory(r.write_cache, r.write_l2, r.write_hbm,
                                                              self._fp(ins.dsts[0], ins), True, nbytes, flow, finish)
            links = r.recv_links
        else:
            links = ()
        for s in links:
            finish = book(s, nbytes, flow, finish)
        if flow + int(mover) > finish:
            finish = flow + int(mover)
        ins.start = start
        ins.busy_end = finish
        eng._occupy(ins, flow)
        tr = core.traffic
        tr.l2_bytes += l2_bytes
        tr.hbm_bytes += hbm_bytes
        if r.links:
            tr.fabric_bytes += nbytes
        if ins.waiters:
            self._release_pipe(ins)
        if stage == WRITE:
            sample = None
            to_die = ins.dsts[0].store.die
            if ins.real:                        # the source as it is now, carried to the destination
                part = eng.part
                if self.lends(ins) and (part is None or part.owned[to_die]):
                    eng._execute(ins)           # lent, not copied: the landing copies it (_land)
                    sample = self.lent = ins.result     # the engine's marker of a loan
                else:
                    if eng.n_lent:
                        eng._settle_srcs(ins)   # lazy loads into its source copy first
                    spec.execute(ins)
                    sample = ins.result
                    ins.result = None
            rows = None
            if spec.gm_rows:        # a scatter's sample holds its rows; a phantom one's rows give its footprint
                rows = sample[0] if sample is not None else np.array(rows_of(ins))
            hop = r.hop_out
            eng.send(flow + hop, to_die, self._pushed,
                     Push(r.key, ins.dsts, sample, spec.commit, rows, nbytes, flow + hop, finish + hop, lat,
                          core.die, ins.real, 0, 0, ins))
            return
        src = ins.srcs[0]
        rows = None
        if spec.gm_rows:
            rows = rows_of(ins)
            if ins.real:
                _check_rows(rows, src.shape[0], src)
                rows = rows.copy()
        to_die = core.die if stage == READ else ins.dsts[0].store.die
        eng.send(flow + r.hop_out, src.store.die, self._pulled,
                 Pull(r.key, src, rows, nbytes, flow + r.hop_out, finish, core.die, to_die, ins.real, ins))

    def _release_pipe(self, ins) -> None:
        """``ins``'s pipe is free (its busy end is known, its end not yet): release what waits only for that."""
        ws = ins.waiters
        if not ws:
            return
        early = []
        late = []
        for i in range(0, len(ws), 2):
            (early if ws[i + 1] is False else late).extend((ws[i], ws[i + 1]))
        if not early:
            return
        ins.waiters = late
        proxy = Instr(ins.spec, (), ())         # the engine's release, over the waiters of the busy end only
        proxy.busy_end = ins.busy_end
        proxy.waiters = early
        self.engine._release(proxy)

    # ------------------------------------------------------------------ the source's die
    def _pulled(self, m: Pull) -> None:
        eng = self.engine
        if m.issuer_die in eng.dead_dies:
            return
        r = self.paths.path(*m.key)
        here = m.src.store.die
        finish, l2_bytes, hbm_bytes, missed = self._memory(r.read_cache, r.read_l2, r.read_hbm,
                                                           self._fp(m.src, None, m.rows), False, m.nbytes, m.flow,
                                                           m.finish)
        lat = self.paths.hbm_lat if missed else self.paths.l2_lat
        data = None
        if m.real:
            data = np.array(m.src.arr, copy=True) if m.rows is None else m.src.arr[m.rows]
        if m.to_die == here:                    # a relay within the source's die: no fabric
            ins = m.handle
            self._pushed(Push(m.key, ins.dsts, data, ins.spec.commit, None, m.nbytes, m.flow, finish, lat,
                              m.issuer_die, m.real, l2_bytes, hbm_bytes, ins))
            return
        for s in r.send_links:
            finish = self.book(s, m.nbytes, m.flow, finish)
        if r.stage == READ:
            hop = r.link_lat
            end = self._end(m.handle, finish + hop, lat)
            eng.send(eng.now + hop, m.to_die, self._replied, Reply(end, data, l2_bytes, hbm_bytes, m.handle))
            return
        hop = r.link_lat                        # a relay: on to the destination's die
        ins = m.handle
        eng.send(eng.now + hop, m.to_die, self._pushed,
                 Push(m.key, ins.dsts, data, ins.spec.commit, None, m.nbytes, eng.now + hop, finish + hop, lat,
                      m.issuer_die, m.real, l2_bytes, hbm_bytes, ins))

    # ------------------------------------------------------------------ the destination's die
    def _pushed(self, m: Push) -> None:
        eng = self.engine
        if m.issuer_die in eng.dead_dies:
            self._drop(m)
            return
        r = self.paths.path(*m.key)
        finish = m.finish
        for s in r.recv_links:
            finish = self.book(s, m.nbytes, m.flow, finish)
        finish, l2_bytes, hbm_bytes, _ = self._memory(r.write_cache, r.write_l2, r.write_hbm,
                                                      self._fp(m.dsts[0], None, m.rows), True, m.nbytes, m.flow,
                                                      finish)
        land = self._end(m.handle, finish, m.lat)
        if m.real:
            eng.push(land, self._land, m)
        back = eng.now + r.hop_back
        eng.send(back, m.issuer_die, self._replied,
                 Reply(land if land > back else back, None, m.l2_bytes + l2_bytes, m.hbm_bytes + hbm_bytes,
                       m.handle))

    def _land(self, m: Push) -> None:
        eng = self.engine
        if m.issuer_die in eng.dead_dies:
            self._drop(m)
            return
        v = m.dsts[0]
        if eng.n_lent:
            eng._unlend_overlapping(v)      # transfers that lent what this landing overwrites sample it first
        if m.result is self.lent:               # the source as it was at the start: copied once, from there
            m.result = self._take(m.handle)
        if eng.part is not None:                # a partitioned run keeps what the landing overwrites (workers.py)
            eng.part.writing(v, m.rows)
        m.commit(m)
        m.result = None
        eng.gm_written(v.store, v.lo, v.hi, m.handle)

    def _take(self, ins):
        """The sample of write ``ins`` whose source was lent (Engine._execute): the source itself while it is still
        lent (nothing wrote it since the start), else the sample a write into it took (Engine._unlend_overlapping).
        Ends the loan."""
        if ins.result is self.lent:
            self.engine._unlend(ins)
            data = ins.loan.arr
        else:
            data = ins.result
        ins.result = None
        return data

    def _drop(self, m: Push) -> None:
        """A push that will not land: end its source's loan."""
        if m.result is self.lent:
            m.result = None
            self._take(m.handle)

    # ------------------------------------------------------------------ back on the mover's die
    def _replied(self, m: Reply) -> None:
        ins = m.handle
        core = ins.core
        if core.killed:
            return
        tr = core.traffic
        tr.l2_bytes += m.l2_bytes
        tr.hbm_bytes += m.hbm_bytes
        if m.data is not None:
            if ins.spec.commit is None:         # into the core's buffer: its dependants wait for the end
                dst = ins.dsts[0]
                if self.engine.n_lent:
                    self.engine._unlend_overlapping(dst)
                dst.arr[...] = m.data
            else:                               # a DMA into this die's GM: lands at the end
                ins.result = m.data
        ins.end = m.end
        eng = self.engine
        if ins.end > eng.last_activity:
            eng.last_activity = ins.end
        if m.data is not None and ins.spec.commit is not None:     # a read into GM (a write's push lands itself)
            eng.push(ins.end, eng._commit, ins)
        eng._scheduled(ins)
        if eng.sanitizer is not None:
            eng.sanitizer.transfer(ins)
        if ins.waiters:
            eng._release(ins)
        self._closed(ins)

    def abandon(self) -> None:
        """A run raised (``Engine.abandon``): forget its transfers still in flight."""
        self._closing.clear()

    def close_after(self, prev, ins) -> None:
        """``ins``'s pipe end waits for ``prev``'s (``Engine._close_pipe``); until then a wait for it waits there."""
        self._closing[prev] = ins

    def _closed(self, ins) -> None:
        """``ins``'s pipe end is known: so are those of the pipe's instructions after it that waited for it."""
        nxt = self._closing.pop(ins, None)
        while nxt is not None:
            self.engine._close_pipe(nxt)
            ins, nxt = nxt, self._closing.pop(nxt, None)

    # ------------------------------------------------------------------ helpers
    def _end(self, ins, finish: int, lat: int) -> int:
        jitter = self.engine.jitter
        return finish + lat if jitter is None else jitter.transfer_end(ins, finish, lat)

    def _fp(self, view, ins, rows=None) -> tuple:
        """The L2 lines ``view`` touches (only rows ``rows`` of it for a gather / scatter)."""
        if ins is not None and ins.spec.gm_rows:
            rows = rows_of(ins)
        if rows is not None:
            return rows_footprint(view, rows, self.line)
        fp = view._l2fp
        return fp if fp is not None else footprint(view, self.line)

    def _memory(self, cache, l2, hbm, fp, write: bool, nbytes: int, flow: int, finish: int) -> tuple:
        """Look ``fp`` up in this die's L2 and book its L2 / HBM servers; returns (finish, L2 bytes, HBM bytes,
        whether a read missed)."""
        cache.access(fp, write)
        moved = (cache.evicted if write else cache.miss + cache.evicted) * self.line
        finish = self.book(l2, nbytes, flow, finish)
        if moved:
            finish = self.book(hbm, moved, flow, finish)
        return finish, nbytes, moved, (not write and cache.miss > 0)

