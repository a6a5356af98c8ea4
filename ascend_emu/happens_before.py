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

Across cores, each core has a **vector clock**: a dict from the clock of each core it has synchronised with to that
core's own knowledge at the release it learned it from, plus that release's issue number (``ISSUED``: how far in
the releasing core's program it was), what it was (for messages) and ``FIFO`` frontiers (below). Releases are flag
stores, atomics, barrier arrivals, cross-core flag sets and kernel ends; acquires are the polls and loads that see
a flag, atomics (each one continues the chain of the atomics before it on that word), barrier departures,
cross-core waits and launch starts.

A core's MTE3 writes to one die arrive in issue order (one queue over one path: the scheduler lands them so), and so
do its fixpipe writes; a poll that sees such a write (an accumulating copy used as an arrival counter, a status
record copied out) therefore learns that the core's earlier writes of that pipe to that die have landed. Such a write
publishes, lazily when a poll sees it, the frontier ``FIFO[(pipe, die)]``. Host synchronisation is by run: everything of
one ``synchronize`` happens before the launches of the next ones and before the host's writes made after it returns; the
``HOST`` entry carries what a core learned from a host write it saw land (``(host write number, run it was issued
after)``).

Exact for the edges the engine knows, with one conservative approximation: a read-after-write dependency on one
landed GM write does not count as that write's pipe having landed (only ``after=`` or a drain does), so publishing
a write through a later read of it on the same core is reported.
"""
from __future__ import annotations

MTE2_READ, MTE3_WRITE, FIXP_WRITE, DMA_READ, DMA_WRITE, STORE, BLOCKING = range(7)
ISSUED, RELEASE, FIFO = 7, 8, 9   # entry fields beyond the own-knowledge frontiers
NOTHING = (0, 0, 0, 0, 0, 0, 0)
HOST = "host"                     # the vector-clock key of host writes

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
                 "killed")

    def __init__(self, core, vc: dict, start_epoch: int):
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


def join_entry(a: tuple, b: tuple) -> tuple:
    """Join two vector-clock entries (own knowledge, issue number, release description, FIFO frontiers; or host
    entries)."""
    if a is b:
        return a
    if len(a) == 2:                                   # HOST: (host write number, run)
        return (max(a[0], b[0]), max(a[1], b[1]))
    fifo = _join_fifo(a[FIFO], b[FIFO])
    if fifo is a[FIFO] and all(a[i] >= b[i] for i in range(8)):
        return a
    if fifo is b[FIFO] and all(b[i] >= a[i] for i in range(8)):
        return b
    k = tuple(a[i] if a[i] >= b[i] else b[i] for i in range(8))
    return k + (a[RELEASE] if a[ISSUED] >= b[ISSUED] else b[RELEASE], fifo)


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


def join_vc(a: dict, b: dict) -> dict:
    """Join two vector clocks; returns ``a`` itself when ``b`` adds nothing (vector clocks are never changed in
    place: instructions keep the one their core had when they were issued)."""
    if a is b or not b:
        return a
    if not a:
        return b
    out = None
    for key, e in b.items():
        m = a.get(key)
        if m is e:
            continue
        j = e if m is None else join_entry(m, e)
        if j is m:
            continue
        if out is None:
            out = dict(a)
        out[key] = j
    return a if out is None else out


def release(ins, fifo: dict | None = None) -> dict:
    """The vector clock a release instruction publishes: its core's clock at issue plus its own knowledge (and
    ``fifo``: the in-order writes it closes, for a write that a poll saw)."""
    return publish(ins.hb, ins.spec.name, fifo)


def publish(hb: tuple, name: str, fifo: dict | None = None) -> dict:
    """``release`` from an instruction's happens-before record ``hb`` and op name."""
    clock, n, own, vc = hb[:4]
    mark = LAND_MARK.get(name)
    if mark is not None and own[mark] < n:        # whoever sees a store or an atomic knows that it landed
        own = raised(own, (mark,), n)
    entry = own + (n, (name, clock.kernel, clock.where), fifo)
    old = vc.get(clock)
    out = dict(vc)
    out[clock] = entry if old is None else join_entry(old, entry)
    return out
