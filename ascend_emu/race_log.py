"""The race sanitizer over several workers: each worker logs what its dies tell the sanitizer, and worker 0 replays
the logs, merged in the one process's order, into the pod's ``Sanitizer`` (DESIGN.md 3.6, 10; workers.py).

The sanitizer's state is global (a GM word's last writer and readers are checked against accesses from every die;
a barrier joins every arriving core's clock; races are numbered and merged by signature in the order found), so
rather than split it, one process keeps it and the others send it what happened. In a partitioned run every
worker's engine and pod talk to a ``Recorder`` instead of the sanitizer; it turns each hook into a record keyed by
the event being processed - its place in one process's order of events, which any partitioning keeps
(``Recorder.popped``) - then by its place in that event. Within a host event (replicated on every worker) the pod's
hooks (launches starting and ending, host writes, allocations) are logged by worker 0 only and numbered, and a die's
hooks come after the pod hook before them, worker by worker. Records of instructions name them by
(launch serial, core index, issue number) and carry what the sanitizer reads of them then (GM views, start,
gather rows); worker 0 holds one stand-in per instruction (``_Ins``) with the core and launch replicas it has.
Local-tile checks (``uninitialized-read`` of UB / L1 / L0) need only the core's own tiles: the recorder runs them
where the core runs and logs the race.

Logs travel to worker 0 with each window's messages and are replayed after the window's exchange, so the sanitizer
is at most one window behind. ``sanitize=True`` raises at the end of the launch that raced: every launch end is
then a synchronisation point (two exchanges): the workers send their logs, worker 0 replays them up to the launch's
end and tells the others whether it raised and with which races, and every worker raises the same ``RaceError``.

Cost: one record per instruction and per GM access, pickled once per window, and all sanitizer work on worker 0;
a sanitized run is a correctness check, so it is bounded by worker 0's replay rather than split.
"""
from __future__ import annotations

import pickle
from bisect import bisect_right

from .errors import RaceError
from .isa import OPS, TRANSFER, rows_of
from .races import race_error
from .sanitizer import Sanitizer
from .transport import NEVER

_WAIT_GM, _GM_LOAD = OPS["wait_gm"], OPS["gm_load"]
_KEEP = ("after", "flag", "group")          # what the sanitizer reads of an instruction's parameters


class _Who:
    """What a local-tile check reads of a core's clock (``Sanitizer._check_local``)."""

    __slots__ = ("kernel", "die", "unit", "launch")

    def __init__(self, core):
        self.kernel, self.die, self.unit, self.launch = core.launch.name, core.die, core.unit, core.launch


class Recorder:
    """A worker's sanitizer during a partitioned run: the hooks of ``Sanitizer`` (the engine's and the pod's), each
    logged as a record ``(key, kind, *data)`` in ``log``. ``san``: this process's sanitizer (its mode and host-write
    count; it gets the races back); ``part``: the worker's ``workers.Partition``."""

    def __init__(self, san, part):
        self.san, self.part, self.engine = san, part, part.engine
        self.mode = san.mode
        self.host_writes = san.host_writes      # Stream.launch reads it during a run (Launch.host_writes_before)
        self.rank = part.rank
        self.log: list = []
        self._root, self._pos = (-1,), 0        # the event being processed: its place in one process's order
        self._event = None                      # the place of the event the last record belongs to
        self._pod = self._seq = 0
        self._issued: dict = {}                 # core -> instructions it issued (its next issue number - 1)
        self._core_ids: dict = {}               # id(core) -> (launch serial, index in its launch's cores)

    # ------------------------------------------------------------------ records
    def popped(self, t: int, origin: int, count: int) -> None:
        """``Engine.run`` took event (t, origin, count). One process takes the least pending event, except that
        an event queued at the present with a smaller key than the one being processed (a core resumed by a
        message from a die numbered after it) is taken next, before the others: it follows its root, the last
        event taken as the least. Such pushes stay on one worker (a message to another lands a look-ahead
        later), so each worker finds the roots of its events, and (root, place after it) is the order of one
        process."""
        key = (t, origin, count)
        if key > self._root or t < self._root[0]:
            # the least pending event; or the host's observation of a launch's end, queued once the workers had
            # exchanged their completions (at the window's end): taken after later events, placed by its key
            self._root, self._pos = key, 0
        else:
            self._pos += 1

    def _key(self, pod: bool) -> tuple:
        event = self._root + (self._pos,)
        if event != self._event:
            self._event, self._pod, self._seq = event, 0, 0
        if pod:
            self._pod += 1
            return event + (self._pod, -1, 0)
        self._seq += 1
        return event + (self._pod, self.rank, self._seq)

    def _add(self, kind: str, *data) -> None:
        self.log.append((self._key(False), kind) + data)

    def _add_pod(self, kind: str, *data) -> tuple:
        """A hook every worker meets in the same host event: numbered on each, logged by worker 0."""
        key = self._key(True)
        if self.rank == 0:
            self.log.append((key, kind) + data)
        return key

    def take(self) -> list:
        out, self.log = self.log, []
        return out

    def core_id(self, core) -> tuple:
        cid = self._core_ids.get(id(core))
        if cid is None:
            la = core.launch
            for i, c in enumerate(la.cores):
                self._core_ids[id(c)] = (la.serial, i)
            cid = self._core_ids[id(core)]
        return cid

    @staticmethod
    def _view(v):
        if v.store.space != "GM":
            return None
        return (v.store.uid, v.offset, v.shape, v.strides, v.dtype, v.lo, v.hi)

    # ------------------------------------------------------------------ the pod's hooks
    def track(self, tensor) -> None:
        self._add_pod("track", tensor)

    def host_wrote(self, view) -> None:
        self.host_writes += 1
        self._add_pod("host_wrote", view)

    def launch_starting(self, la) -> None:
        self._add_pod("launch_starting", la)

    def launch_done(self, la) -> None:
        key = self._add_pod("launch_done", la)
        if self.mode is True:           # it may raise here: every worker's events so far decide
            self.part.race_sync(la, key)

    def killed(self, cores) -> None:
        if cores:
            self._add("killed", [self.core_id(c) for c in cores])

    # ------------------------------------------------------------------ the engine's hooks
    def issued(self, core, ins) -> None:
        n = self._issued.get(core, 0) + 1
        self._issued[core] = n
        ins.hb = tag = self.core_id(core) + (n,)
        p = ins.p
        self._add("issue", tag, ins.spec.name, {k: p[k] for k in _KEEP if k in p} if p else None, ins.blocking,
                  [self._view(v) for v in ins.srcs], [self._view(v) for v in ins.dsts])
        self._local(ins, _Who(core))

    _local = Sanitizer._local
    _check_local = Sanitizer._check_local

    def _add_race(self, race, launch) -> None:
        self._add("race", race, launch.serial)

    def depends(self, ins, other) -> None:
        self._add("dep", other.hb)

    def transfer(self, ins) -> None:
        if ins.srcs[0].store.space == "GM":
            self._add("read", ins.hb, ins.start, rows_of(ins) if ins.spec.gm_rows else None)
        dst = ins.dsts[0]
        if dst.store.space == "GM" and not ins.real:
            # Sanitizer.transfer queues the check of a phantom write at its landing (``end``, on the destination's
            # die), which may come sooner than the look-ahead on another worker's die: here it is a record with
            # that event's key (the same count taken), replayed in its place (dropped there if the core was killed)
            eng = self.engine
            home = eng.home
            self.log.append(((ins.end, home, eng._count(home), 0, 0, self.rank, 0), "phantom", ins.hb, ins.start,
                             rows_of(ins) if ins.spec.gm_rows else None))

    def landed(self, store, lo: int, hi: int, writer) -> None:
        if writer is None:              # a host write landing: replicated on every worker
            self.host_writes += 1
            self._add_pod("host_landed", store.uid, lo, hi)
            return
        spec = writer.spec
        rows = rows_of(writer) if spec.kind == TRANSFER and spec.gm_rows else None
        self._add("landed", store.uid, lo, hi, writer.hb, writer.start, rows)

    def sync(self, ins) -> None:
        self._add("sync", ins.hb, ins.start)

    def completed(self, ins, value) -> None:
        if value is None and (ins.spec is _WAIT_GM or ins.spec is _GM_LOAD):
            return                      # a poll that timed out acquires nothing (Sanitizer.completed)
        self._add("done", ins.hb, ins.start, value is not None)


class _Ins:
    """Worker 0's stand-in for an instruction of any worker, as the sanitizer reads it."""

    __slots__ = ("spec", "p", "srcs", "dsts", "core", "start", "blocking", "hb")


class _Clock:
    """The sanitizer's engine while it replays: the time of the record's event."""

    __slots__ = ("now",)

    def __init__(self):
        self.now = 0

    def send(self, *_):     # pragma: no cover - the replay calls no hook that queues events
        raise AssertionError("a replayed sanitizer hook queued an event")


class Replayer:
    """Worker 0's side: the records of every worker, replayed in key order into the pod's sanitizer."""

    def __init__(self, pod, part, san):
        self.pod, self.part, self.san = pod, part, san
        self.pending: list = []
        self.ins: dict = {}                 # (launch serial, core index, n) -> _Ins
        self._launches: dict = {}
        self.clock = _Clock()

    def add(self, records: list) -> None:
        self.pending += records

    def _launch(self, serial: int):
        la = self._launches.get(serial)
        if la is None:
            self._launches = {x.serial: x for x in self.pod._launches}
            la = self._launches[serial]
        return la

    def _core(self, cid: tuple):
        return self._launch(cid[0]).cores[cid[1]]

    def _view(self, data):
        return None if data is None else self.part.codec.view_of(data)

    def replay(self, bound: tuple | None = None) -> None:
        """Replay the records received so far whose key is at most ``bound`` (None: all), in key order (each
        worker's come in order but for phantom landings, logged ahead of their time; the merge is a sort)."""
        if not self.pending:
            return
        self.pending.sort(key=_first)
        if bound is None:
            records, self.pending = self.pending, []
        else:
            n = bisect_right(self.pending, bound, key=_first)
            records, self.pending = self.pending[:n], self.pending[n:]
        san, clock = self.san, self.clock
        engine, san.engine = san.engine, clock
        redirect, san.redirect = san.redirect, None
        san._local = _nothing               # local tiles were checked where the core ran (Recorder)
        try:
            for i, rec in enumerate(records):
                clock.now = rec[0][0]
                try:
                    getattr(self, "_" + rec[1])(*rec[2:])
                except RaceError:           # sanitize=True at a launch's end: what follows is not replayed
                    self.pending = records[i + 1:] + self.pending
                    raise
        finally:
            san.engine, san.redirect = engine, redirect
            del san._local

    def _get(self, tag: tuple, start: int | None = None) -> _Ins:
        ins = self.ins[tag]
        if start is not None:
            ins.start = start
        return ins

    # ------------------------------------------------------------------ one per record kind
    def _track(self, tensor):
        self.san.track(tensor)

    def _host_wrote(self, view):
        self.san.host_wrote(view)

    def _launch_starting(self, la):
        self.san.launch_starting(la)

    def _launch_done(self, la):
        self.san.launch_done(la)

    def _killed(self, cids):
        self.san.killed([self._core(c) for c in cids])

    def _issue(self, tag, spec, p, blocking, srcs, dsts):
        ins = self.ins[tag] = _Ins()
        ins.spec, ins.p, ins.blocking, ins.hb, ins.start = OPS[spec], p or {}, blocking, None, -1
        ins.srcs, ins.dsts = [self._view(v) for v in srcs], [self._view(v) for v in dsts]
        ins.core = self._core(tag)
        self.san.issued(ins.core, ins)

    def _race(self, race, serial):
        self.san._add_race(race, self._launch(serial))

    def _dep(self, tag):
        self.san.depends(None, self.ins[tag])

    def _read(self, tag, start, rows):
        ins = self._get(tag, start)
        self.san._read(ins, ins.srcs[0], rows)

    def _phantom(self, tag, start, rows):
        ins = self._get(tag, start)
        if not ins.hb[0].killed:            # its core's die was killed before it landed (Sanitizer._land_phantom)
            self.san._write(ins, ins.dsts[0], rows, False, None)

    def _landed(self, uid, lo, hi, tag, start, rows):
        ins = self._get(tag, start)
        if rows is not None:
            ins.p = dict(ins.p, rows=rows)
        self.san.landed(self.part.codec.stores[uid], lo, hi, ins)

    def _host_landed(self, uid, lo, hi):
        self.san.landed(self.part.codec.stores[uid], lo, hi, None)

    def _sync(self, tag, start):
        self.san.sync(self._get(tag, start))

    def _done(self, tag, start, seen):
        self.san.completed(self._get(tag, start), True if seen else None)


def _first(rec):
    return rec[0]


def _nothing(*_):
    return None


def send_logs(part, rec) -> list:
    """The payload of this worker's log for worker 0 (none on worker 0)."""
    return [pickle.dumps(rec.take(), protocol=pickle.HIGHEST_PROTOCOL)] if rec.log else []


def race_sync(part, la, key: tuple) -> None:
    """``sanitize=True``: launch ``la`` ended on every worker (a host event all meet in the same window): worker 0
    replays every worker's log so far, which may raise at its end; every worker raises the same ``RaceError``."""
    rec, transport = part.recorder, part.transport
    if part.rank != 0:
        transport.exchange({0: send_logs(part, rec)}, NEVER)
        verdict = pickle.loads(transport.exchange({}, NEVER).inbox[0][1])
        if verdict is not None:
            races, where, state = verdict
            adopt_races(rec.san, state, part.pod)     # what pending_error then finds is worker 0's
            raise race_error(races, where)
        return
    rp = part.replayer
    for _, data in transport.exchange({}, NEVER).inbox:
        rp.add(pickle.loads(data))
    rp.add(rec.take())
    error, verdict = None, None
    try:
        rp.replay(key)
    except RaceError as e:
        error, verdict = e, (e.races, f"launch '{la.name}'", race_state(rp.san))
    data = pickle.dumps(verdict, protocol=pickle.HIGHEST_PROTOCOL)
    transport.exchange({j: [data] for j in range(part.parts.workers) if j != 0}, NEVER)
    if error is not None:
        raise error


def race_state(san) -> tuple:
    """Worker 0's races after a run, for the other ranks of a torchrun job: (races, pending as (index, launch
    serial or None))."""
    index = {id(r): i for i, r in enumerate(san.races)}
    return san.races, [(index[id(r)], None if la is None else la.serial) for r, la in san._pending]


def adopt_races(san, state: tuple, pod) -> None:
    """Take worker 0's races (``race_state``): ``pod.races`` and ``run_done`` then answer as on worker 0."""
    races, pending = state
    launches = {la.serial: la for la in pod._launches}
    san.races = list(races)
    san._pending = [(races[i], None if s is None else launches.get(s)) for i, s in pending]
    san._seen = {r.signature: r for r in races[san._run_first:]}
