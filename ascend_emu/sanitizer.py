"""The race sanitizer (DESIGN.md 3.6): an opt-in observer of the scheduler that checks far-memory protocols.

``Pod(..., sanitize=True)`` attaches one to the pod's engine (``sanitize="collect"`` keeps going and lists what it
found in ``run.races``). The engine tells it, only when one is attached, of: every instruction issued and each
dependency the scheduler found for it (own-core ordering), every transfer when it starts (its GM reads are checked
when they sample), every GM landing (writes are checked when they land; flag stores and atomics publish there),
every sync handler (cross-core flag sets, barrier arrivals) and every blocking instruction's completion (polls,
loads, atomics, barriers and cross-core waits acquire there; kernel ends close a core). The pod tells it of
launches starting and ending, runs starting and ending, and GM allocations and host writes.

Happens-before is in ``happens_before``, the per-word and per-byte state in ``shadow``, the reports in ``races``.
Same-core accesses are never checked against each other: the scheduler orders them (it models the compiler's and
the queues' synchronisation on a core); what the sanitizer checks is everything between cores, dies and the host.

modeled as: a local tile read (``uninitialized-read`` of UB / L1 / L0) is reported at the time it was issued, its
earliest start; GM accesses at the modeled time they sample or land.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .happens_before import (AFTER_PIPE, BLOCKING, EMPTY, FIXP_WRITE, ISSUED, LAND_MARK, MTE3_WRITE, NOTHING,
                             PIPE_MARKS, START_MARK, CoreClock, VectorClock, drained, join, join_all, join_vc, publish,
                             raised, release, start_knowledge, started)
from .isa import OPS, SYNC, TRANSFER, rows_of
from .races import Access, Race, race_error
from .shadow import GmShadow, LocalShadow, pack, unpack

OLD = 1                     # writer id of accesses compacted away: written, and ordered before everything since
_COMPACT_AT = 200_000       # access records kept before a run with nothing parked drops the older ones
_JOINED_LIMIT = 256         # joined releases remembered (_releases) before the memo starts again
_DRAINS = (OPS["kernel_end"], OPS["pipe_barrier"], OPS["barrier"])
_GM_STORE, _GM_LOAD, _WAIT_GM = OPS["gm_store"], OPS["gm_load"], OPS["wait_gm"]
_ATOMICS = (OPS["atomic_add"], OPS["atomic_cas"])
_ATOMIC_COPY = OPS["copy_ub_to_gm_add"]
_GET_VALUE, _MMAD = OPS["get_value"], OPS["mmad"]
_CROSS_SET, _CROSS_WAIT, _BARRIER, _KERNEL_END = (OPS["cross_core_set"], OPS["cross_core_wait"], OPS["barrier"],
                                                  OPS["kernel_end"])
_IN_ORDER = (MTE3_WRITE, FIXP_WRITE)        # writes a core's pipe delivers to one die in issue order


class Record:
    """One GM access the shadow points at: its instruction's happens-before record ``hb`` (clock None: the host),
    the frontier ``entry`` that says when it is complete, the run it happened in, what it was, when it sampled or
    landed (``time``) and when it started (``start``), where, and the vector clock a releasing write publishes."""

    __slots__ = ("hb", "entry", "epoch", "write", "atomic", "sync", "name", "pipe", "time", "start", "store", "lo",
                 "hi", "release", "host_known", "consumed")

    def __init__(self, hb, entry, epoch, write, atomic, sync, name, pipe, time, start, store, lo, hi, release=None,
                 host_known=-1):
        self.hb, self.entry, self.epoch = hb, entry, epoch
        self.write, self.atomic, self.sync = write, atomic, sync
        self.name, self.pipe, self.time, self.start = name, pipe, time, start
        self.store, self.lo, self.hi = store, lo, hi
        self.release = release
        self.host_known = host_known    # a host write: the last run it was issued after
        self.consumed = ()              # a read: the clocks of the cores whose published writes it read

    def access(self) -> Access:
        clock = self.hb[0]
        if clock is None:
            return Access("host", None, "host", "-", self.name, self.time / 1e6, self.store.name, self.lo, self.hi,
                          True)
        return Access(clock.kernel, clock.die, clock.unit, self.pipe, self.name, self.time / 1e6, self.store.name,
                      self.lo, self.hi, self.write)


def ordered(rec: Record, clock: CoreClock, own: tuple, vc: VectorClock) -> bool:
    """Whether access ``rec`` happens before an access of ``clock`` that knows ``own`` and ``vc``."""
    c = rec.hb[0]
    if c is clock:
        return own[rec.entry] >= rec.hb[1]
    if rec.epoch < clock.start_epoch:           # a run ended in between: the host saw it all before launching
        return True
    if c is not None and c.killed:              # its core was killed since: the fault is the edge (below)
        return True
    h = vc.host
    if c is None:                               # a host write: seen land, or made before this core's run
        return h is not None and h[0] >= rec.hb[1]
    if c.gen == vc.gen:
        n = rec.hb[1]
        if vc.know(c.cid, rec.entry) >= n:
            return True
        fifo = vc.fifo
        if fifo and rec.entry in _IN_ORDER and fifo.get((c.cid, rec.pipe, rec.store.die), 0) >= n:
            return True                         # a later in-order write of its core to that die was seen land
    return h is not None and h[1] >= rec.epoch


def _unwritten_rows(old: np.ndarray, view, rows) -> tuple:
    """(rows of a GM read of which no unit was ever written, rows read), or () when every row holds written units
    (padding inside written rows is not an uninitialised read; a row nothing wrote is). Rows are the view's last
    dimension, or a gather's rows."""
    n = len(rows) if rows is not None else (view.numel // view.shape[-1] if view.ndim and view.shape[-1] else 1)
    unwritten = (old & 0xFFFFFFFF) == 0
    if n <= 1 or unwritten.size % n:
        return (n, n) if unwritten.all() else ()
    count = int(np.count_nonzero(unwritten.reshape(n, -1).all(axis=1)))
    return (count, n) if count else ()


class Sanitizer:
    """Happens-before tracking, shadow state and checks for one pod. ``mode``: True (raise ``RaceError`` at the end
    of the launch that raced) or "collect" (keep going; ``run.races`` / ``pod.races`` list them)."""

    def __init__(self, engine, mode):
        self.engine = engine
        self.mode = mode
        self.records: list = [None, None]        # access id -> Record (0: never written, 1: OLD)
        self.sets: list = [None]                  # -id -> tuple of access ids (unordered readers / atomic writers)
        self._set_ids: dict = {}
        self._set_parent: dict = {}               # set id -> (the writer id it grew from, the access added)
        self._set_release: dict = {}              # set id -> the joined releases of its writers (a few recent)
        self._joined: dict = {}                   # writer ids -> their joined releases (_releases; a few recent)
        self.clocks: dict = {}                    # engine Core -> CoreClock (running cores)
        self.gen = 0                              # generation of the core clock ids (happens_before.VectorClock)
        self._next_cid = 0
        self.epoch = 0                            # runs (synchronize calls) started
        self.host_writes = 0
        self.races: list = []                     # every race found on this pod
        self._pending: list = []                  # (race, launch) not raised yet (mode True)
        self._seen: dict = {}                     # signature -> race, this run
        self._run_first = 0
        self._dep = None                          # own knowledge from the dependencies of the instruction issuing
        self._uninit: dict = {}                   # read Record -> its uninitialized-read report
        self._acquired: dict = {}                 # blocking instruction -> vector clock it acquires on completion
        self._launch_start: dict = {}
        self._launch_end: dict = {}
        self._stream_last: dict = {}
        self._xflags: dict = {}                   # (target core, flag, setter core | None) -> queued sets
        self._barriers: dict = {}                 # (launch, group key) -> arrivals
        self._shadows: list = []
        self.redirect = None                      # during a partitioned run: the worker's race_log.Recorder

    # ------------------------------------------------------------------ allocations and host writes (pod)
    def track(self, tensor) -> None:
        """A GM allocation was made: shadow it (host writes through ``GMTensor.write`` report to us)."""
        self._shadow(tensor.store)

    def _shadow(self, store) -> GmShadow:
        sh = store.shadow
        if sh is None:
            sh = store.shadow = GmShadow(store, self)
            self._shadows.append(sh)
        return sh

    def host_wrote(self, view) -> None:
        """``GMTensor.write`` between runs: the host wrote ``view``, after everything of the runs before."""
        if self.redirect is not None:           # a host function's write during a partitioned run: logged
            self.redirect.host_wrote(view)
            return
        self.host_writes += 1
        now = self.engine.now
        rec = Record((None, self.host_writes, NOTHING, EMPTY, NOTHING), 0, self.epoch, True, False, False,
                     "host write", "-", now, now, view.store, view.lo, view.hi,
                     VectorClock(host=(self.host_writes, self.epoch)), self.epoch)
        self._host_write(rec, view, None)

    def _host_write(self, rec: Record, view, selection) -> None:
        """A host write: ordered after every access of the runs it was issued after, racing with the others."""
        sh = self._shadow(rec.store)
        known = rec.host_known
        self._check_write(rec, sh, sh.select(view) if selection is None else selection,
                          lambda o: o.hb[0] is None or o.epoch <= known)

    # ------------------------------------------------------------------ runs and launches (pod)
    def run_starting(self, parked: bool) -> None:
        self.epoch += 1
        self._run_first = len(self.races)
        self._seen = {}
        self._uninit = {}
        if not parked and not self.clocks:    # every core clock so far is done: their ids can be handed out again
            self.gen += 1
            self._next_cid = 0
            self._launch_end = {}
            self._stream_last = {}
            if len(self.records) > _COMPACT_AT:
                self._compact()

    def run_done(self) -> list:
        """The races found during the run; in raising mode, a ``RaceError`` for any not raised yet (a host write
        racing with a parked kernel, a launch still parked)."""
        found = self.races[self._run_first:]
        if self.mode is True and self._pending:
            races = [r for r, _ in self._pending]
            self._pending = []
            raise race_error(races, "this run")
        return found

    def pending_error(self, cause: BaseException):
        """A run raised ``cause``: in raising mode, the RaceError of races found before it (their likely cause)."""
        if self.mode is not True or not self._pending:
            return None
        races = [r for r, _ in self._pending]
        self._pending = []
        return race_error(races, f"a run that then raised {type(cause).__name__}")

    def abandon(self) -> None:
        """The run raised: forget its cores (what landed in GM stays shadowed)."""
        self.clocks = {}
        self._dep = None
        self._acquired = {}
        self._xflags = {}
        self._barriers = {}

    def killed(self, cores) -> None:
        """``Pod.kill_die`` stopped ``cores`` now: what they did is ordered before everything after (the peers
        learn of the death through their protocol's failure detection, which the sanitizer takes as the edge; in
        flight, their accesses were dropped)."""
        for core in cores:
            clock = self.clocks.pop(core, None)
            if clock is not None:
                clock.killed = True

    def launch_starting(self, la) -> None:
        """``la`` starts: its cores start knowing what its stream's previous launch and its ``after`` ones did."""
        vc = EMPTY
        prev = self._stream_last.get(la.stream)
        for p in ([prev] if prev is not None else []) + list(la.after):
            vc = join_vc(vc, self._launch_end.get(p, EMPTY))
        if la.host_writes_before is not None:   # queued by a host function during the run (Launch.on_done)
            vc = join_vc(vc, VectorClock(host=(la.host_writes_before, self.epoch - 1)))
        self._launch_start[la] = vc
        self._stream_last[la.stream] = la

    def launch_done(self, la) -> None:
        """Every core of ``la`` finished: cross-core flags set and never waited for are misuse; in raising mode the
        launch's races raise here."""
        for key in [k for k, q in self._xflags.items() if q and k[0].launch is la]:
            for _, ins in self._xflags.pop(key):
                clock = ins.hb[0]
                tgt = key[0]
                first = Access(clock.kernel, clock.die, clock.unit, "SCALAR", f"cross_core_set flag {key[1]}",
                               ins.start / 1e6, "cross-core flag", 0, 0, True)
                self._add_race(Race("flag-misuse", first, None, f"no cross_core_wait of {tgt.where} consumed this "
                                    f"set before the kernel ended (an unpaired set: the counter stays raised)"), la)
        self._launch_start.pop(la, None)
        if self.mode is True:
            mine = [r for r, owner in self._pending if owner is la]
            if mine:
                self._pending = [(r, owner) for r, owner in self._pending if owner is not la]
                raise race_error(mine, f"launch '{la.name}'")

    # ------------------------------------------------------------------ engine hooks
    def issued(self, core, ins) -> None:
        """``ins`` was issued by ``core``: its own knowledge and vector clock; local-buffer initialisation."""
        clock = self.clocks.get(core)
        if clock is None:
            clock = self.clocks[core] = CoreClock(core, self._launch_start.get(core.launch, EMPTY), self.epoch,
                                                  self._next_cid, self.gen)
            self._next_cid += 1
        clock.n = n = clock.n + 1
        b = clock.blocked
        if b is not None:                       # the scalar unit went on: what it waited for has completed
            clock.blocked = None
            done = started(b)
            clock.own = join(clock.own, raised(done, (BLOCKING,), b.hb[1]) if done[BLOCKING] < b.hb[1] else done)
        own = clock.own
        d = self._dep
        if d is not None:
            own = join(own, d)
            self._dep = None
        spec = ins.spec
        if spec.kind != SYNC:
            prev = clock.last.get(spec.pipe)
            if prev is not None:                # the pipe starts its instructions in order
                own = join(own, started(prev))
            clock.last[spec.pipe] = ins
        else:
            p = ins.p
            after = p.get("after") if p else None
            if spec in _DRAINS or after == "all":
                own = drained(n)
                if not ins.blocking:            # the scalar unit waits for the drain too
                    clock.own = own
            elif after is not None:
                for pipe in ((after,) if after.__class__ is str else after):
                    prev = clock.last.get(pipe)
                    if prev is not None:        # the pipe's end: every earlier instruction of it has landed
                        own = join(own, raised(started(prev), PIPE_MARKS.get(pipe, ()), prev.hb[1]))
        ins.hb = (clock, n, own, clock.vc, start_knowledge(spec.name, own, n))
        if ins.blocking:
            clock.blocked = ins
        self._local(ins, clock)

    def depends(self, ins, other) -> None:
        """The scheduler made ``ins`` wait for ``other`` (a tile or GM range both touch, on one core)."""
        k = other.hb[4]
        d = self._dep
        self._dep = k if d is None else join(d, k)

    def transfer(self, ins) -> None:
        """A transfer is timed and about to move its data: its GM source is read now; a phantom GM destination
        lands at its end (a real one through ``landed``)."""
        src = ins.srcs[0]
        if src.store.space == "GM":
            self._read(ins, src, rows_of(ins) if ins.spec.gm_rows else None)
        dst = ins.dsts[0]
        if dst.store.space == "GM" and not ins.real:
            self.engine.send(ins.end, dst.store.die, self._land_phantom, ins)

    def _land_phantom(self, ins) -> None:
        if not ins.core.killed:
            self._write(ins, ins.dsts[0], rows_of(ins) if ins.spec.gm_rows else None, False, None)

    def landed(self, store, lo: int, hi: int, writer) -> None:
        """A write to ``store`` became visible now (``writer``: its instruction; None: a host write)."""
        if writer is None:
            self.host_writes += 1
            view = _Span(store, lo, hi)
            rec = Record((None, self.host_writes, NOTHING, EMPTY, NOTHING), 0, self.epoch, True, False, True,
                         "host_write", "-", self.engine.now, self.engine.now, store, lo, hi,
                         VectorClock(host=(self.host_writes, self.epoch - 1)), self.epoch - 1)
            sh = self._shadow(store)
            first, end = lo // sh.unit, -(-hi // sh.unit)
            self._host_write(rec, view, (slice(first, end), ((first, end),) if end > first else ()))
            return
        spec = writer.spec
        if spec.kind == TRANSFER:
            self._write(writer, writer.dsts[0], rows_of(writer) if spec.gm_rows else None, spec is _ATOMIC_COPY,
                        None)
        elif spec is _GM_STORE:
            self._write(writer, writer.dsts[0], None, False, release(writer))
        else:                                   # an atomic: it continues the chain of releases on its word
            view = writer.dsts[0]
            acquired = self._releases(view)
            self._acquired[writer] = acquired
            self._write(writer, view, None, True, join_vc(release(writer), acquired))

    def sync(self, ins) -> None:
        """A sync instruction's handler runs: cross-core flag sets queue their release toward the partner(s);
        barrier arrivals are collected."""
        spec = ins.spec
        if spec is _CROSS_SET:
            core = ins.core
            rel = release(ins)
            for tgt in core.launch.partners(core):
                key = (tgt, ins.p["flag"], core if tgt.kind == "aic" else None)
                self._xflags.setdefault(key, deque()).append((rel, ins))
        elif spec is _BARRIER:
            self._barriers.setdefault(self._barrier_key(ins), []).append(ins)

    def completed(self, ins, value) -> None:
        """A blocking instruction completes: acquires happen here."""
        spec = ins.spec
        clock = ins.hb[0]
        acquired = None
        if spec is _WAIT_GM or spec is _GM_LOAD:
            if value is not None:               # None: a wait that timed out saw nothing
                acquired = self._releases(ins.srcs[0])
        elif spec in _ATOMICS:
            acquired = self._acquired.pop(ins, None)
            if acquired is None:                # a compare-and-swap that did not swap still read the chain
                acquired = self._releases(ins.dsts[0])
        elif spec is _BARRIER:
            arrivals = self._barriers.pop(self._barrier_key(ins), None)
            if arrivals is not None:            # the first of the group to leave: everyone's releases, joined
                vc = EMPTY
                for a in arrivals:
                    vc = join_vc(vc, release(a))
                for a in arrivals:
                    self._acquired[a] = vc
            acquired = self._acquired.pop(ins, None)
        elif spec is _CROSS_WAIT:
            core = ins.core
            flag = ins.p["flag"]
            keys = ([(core, flag, p) for p in core.launch.partners(core)] if core.kind == "aic"
                    else [(core, flag, None)])
            acquired = EMPTY
            for k in keys:
                q = self._xflags.get(k)
                if q:
                    acquired = join_vc(acquired, q.popleft()[0])
        elif spec is _KERNEL_END:
            la = clock.launch
            self._launch_end[la] = join_vc(self._launch_end.get(la, EMPTY), release(ins))
            self.clocks.pop(ins.core, None)
            return
        if acquired:
            clock.vc = join_vc(clock.vc, acquired)

    @staticmethod
    def _barrier_key(ins):
        group = ins.p["group"]
        return ins.core.launch, ((group, ins.core.die) if group == "die" else group)

    # ------------------------------------------------------------------ checks
    def _local(self, ins, clock) -> None:
        """Local tiles: a read of bytes no instruction of this core wrote is an uninitialised read."""
        spec = ins.spec
        for v in ins.srcs:
            st = v.store
            if st.space == "GM":
                continue
            if spec is _GET_VALUE:
                try:
                    v = v[ins.p["index"]]       # a scalar read reads only its element(s)
                except Exception:  # an index the view cannot slice (a list): check the whole tile
                    pass
            self._check_local(ins, clock, v)
        dsts = ins.dsts
        if spec is _MMAD and ins.p["accumulate"]:
            self._check_local(ins, clock, dsts[0])  # accumulating reads the accumulator
        for v in dsts:
            st = v.store
            if st.space != "GM":
                sh = st.shadow
                if sh is None:
                    sh = st.shadow = LocalShadow(st)
                sh.mark(v)

    def _check_local(self, ins, clock, v) -> None:
        st = v.store
        sh = st.shadow
        if sh is None:
            sh = st.shadow = LocalShadow(st)
        missing, rows = sh.unwritten(v)
        if missing:
            second = Access(clock.kernel, clock.die, clock.unit, ins.spec.pipe, ins.spec.name, ins.ready / 1e6,
                            f"{st.name} ({st.space})", v.lo, v.hi, False)
            self._add_race(Race("uninitialized-read", None, second,
                                f"{missing} of the {rows} rows read hold no byte this core wrote (a tile read "
                                f"before anything filled it)"), clock.launch)

    def _target(self, ins, view, rows) -> tuple:
        """(the shadow, the units ``view`` touches (rows ``rows`` of it) as ``GmShadow.spans`` gives them,
        ``ins``'s happens-before record)."""
        sh = self._shadow(view.store)
        return (sh,) + sh.select(view, rows) + (ins.hb,)

    def _read(self, ins, view, rows) -> None:
        """A transfer's GM source is sampled now."""
        sh, idx, spans, hb = self._target(ins, view, rows)
        clock, _, own, vc = hb[:4]
        spec = ins.spec
        now = self.engine.now
        rec = Record(hb, START_MARK[spec.name], self.epoch, False, False, False, spec.name, spec.pipe, now, now,
                     view.store, view.lo, view.hi)
        rid = self._add(rec)
        records = self.records
        values = sh.distinct(idx, spans)
        new = []
        unwritten = False
        consumed = set()
        for v in values:
            w, r = unpack(v)
            if w == 0:
                unwritten = view.store.data is not None    # phantom GM stands for data the host provides
            else:
                for m in self._members(w):
                    o = records[m]
                    if o.hb[0] is clock:
                        continue
                    if ordered(o, clock, own, vc):
                        consumed.add(o.hb[0])
                    else:
                        self._unordered(o, rec)
            new.append(pack(w, self._add_reader(r, rid, clock, own, vc)))
        if consumed:
            rec.consumed = consumed
        if unwritten:
            rows = _unwritten_rows(sh.dense(idx), view, rows)
            if rows:
                self._uninit[rec] = self._report(
                    "uninitialized-read", None, rec, f"nothing wrote {rows[0]} of the {rows[1]} rows read (a kernel "
                    f"write, to_gm, GMTensor.write or host_write) before the read")
        sh.assign(idx, spans, values, new)

    def _add_reader(self, old: int, rid: int, clock, own, vc) -> int:
        """The readers id of words read by ``old`` once ``rid`` has read them too: reads ordered before it are
        dropped (a write ordered after it is ordered after them)."""
        if old == 0:
            return rid
        keep = [m for m in self._members(old) if not ordered(self.records[m], clock, own, vc)]
        if not keep:
            return rid
        return self._set(keep + [rid])

    def _write(self, ins, view, rows, atomic: bool, rel) -> None:
        """A write to GM lands now (``atomic``: an atomic add / CAS or an accumulating copy; ``rel``: the vector
        clock a flag store or atomic publishes)."""
        sh, idx, spans, hb = self._target(ins, view, rows)
        clock, _, own, vc = hb[:4]
        spec = ins.spec
        rec = Record(hb, LAND_MARK[spec.name], self.epoch, True, atomic, spec.kind == SYNC, spec.name, spec.pipe,
                     self.engine.now, ins.start, view.store, view.lo, view.hi, rel)
        self._check_write(rec, sh, (idx, spans), lambda o: o.hb[0] is clock or ordered(o, clock, own, vc))

    def _check_write(self, rec: Record, sh, selection, is_ordered) -> None:
        """Check write ``rec`` against the last writers and the readers since of the units ``selection`` of shadow
        ``sh`` (``GmShadow.select``'s answer), then make it their writer (with the unordered atomic writers when it is
        atomic too)."""
        rid = self._add(rec)
        records = self.records
        values = sh.distinct(*selection)
        new = []
        for v in values:
            w, r = unpack(v)
            keep = []
            for m in self._members(w):
                o = records[m]
                if is_ordered(o):
                    continue
                if rec.atomic and o.atomic:     # atomics to one word do not race with each other
                    keep.append(m)
                    continue
                if (rec.atomic and o.sync) or (rec.sync and o.atomic):
                    # nor with a scalar store to it (a flag reset while others CAS it: the values arbitrate)
                    if rec.atomic:
                        keep.append(m)
                    continue
                self._write_write(o, rec)
            for m in self._members(r):
                o = records[m]
                if not is_ordered(o):
                    self._unordered(o, rec)
            if not keep:
                new.append(pack(rid, 0))
                continue
            grew = len(keep) == len(self._members(w))      # no writer dropped: the set grew by ``rid``
            new.append(pack(self._set(keep + [rid], (w, rid) if grew else None), 0))
        sh.assign(*selection, values, new)

    def _releases(self, view) -> VectorClock:
        """The joined vector clocks published by whatever last wrote ``view`` (what a poll or load that sees it
        now acquires)."""
        sh = view.store.shadow
        if sh is None or not sh.written():
            return EMPTY
        writers = tuple(sorted({unpack(v)[0] for v in sh.distinct(*sh.select(view))}))
        joined = self._joined.get(writers)
        if joined is None:                  # the cores polling one status view see the same writers: join once
            if len(self._joined) >= _JOINED_LIMIT:
                self._joined = {}
            joined = self._joined[writers] = join_all([self._published(w) for w in writers])
        return joined

    def _published(self, writer: int) -> VectorClock:
        """The joined releases of writer id ``writer`` (an access, or a set of unordered atomic writers: memoised
        per set, and a set that grew from another by one writer joins that one's and the new writer's)."""
        if writer >= 0:
            return self._release_of(self.records[writer]) if writer > OLD else EMPTY
        memo = self._set_release
        grown = []
        s = writer
        while s < 0 and s not in memo and s in self._set_parent:
            grown.append(s)
            s = self._set_parent[s][0]
        if s >= 0:
            out = self._release_of(self.records[s]) if s > OLD else EMPTY
        else:
            out = memo.get(s)
            if out is None:
                out = join_all([self._release_of(self.records[m]) for m in self.sets[-s]])
        if grown:
            out = join_all([out] + [self._release_of(self.records[self._set_parent[g][1]]) for g in grown])
        if len(memo) >= _JOINED_LIMIT:     # a few recent sets: most counters are polled once, then never again
            memo.clear()
        memo[writer] = out
        return out

    @staticmethod
    def _release_of(rec: Record) -> VectorClock:
        rel = rec.release
        if rel is None and rec.entry in _IN_ORDER and rec.write and rec.hb[0] is not None:
            # a data write seen as a flag: it closes its core's earlier writes of its pipe to this die
            rel = rec.release = publish(rec.hb, rec.name, {(rec.pipe, rec.store.die): rec.hb[1]})
        return EMPTY if rel is None else rel

    # ------------------------------------------------------------------ reports
    def _unordered(self, first: Record, second: Record) -> None:
        """Two accesses of different cores, ``first`` earlier, nothing ordering it before ``second``; one of them
        a write (two writes are handled by ``_write``)."""
        if first.write:                                     # a read of data another core wrote
            rel = _later_release(second.hb[3], first)
            if rel is not None:
                self._report("flag-misuse", first, second, self._missing_after(first, rel))
            else:
                self._report("unpublished-read", first, second, self._missing_publish(first, second))
        elif second.start <= first.time and second.hb[0] not in first.consumed:
            # the write was on its way when the read sampled, and the read was not of this writer's earlier message
            # (that one is a slot reused before the reader was done with it)
            self._withdraw(self._uninit.pop(first, None))  # what it read is this write's, not nothing
            rel = _later_release(first.hb[3], second)
            if rel is not None:
                self._report("flag-misuse", second, first, self._missing_after(second, rel))
            else:
                self._report("unpublished-read", second, first, self._missing_publish(second, first))
        else:
            rel = _later_release(second.hb[3], first)
            reader = first.access()
            if rel is not None:
                missing = (f"{rel[0]} of {reader.where} ('{rel[1]}'), which the writer observed, came after the read "
                           f"in program order but does not wait for it: give it after='{AFTER_PIPE[first.entry]}'")
            else:
                missing = (f"nothing {reader.where} released after its read (a flag, atomic or barrier) was observed "
                           f"by the writer: wait for the reader's acknowledgement before reusing the bytes")
            self._report("slot-reuse", first, second, missing)

    def _write_write(self, first: Record, second: Record) -> None:
        """Two writes of different cores, ``first`` landed earlier, nothing ordering it before ``second``: a data
        race, or flag misuse when ``second`` was on its way and ``first``'s core had observed a release of
        ``second``'s core issued after it (it took ``second`` for published)."""
        rel = _later_release(first.hb[3], second) if second.hb[0] is not None and second.start <= first.time \
            else None
        if rel is not None:
            self._report("flag-misuse", second, first, self._missing_after(second, rel))
        else:
            self._report("data-race", first, second, self._missing_write(first, second))

    @staticmethod
    def _missing_after(write: Record, rel: tuple) -> str:
        pipe = AFTER_PIPE.get(write.entry, "all")
        return (f"{rel[0]} of {write.access().where} ('{rel[1]}'), which the reader observed, was issued after this "
                f"{write.name} but does not wait for it to land: give it after='{pipe}'")

    @staticmethod
    def _missing_publish(write: Record, read: Record) -> str:
        w, r = write.access(), read.access()
        return (f"{r.where} read without observing a flag, atomic or barrier that {w.where} released after the write: "
                f"wait for the writer's flag before reading")

    @staticmethod
    def _missing_write(first: Record, second: Record) -> str:
        a, b = first.access(), second.access()
        return (f"nothing orders {a.where}'s {a.instruction} before {b.where}'s {b.instruction}: "
                f"give each core its own bytes, use atomics, or have the second writer wait for a flag the first "
                f"publishes after its write")

    def _report(self, kind: str, first: Record | None, second: Record, missing: str) -> Race:
        clock = second.hb[0] or (first.hb[0] if first is not None else None)
        return self._add_race(Race(kind, None if first is None else first.access(), second.access(), missing),
                              None if clock is None else clock.launch)

    def _add_race(self, race: Race, launch) -> Race:
        """Record ``race``, or count it on the same race (same kinds, cores, instructions, tensor) of this run."""
        key = race.signature
        seen = self._seen.get(key)
        if seen is not None:
            seen.count += 1
            return seen
        self._seen[key] = race
        self.races.append(race)
        self._pending.append((race, launch))
        return race

    def _withdraw(self, race: Race | None) -> None:
        """Take back one count of ``race`` (a report a later landing explained better)."""
        if race is None:
            return
        if race.count > 1:
            race.count -= 1
            return
        self.races = [r for r in self.races if r is not race]
        self._pending = [(r, la) for r, la in self._pending if r is not race]
        self._seen.pop(race.signature, None)

    # ------------------------------------------------------------------ ids
    def _add(self, rec: Record) -> int:
        self.records.append(rec)
        return len(self.records) - 1

    def _members(self, u: int):
        if u > OLD:
            return (u,)
        if u < 0:
            return self.sets[-u]
        return ()

    def _set(self, ids: list, parent: tuple | None = None) -> int:
        """The id of the set of access ids ``ids`` (``parent``: (writer id, access id) when it is that writer's
        set plus that access, for ``_published``)."""
        key = tuple(sorted(set(ids)))
        if len(key) == 1:
            return key[0]
        i = self._set_ids.get(key)
        if i is None:
            self.sets.append(key)
            i = self._set_ids[key] = len(self.sets) - 1
            if parent is not None:
                self._set_parent[-i] = parent
        return -i

    def _compact(self) -> None:
        """Nothing runs or is parked: every access so far is ordered before whatever comes next, so records give
        way to the OLD marker (written, ordered) and unused memory is freed."""
        for sh in self._shadows:
            sh.compact(OLD)
        self.records = [None, None]
        self.sets = [None]
        self._set_ids = {}
        self._set_parent = {}
        self._set_release = {}
        self._joined = {}
        self._launch_end = {}
        self._stream_last = {}


def _later_release(vc: VectorClock, rec: Record):
    """The release of ``rec``'s core that ``vc`` learned, when it came after ``rec`` in program order (so the
    synchronisation was meant to cover it and did not), else None."""
    c = rec.hb[0]
    if c is None or c.gen != vc.gen:
        return None
    issued = vc.know(c.cid, ISSUED)
    if issued >= rec.hb[1]:
        return c.released.get(issued)
    return None


class _Span:
    """A contiguous byte range of a store (what a host write's landing reports)."""

    __slots__ = ("store", "lo", "hi")

    def __init__(self, store, lo, hi):
        self.store, self.lo, self.hi = store, lo, hi
