"""Happens-before for the race sanitizer: what each core knows of its own work, and of every other core's.

A core runs several pipes at once, so its own instructions are not ordered by issue order: only the scheduler's
dependencies order them (the pipe's in-order issue, read-after-write / write-after-read / write-after-write on a tile
or GM range, ``after=``, drains, a blocking instruction the scalar unit waited for). The sanitizer keeps, per
instruction, its **own knowledge**: a tuple of seven issue numbers (instructions of one core are numbered 1, 2, ...
as issued), each a frontier "every instruction of this kind numbered up to here has completed before I start":

    MTE2_READ   GM reads of MTE2 copies (sampled at their start)      MTE3_WRITE  GM writes of MTE3 copies (landed)
    FIXP_WRITE  GM writes of the fixpipe (landed)                    DMA_READ / DMA_WRITE  the DMA engine's
    STORE       posted scalar stores (landed)                        BLOCKING    blocking accesses (polls, atomics)

A dependency on an instruction passes on what it knew and that it started (its reads are done); ``after=`` a pipe
passes on that every earlier instruction of the pipe has landed (the pipe's end, as the engine orders it); a drain
(``after="all"``, ``barrier``, ``pipe_barrier``, kernel end) that everything issued before it has. Frontiers are kept
only for the pipes that reach GM; the others pass knowledge on without entries of their own.

Across cores, each core has a **vector clock** (``VectorClock``): one int32 row per core clock (a dense id per
core and launch, handed out per generation: between runs with nothing parked the ids start again) holding that
core's own knowledge at the release it learned it from and that release's issue number (``ISSUED``: how far in the
releasing core's program it was; the core keeps what each release was, for messages), plus ``fifo`` frontiers
(below) and a ``host`` entry. A join is one ``numpy.maximum``; a release is its core's clock at issue (shared, not
copied) plus its own row, and a clock that changed in a few rows keeps those beside the array it shares: a release
costs one row, an acquire the rows it changed (a new array when they are many). Releases are flag
stores, atomics, barrier arrivals, cross-core flag sets and kernel ends; acquires are the polls and loads that see
a flag, atomics (each one continues the chain of the atomics before it on that word), barrier departures,
cross-core waits and launch starts.

A core's MTE3 writes to one die arrive in issue order (one queue over one path: the scheduler lands them so), and so
do its fixpipe writes; a poll that sees such a write (an accumulating copy used as an arrival counter, a status
record copied out) therefore learns that the core's earlier writes of that pipe to that die have landed. Such a write
publishes, lazily when a poll sees it, the frontier ``fifo[(clock id, pipe, die)]``. Host synchronisation is by
run: everything of one ``synchronize`` happens before the launches of the next ones and before the host's writes made
after it returns; the ``host`` entry carries what a core learned from a host write it saw land (``(host write
number, run it was issued after)``).

Exact for the edges the engine knows, with one conservative approximation: a read-after-write dependency on one
landed GM write does not count as that write's pipe having landed (only ``after=`` or a drain does), so publishing
a write through a later read of it on the same core is reported.
"""
from __future__ import annotations

import numpy as np

MTE2_READ, MTE3_WRITE, FIXP_WRITE, DMA_READ, DMA_WRITE, STORE, BLOCKING = range(7)
ISSUED = 7                        # the row field beyond the own-knowledge frontiers
NOTHING = (0, 0, 0, 0, 0, 0, 0)

# the frontier an instruction advances when it starts (its GM reads are done) and when it lands (its GM write is)
START_MARK = {"copy_gm_to_ub": MTE2_READ, "copy_gm_to_l1": MTE2_READ, "gather_gm_to_ub": MTE2_READ,
              "dma_copy": DMA_READ}
LAND_MARK = {"copy_ub_to_gm": MTE3_WRITE, "copy_ub_to_gm_add": MTE3_WRITE, "scatter_ub_to_gm": MTE3_WRITE,
             "copy_l0c_to_gm": FIXP_WRITE, "dma_copy": DMA_WRITE, "gm_store": STORE, "atomic_add": BLOCKING,
             "atomic_cas": BLOCKING}
PIPE_MARKS = {"MTE2": (MTE2_READ,), "MTE3": (MTE3_WRITE,), "FIXP": (FIXP_WRITE,), "DMA": (DMA_READ, DMA_WRITE)}
# the pipe whose after= would order a GM access of an instruction (for the messages' suggestions)
AFTER_PIPE = {MTE2_READ: "MTE2", MTE3_WRITE: "MTE3", FIXP_WRITE: "FIXP", DMA_READ: "DMA", DMA_WRITE: "DMA"}


class CoreClock:
    """The sanitizer's state of one core in one launch: its issue counter, what its scalar unit knows (own knowledge
    and vector clock), the last instruction of each pipe, and when it started (``start_epoch``: the run)."""

    __slots__ = ("unit", "die", "kernel", "launch", "n", "own", "vc", "last", "stores", "blocked", "start_epoch",
                 "killed", "cid", "gen", "released")

    def __init__(self, core, vc, start_epoch: int, cid: int = 0, gen: int = 0):
        self.unit = core.unit
        self.die = core.die
        self.kernel = core.launch.name
        self.launch = core.launch
        self.n = 0
        self.own = NOTHING
        self.vc = vc
        self.last: dict = {}         # pipe -> its last issued instruction
        self.stores = NOTHING         # joined own knowledge of the core's non-blocking sync instructions
        self.blocked = None           # the blocking instruction the scalar unit waits for
        self.start_epoch = start_epoch
        self.killed = False           # its die was killed (Pod.kill_die): it accesses nothing any more
        self.cid = cid                # its row in vector clocks of generation ``gen``
        self.gen = gen
        self.released: dict = {}      # issue number -> (op, kernel, where) of each release it published

    @property
    def where(self) -> str:
        return f"die {self.die} {self.unit}"

    def __repr__(self) -> str:
        return f"<CoreClock {self.kernel!r} {self.where}>"


def join(a: tuple, b: tuple) -> tuple:
    """Elementwise max of two own-knowledge tuples."""
    if a is b:
        return a
    return (a[0] if a[0] >= b[0] else b[0], a[1] if a[1] >= b[1] else b[1], a[2] if a[2] >= b[2] else b[2],
            a[3] if a[3] >= b[3] else b[3], a[4] if a[4] >= b[4] else b[4], a[5] if a[5] >= b[5] else b[5],
            a[6] if a[6] >= b[6] else b[6])


def raised(k: tuple, entries, n: int) -> tuple:
    """``k`` with each of ``entries`` at least ``n``."""
    out = list(k)
    for e in entries:
        if out[e] < n:
            out[e] = n
    return tuple(out)


def started(ins) -> tuple:
    """What an instruction's dependents learn once it has started (its GM reads are done)."""
    return ins.hb[4]


def start_knowledge(name: str, own: tuple, n: int) -> tuple:
    """``own`` (the knowledge of instruction ``n``, op ``name``) plus its own start: what ``started`` returns."""
    mark = START_MARK.get(name)
    if mark is None or own[mark] >= n:
        return own
    return raised(own, (mark,), n)


def drained(n: int) -> tuple:
    """Own knowledge after a drain before instruction ``n``: everything issued before it has completed."""
    return (n - 1,) * 7



class VectorClock:
    """What a core knows of the others (never changed in place: instructions keep the one their core had when they
    were issued). ``rows``: an int32 array (clock ids, 8) or None, per core clock of the generation ``gen`` (ids are
    dense, handed out per generation by the sanitizer) its seven frontiers and ``ISSUED``; ``overlay``: None or
    {clock id: 8-tuple}, rows that replace (are at least) ``rows``' own: a clock that differs from another in a few
    rows shares that one's array and keeps only those (``OVERLAY_ROWS`` at most); ``fifo``: None or
    {(clock id, pipe, die): issue number} (the in-order frontiers); ``host``: None or (host write number, run). Rows
    of an older generation than the one they meet in a join are dropped: a generation ends only between runs with
    nothing parked, when the run boundary orders everything."""

    __slots__ = ("rows", "gen", "overlay", "fifo", "host")

    def __init__(self, rows=None, gen: int = 0, overlay=None, fifo=None, host=None):
        self.rows, self.gen, self.overlay, self.fifo, self.host = rows, gen, overlay, fifo, host

    def __bool__(self) -> bool:
        return self.rows is not None or bool(self.overlay) or bool(self.fifo) or self.host is not None

    def know(self, cid: int, field: int) -> int:
        """Frontier ``field`` (or ``ISSUED``) of clock id ``cid`` (0: nothing)."""
        ov = self.overlay
        if ov is not None:
            row = ov.get(cid)
            if row is not None:
                return row[field]
        rows = self.rows
        return int(rows[cid, field]) if rows is not None and cid < rows.shape[0] else 0

    def solid_rows(self):
        """``rows`` with ``overlay`` applied (a new array when there is an overlay)."""
        ov = self.overlay
        if not ov:
            return self.rows
        rows = self.rows
        size = max(ov) + 1
        out = _padded(rows, size if rows is None else max(rows.shape[0], size), copy=True)
        out[list(ov)] = list(ov.values())
        return out

    def host_only(self) -> "VectorClock":
        return VectorClock(host=self.host) if self.host is not None else EMPTY


EMPTY = VectorClock()
_WIDTH = ISSUED + 1
OVERLAY_ROWS = 32        # rows a clock keeps beside a shared array before it gets an array of its own


def _padded(rows, size: int, copy: bool = False):
    """``rows`` (or nothing) as an array of ``size`` rows, zeros below."""
    if rows is not None and rows.shape[0] == size:
        return rows.copy() if copy else rows
    out = np.zeros((size, _WIDTH), dtype=np.int32)
    if rows is not None:
        out[:rows.shape[0]] = rows
    return out


def _has_rows(vc: VectorClock) -> bool:
    return vc.rows is not None or bool(vc.overlay) or bool(vc.fifo)


def _join_fifo(a: dict | None, b: dict | None) -> dict | None:
    if a is b or not b:
        return a
    if not a:
        return b
    if all(a.get(k, 0) >= v for k, v in b.items()):
        return a
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


def _join_host(a, b):
    if b is None or a is b:
        return a
    if a is None:
        return b
    if a[0] >= b[0] and a[1] >= b[1]:
        return a
    return (max(a[0], b[0]), max(a[1], b[1]))


def _shared(rows, base, gen: int, fifo, host) -> VectorClock:
    """A clock of ``rows`` (a fresh array) kept as ``base`` plus an overlay when they differ in few rows."""
    if base is not None and base.shape[0] <= rows.shape[0]:
        n = base.shape[0]
        changed = np.flatnonzero((rows[:n] != base).any(axis=1)).tolist() + list(range(n, rows.shape[0]))
        if len(changed) <= OVERLAY_ROWS:
            return VectorClock(base, gen, {c: tuple(rows[c].tolist()) for c in changed} or None, fifo, host)
    return VectorClock(rows, gen, None, fifo, host)


def join_vc(a: VectorClock, b: VectorClock) -> VectorClock:
    """Join two vector clocks; returns ``a`` itself when ``b`` adds nothing."""
    if a is b or not b:
        return a
    if not a:
        return b
    if a.gen != b.gen and _has_rows(a) and _has_rows(b):
        return join_vc(a, b.host_only()) if a.gen > b.gen else join_vc(a.host_only(), b)
    host = _join_host(a.host, b.host)
    fifo = _join_fifo(a.fifo, b.fifo)
    ar = a.solid_rows()
    br = b.solid_rows()
    rows = None                                   # the joined rows when they differ from a's
    if br is not None:
        if ar is None:
            rows = br if b.rows is not br else br.copy()
        else:
            na, nb = ar.shape[0], br.shape[0]
            if nb <= na:
                if (br > ar[:nb]).any():
                    rows = ar.copy() if ar is a.rows else ar
                    np.maximum(rows[:nb], br, out=rows[:nb])
            else:
                rows = _padded(br, nb, copy=True)
                np.maximum(rows[:na], ar, out=rows[:na])
    if rows is None and fifo is a.fifo and host is a.host:
        return a
    gen = max(a.gen, b.gen) if ar is not None or rows is not None or fifo else 0
    if rows is None:
        return VectorClock(a.rows, gen, a.overlay, fifo, host)
    return _shared(rows, a.rows if a.rows is not None else b.rows, gen, fifo, host)


def join_all(clocks: list) -> VectorClock:
    """The join of many vector clocks (a poll seeing many writers' releases): each distinct ``rows`` array once, the
    overlay rows merged per clock id first (releases of one core share most of theirs), and the fifo frontiers in one
    dict."""
    clocks = [c for c in clocks if c]
    if len(clocks) <= 1:
        return clocks[0] if clocks else EMPTY
    gen = max((c.gen for c in clocks if _has_rows(c)), default=0)
    host = None
    fifos = []
    bases: dict = {}
    merged: dict = {}
    size = 0
    for c in clocks:
        host = _join_host(host, c.host)
        if c.gen != gen:
            continue
        if c.fifo:
            fifos.append(c.fifo)
        rows = c.rows
        if rows is not None and id(rows) not in bases:
            bases[id(rows)] = rows
            size = max(size, rows.shape[0])
        if c.overlay:
            for cid, row in c.overlay.items():
                old = merged.get(cid)
                if old is None:
                    merged[cid] = row
                elif old is not row and old != row:
                    merged[cid] = tuple(x if x >= y else y for x, y in zip(old, row))
    fifo = fifos[0] if len(fifos) == 1 else _merge_fifos(fifos) if fifos else None
    if merged:
        size = max(size, max(merged) + 1)
    if not size:
        return VectorClock(None, gen if fifo else 0, None, fifo, host)
    rows = np.zeros((size, _WIDTH), dtype=np.int32)
    largest = None
    for base in bases.values():
        np.maximum(rows[:base.shape[0]], base, out=rows[:base.shape[0]])
        if largest is None or base.shape[0] > largest.shape[0]:
            largest = base
    if merged:
        ids = list(merged)
        rows[ids] = np.maximum(rows[ids], np.array(list(merged.values()), dtype=np.int32))
    return _shared(rows, largest, gen, fifo, host)


def _merge_fifos(fifos: list) -> dict:
    out = dict(fifos[0])
    for f in fifos[1:]:
        if f is fifos[0]:
            continue
        for k, v in f.items():
            if out.get(k, 0) < v:
                out[k] = v
    return out


def release(ins, fifo: dict | None = None) -> VectorClock:
    """The vector clock a release instruction publishes: its core's clock at issue plus its own knowledge (and
    ``fifo``: the in-order writes it closes, for a write that a poll saw)."""
    return publish(ins.hb, ins.spec.name, fifo)


def publish(hb: tuple, name: str, fifo: dict | None = None) -> VectorClock:
    """``release`` from an instruction's happens-before record ``hb`` and op name; the release's description is
    kept by its clock (``CoreClock.released``), found again through its issue number."""
    clock, n, own, vc = hb[:4]
    mark = LAND_MARK.get(name)
    if mark is not None and own[mark] < n:        # whoever sees a store or an atomic knows that it landed
        own = raised(own, (mark,), n)
    clock.released.setdefault(n, (name, clock.kernel, clock.where))
    if vc.gen != clock.gen and _has_rows(vc):
        vc = vc.host_only()
    out_fifo = vc.fifo
    if fifo:
        out_fifo = _join_fifo(vc.fifo, {(clock.cid,) + k: v for k, v in fifo.items()})
    row = own + (n,)
    known = vc.know(clock.cid, ISSUED) and tuple(vc.know(clock.cid, f) for f in range(_WIDTH))
    if known:                                     # what the clock knew of its own core (through others) stays
        row = tuple(x if x >= y else y for x, y in zip(row, known))
    overlay = dict(vc.overlay) if vc.overlay else {}
    overlay[clock.cid] = row
    return VectorClock(vc.rows, clock.gen, overlay, out_fifo, vc.host)
