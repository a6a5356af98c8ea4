"""One pod's run over several worker processes, with the results of one process (DESIGN.md 10).

``Pod(profile, workers=N)``: each ``synchronize`` forks N-1 worker processes (fork, not spawn: kernels are live
generators and the host state - GM, launches, streams, queued host events - is whatever the script built, so each
worker starts from a copy-on-write replica of it). Worker ``r`` owns the dies ``partition(...)`` gives it (whole
chips) and runs the engine for them only:

- ``Engine.send`` to a die another worker owns posts a message (messages.py) instead of queueing an event;
- host events (launches starting, host writes, faults, launches ending) are replicated: every worker runs them, for
  its own dies (a launch starts only the cores it owns; the others stay as replicas that messages name);
- the workers advance in windows (conservative parallel discrete-event simulation): from the global earliest
  pending event ``S`` each processes its events before ``W = S + lookahead``, then they exchange (transport.py)
  their messages, the launch completions they saw and their next event times. A message takes at least the fabric
  latency between chips (``partition.lookahead_ps``), so none lands before ``W``; it is queued with its original
  key (time, origin, count), so the order of events is the one process's. A launch ends when its last core does,
  on whichever worker: the completions are merged at the window's end and every worker queues the host's
  observation of it at the time one process would (in the order of the events that finished the launches).
  What the host does next (a launch's start) takes at least a launch overhead, so windows are also no longer than
  that; a window stops at the next host event, and while a launch waits for cores (it starts the instant another
  ends) windows are one picosecond long, so every host event sees exactly the completions before it.
- a barrier over chips of several workers counts per chip (at the chip's first die of the launch, so on one
  worker), and each chip whose cores have all arrived tells every chip a fabric round trip later: those notices
  are the only messages between workers, and they take at least the look-ahead (``Engine._sync_barrier``; one
  process runs the same algorithm, with the same modeled barrier time);
- a launch's host functions (``Launch.on_done``) are a global synchronisation point (``Partition.host_sync``):
  the observation comes after every die's events at its time and every worker meets it in the same window, so
  each sends the others the GM stores its dies wrote since the last such point (whole stores) and then every
  worker runs the host functions on the whole pod's GM: the launches, allocations and host writes they make are
  the same everywhere. Cost per launch with host functions: one more exchange (all workers wait for the
  slowest) and the bytes of the stores written since; code of theirs with effects outside the pod (printing,
  appending to a list) runs on every worker, and only worker 0's effects reach the script (forked workers);
- persistent launches run as in one process. A torchrun rank keeps its parked kernels, their completions so far
  and the replies they wait for (``Partition.carry``), and the next run continues them. Forked workers do the
  same: those that hold a launch the run leaves parked (``Partition.stranded``) outlive the run, take every
  worker's changes (as a rank does) and wait; until the next ``synchronize`` the parent records the host's calls
  that change the pod and the GM it changes (journal.py), and ships them to the kept workers, which repeat them on
  their replica and run the next run with it. A call that cannot be sent (a lambda kernel) raises
  ``ArgumentError`` before it changes anything; a kept worker that died is named (``WorkerError``) at the next
  ``synchronize``. The workers end when nothing stays parked on them, when a run raises, at ``Pod.close`` and
  when the pod is collected;
- at the end each worker ships back what its dies changed (GM bytes of its stores, L2 and server state, trace
  records, busy times, instruction counts, launch traffic); the parent (worker 0) merges them, so ``.numpy()``
  and every report read what one process gives.

Fork safety: the run sets torch to one thread before forking (``Pod.synchronize``), numba's data paths are not
``parallel=True`` (no threading layer is started), so no thread pool is live in the forked children.

The race sanitizer runs partitioned (race_log.py): every worker logs its sanitizer hooks keyed by the event they
happen in, and worker 0 replays the logs in the one process's order after each window, so the races (and a
``RaceError``) are the one process's. Seeded jitter runs too: each home of events draws from its own generator
(jitter.py), and the look-ahead and the launch-overhead cap shrink by the jitter's fraction.

A run that raises: the workers that did not raise learn it at their next exchange, having run their window to its
end, past the event that raised. Each worker keeps what its window's GM writes overwrote (``Partition.writing``,
called by the engine and staging before every GM write), so on failure every worker ships its GM and that undo
log, and the parent (every rank, in a torchrun job) writes them in and undoes the writes of events after the first
event that raised (the smallest key): the host reads the GM one process shows when it raised. A worker that died
ships nothing: its dies keep what they held before the run, and the others' GM is as at their window's end. The
pod's clock, L2 and server state after a raising run are not rolled back (a new run starts after what was booked).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import struct
from heapq import heappop, heappush
from time import perf_counter, process_time

import numpy as np

from .changes import COUNTERS, Snapshot, counters, harvest, merge
from .errors import ArgumentError, EmulatorError, RaceError, WorkerError
from .messages import Codec, register
from .partition import lookahead_ps, partition
from .race_log import Recorder, Replayer, adopt_races, race_state, race_sync
from .transport import NEVER
from .work import work_estimate

TRANSPORTS = ("auto", "shm", "gloo")


_DEFAULT = [1, None]     # workers for pods made without workers=, and the list their runs' worker stats go to


@contextlib.contextmanager
def default_workers(workers: int):
    """Pods made inside without ``workers=`` run over up to ``workers`` processes (one per chip where they have
    fewer chips: a one-die pod runs in this process); yields the list each partitioned run's ``worker_stats`` is
    appended to. For callers whose pods are made by the code they call: the CLI's --workers."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ArgumentError(f"workers={workers!r}: an int >= 1")
    previous, runs = list(_DEFAULT), []
    _DEFAULT[:] = [workers, runs]
    try:
        yield runs
    finally:
        _DEFAULT[:] = previous


def check_workers(workers, transport: str, prof) -> int:
    """``workers`` and ``transport`` of ``Pod(...)``, checked: returns the worker count (None: the default of
    ``default_workers``, at most one per chip)."""
    if workers is None:
        workers = min(_DEFAULT[0], len({prof.chip_of(d) for d in range(prof.dies)}))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ArgumentError(f"workers={workers!r}: an int >= 1")
    if transport not in TRANSPORTS:
        raise ArgumentError(f"transport={transport!r}: use one of {TRANSPORTS}")
    if workers > 1:
        partition(prof, prof.dies, workers)     # raises when there are fewer chips than workers
    return workers


class Partition:
    """One worker's share of a run: the engine hook (``Engine.part``) and the window loop."""

    def __init__(self, pod, parts, rank: int, transport):
        eng = self.engine = pod.engine
        self.pod, self.parts, self.rank, self.transport = pod, parts, rank, transport
        prof = pod.profile
        self.worker_of = [parts.owner[d] for d in range(prof.dies)]
        self.owned = [w == rank for w in self.worker_of]
        self.launches = [la for la in pod._launches if not la.done]
        self._launch_index = {id(la): i for i, la in enumerate(self.launches)}
        # what parked launches of an earlier run keep (a torchrun rank's; a forked run's other workers end with it)
        carry = pod._partition_carry
        # cores of launches that other workers run; cores of earlier runs that another worker owns become replicas
        self.replicas = [c for la in self.launches if la.start_ps is not None for c in la.cores
                         if not self.owned[c.die] and not c.done]
        eng.cores = [c for c in eng.cores if self.owned[c.die]]
        self.written: set = set()           # uids of the GM stores written since the last host sync point
        self.shipped: set = set()           # ... and before it (host_sync)
        self.start_order: dict = carry.get("start_order", {})    # id(core) -> its place among the cores started
        self._started = carry.get("started", 0)
        self.outbox: dict = {}              # peer -> [(t, origin, count, die, fn, arg)]
        self.host_after = eng.host_after
        overhead = min(prof.launch_graph_us, prof.launch_single_op_us) * 1_000_000
        # seeded jitter shortens a fabric latency or a launch overhead by up to its fraction (jitter.py)
        fraction = pod.jitter.fraction if pod.jitter is not None else 0.0
        self.lookahead = max(1, min(lookahead_ps(prof, parts, jitter=fraction), int(overhead * (1.0 - fraction))))
        for la in self.launches:
            self._check_barrier_trip(la)
        self.host_times = sorted({e[0] for e in eng.heap if e[3] < 0 or e[3] >= eng.host_after})
        self.codec = Codec(eng, {st.uid: st for a in pod.gm._arenas.values() for st in a._stores},
                           self.launches, rank)
        for name in ("waiting", "proxies", "handles"):      # replies to what parked cores asked of other ranks
            getattr(self.codec, name).update(carry.get(name, {}))
        self.done: dict = {}                # launch index -> [cores finished here, latest time, latest event key]
        # launch index -> [finished cores of every worker, latest time, latest event key], until the launch ends
        self.totals = {self._launch_index[i]: tot for i, tot in carry.get("totals", {}).items()
                       if i in self._launch_index}
        self.recorder = self.replayer = None     # a sanitized run: this worker's race log; worker 0's replay of all
        self.popped = None                       # Engine.run: told of each event popped (the recorder's)
        # what this window's GM writes overwrote: [(event key, view, rows, elements)], to take a run that raised
        # back to the failing event (``after_failure``); ``failed_at``: the key of the event that raised here
        self.undo: list = []
        self.failed_at = None
        self.windows = self.messages = self.syncs = 0
        self.wait_s = 0.0                   # wall time spent in window-end exchanges (waiting for the others)
        self.run_s = 0.0                    # wall time of the whole window loop

    # ------------------------------------------------------------------ engine hooks
    def started(self, core) -> bool:
        """``Engine.start_core``: whether this worker runs ``core`` (else it keeps it as a replica)."""
        self.start_order[id(core)] = self._started
        self._started += 1
        if self.owned[core.die]:
            return True
        self.replicas.append(core)
        return False

    def post(self, t: int, origin: int, count: int, die: int, fn, arg) -> None:
        """``Engine.send`` to a die this worker does not own."""
        if (origin < 0 or origin >= self.host_after) and not (
                getattr(fn, "__name__", None) == "_complete_arrived" and id(arg[0]) in self.codec.proxies):
            # a host event: the owner's replica of it sends this one, unless it answers a wait of another
            # worker's core that only this worker holds (a host write landing on a word its remote poll watches)
            return
        box = self.outbox.get(self.worker_of[die])
        if box is None:                 # (setdefault would build a list per message)
            box = self.outbox[self.worker_of[die]] = []
        box.append((t, origin, count, die, fn, arg))

    def writing(self, v, rows=None) -> None:
        """``Engine`` and ``Staging``: the current event is about to write GM view ``v`` (only rows ``rows`` of it:
        a scatter) of one of our dies; its elements are kept until the window ends."""
        if v.store.data is not None:
            eng = self.engine
            old = np.array(v.arr if rows is None else v.arr[rows], copy=True)
            self.undo.append(((eng.now, eng.origin, eng.event_count), self.codec.view(v), rows, old))

    def failure(self, error: BaseException | None) -> dict:
        """What a worker whose run raised (``error``; None: it was told another failed) ships: the GM its dies
        wrote, this window's undo log and the key of the event that raised here (None: none did)."""
        stores = self.codec.stores
        written = self.written_stores()
        return {"gm": {uid: st.data.tobytes() for uid, st in stores.items()
                       if self.owned[st.die] and st.data is not None and uid in written},
                "undo": self.undo, "failed_at": self.failed_at}

    def host_event_at(self, t: int) -> None:
        heappush(self.host_times, t)

    def _check_barrier_trip(self, la) -> None:
        """A launch over chips of several workers may take a barrier: the chips' notices to each other are
        messages of ``Launch.barrier_trip_ps`` (a fabric round trip), which windows must not outlast (only in a
        profile whose inter-node latency exceeds the fabric latency)."""
        if la.barrier_leader is not None and len({self.worker_of[d] for d in la.dies}) > 1:
            self.lookahead = max(1, min(self.lookahead, la.barrier_trip_ps))

    def launch_queued(self, la) -> None:
        """``Stream.launch`` from a host function during the run: every worker queues it in the same order, so its
        index names it in messages and completions."""
        self._launch_index[id(la)] = len(self.launches)
        self.codec._launch_index[id(la)] = len(self.launches)
        self.launches.append(la)            # the codec's list too
        self._check_barrier_trip(la)

    # ------------------------------------------------------------------ host functions
    def host_sync(self) -> None:
        """Before a launch's host functions (``on_done``) run: a global synchronisation point. The observation is
        ordered after every die's events at its time and each worker meets it in the same window (windows stop at
        host events), so every worker's dies are where one process's are; each worker sends the others the GM
        stores its dies wrote since the last such point, and every worker then holds the whole pod's GM and runs
        the host functions itself, queueing the same launches and host writes."""
        stores = self.codec.stores
        fresh = {uid: stores[uid].data.tobytes() for uid in sorted(self.written)
                 if self.owned[stores[uid].die] and stores[uid].data is not None}
        self.shipped |= self.written
        self.written = set()
        payload = [pickle.dumps(fresh, protocol=pickle.HIGHEST_PROTOCOL)]
        waited = perf_counter()
        ex = self.transport.exchange({j: payload for j in range(self.parts.workers) if j != self.rank}, NEVER)
        self.wait_s += perf_counter() - waited
        self.syncs += 1
        for _, data in ex.inbox:
            for uid, raw in pickle.loads(data).items():
                stores[uid].data[...] = np.frombuffer(raw, np.uint8)

    def race_sync(self, la, key: tuple) -> None:
        """``sanitize=True``: launch ``la`` ended (its record's key ``key``); it raises on every worker if it raced
        (race_log.race_sync)."""
        race_sync(self, la, key)
        self.syncs += 1

    def host_ran(self) -> None:
        """After host functions: GM they allocated is named by uid in messages from now on."""
        stores = self.codec.stores
        for a in self.pod.gm._arenas.values():
            for st in a._stores:
                if st.uid not in stores:
                    stores[st.uid] = st

    # ------------------------------------------------------------------ between runs
    def carry(self) -> dict:
        """What the launches this run leaves parked keep for the next run on this worker (a torchrun rank keeps
        its engine): their completions so far, their cores' start order, the replies their cores wait for."""
        parked = {id(la) for la in self.launches if not la.done}
        alive = {id(c) for la in self.launches if id(la) in parked for c in la.cores}
        codec = self.codec
        rec, rp = self.recorder, self.replayer
        return {"totals": {id(self.launches[li]): tot for li, tot in self.totals.items()
                           if id(self.launches[li]) in parked},
                "race_issued": {c: n for c, n in rec._issued.items() if id(c) in alive} if rec else {},
                "race_ins": {tag: ins for tag, ins in rp.ins.items() if id(ins.core) in alive} if rp else {},
                "start_order": {k: v for k, v in self.start_order.items() if k in alive}, "started": self._started,
                "waiting": codec.waiting, "proxies": codec.proxies, "handles": codec.handles}

    def stranded(self, results: dict) -> dict:
        """The parked launches whose state is partly in another worker's process: {id(launch): (launch, the
        workers)}, from the other workers' ``results`` (their parked cores) and this worker's cores waiting for
        an answer from another worker. A forked worker ends with its run, so the next run cannot continue them."""
        found: dict = {}
        for r, res in results.items():
            for li, _ in res.get("parked", ()):
                la = self.launches[li]
                found.setdefault(id(la), (la, set()))[1].add(r)
        waiting = set(self.codec.waiting)
        for la in self.launches:
            for c in la.cores if not la.done else ():
                ins = c.blocked_on
                if self.owned[c.die] and ins is not None and id(ins) in waiting:    # the wait is held elsewhere
                    found.setdefault(id(la), (la, set()))[1].update(
                        self.worker_of[v.store.die] for v in ins.srcs + ins.dsts
                        if v.store.space == "GM" and not self.owned[v.store.die])
        return {k: (la, [f"{w} {_dies(self.parts, w)}" for w in sorted(workers)]) for k, (la, workers) in found.items()}

    def written_stores(self) -> set:
        """Uids of every GM store this worker's dies wrote during the run."""
        return self.written | self.shipped

    def core_done(self, core) -> None:
        """``Engine.on_core_done``: a core of ours finished; its launch ends when the last of all workers' does."""
        eng = self.engine
        rec = self.done.setdefault(self._launch_index[id(core.launch)], [0, 0, None])
        rec[0] += 1
        rec[1] = max(rec[1], core.time)
        # one event can finish several launches (a die killed): one process finishes them in its cores' order
        key = (eng.now, eng.origin, eng.event_count, self.start_order[id(core)])
        if rec[2] is None or key > rec[2]:
            rec[2] = key

    # ------------------------------------------------------------------ windows
    def run(self) -> None:
        began = perf_counter()
        try:
            self._windows()
        finally:
            self.run_s = perf_counter() - began

    def _windows(self) -> None:
        eng = self.engine
        heap, timers = eng.heap, eng.timers
        start = min(heap[0][0] if heap else NEVER, timers[0][0] if timers else NEVER)
        totals = self.totals
        peers = [j for j in range(self.parts.workers) if j != self.rank]
        codec = self.codec
        # what the exchange costs (bench_workers' projection): CPU time of the window loop, of packing and of
        # unpacking messages (CPU, not wall: on a shared machine wall time measures the other processes too)
        self.cpu_s = self.encode_s = self.decode_s = self.wait_cpu_s = 0.0
        self.bytes_sent = 0
        cpu0 = process_time()
        while start < NEVER:
            end = self._window_end(start)
            self.undo = []
            eng.run(end)
            self.windows += 1
            out, soonest = {}, NEVER
            began = process_time()
            log = codec.log_out = self.recorder.take() if self.recorder is not None else None
            for j in peers:
                msgs = self.outbox.pop(j, [])
                if msgs:
                    soonest = min(soonest, codec.check_after(msgs, end, self.lookahead))
                    self.messages += len(msgs)
                payload = codec.pack(self.done, msgs, j)
                self.bytes_sent += len(payload)
                out[j] = [payload]
            self.encode_s += process_time() - began
            mine = self.done
            self.done = {}
            nxt = min(heap[0][0] if heap else NEVER, timers[0][0] if timers else NEVER, soonest)
            waited, began = perf_counter(), process_time()
            ex = self.transport.exchange(out, nxt)
            self.wait_s += perf_counter() - waited
            self.wait_cpu_s += process_time() - began
            began = process_time()
            reports = [mine]
            for _, payload in ex.inbox:
                reports.append(codec.unpack(payload, heap))
            self.decode_s += process_time() - began
            start = min(ex.next_ps, self._launches_ended(reports, totals))
            if self.replayer is not None:       # every worker's sanitizer hooks of events before ``start``, in order
                self.replayer.add(log)
                for other in codec.logs:
                    self.replayer.add(other)
                codec.logs = []
                self.replayer.replay((start - 1, NEVER) if start < NEVER else None)
        self.cpu_s = process_time() - cpu0

    def _window_end(self, start: int) -> int:
        host = self.host_times
        while host and host[0] < start:
            heappop(host)
        if (host and host[0] == start) or self.pod._waiting:
            return start + 1            # a host event now, or a launch that starts the instant another ends
        end = start + self.lookahead
        return host[0] if host and host[0] < end else end

    def _launches_ended(self, reports: list, totals: dict) -> int:
        """Merge the workers' completions; queue the host's observation of each launch that ended (in the order of
        the events that finished them, as one process queues them). Returns the earliest such time."""
        for rep in reports:
            for li, (n, t, key) in rep.items():
                tot = totals.setdefault(li, [0, 0, None])
                tot[0] += n
                tot[1] = max(tot[1], t)
                if tot[2] is None or key > tot[2]:
                    tot[2] = key
        ended = sorted((tot[2], li) for li, tot in totals.items() if tot[0] == len(self.launches[li].cores))
        soonest = NEVER
        for key, li in ended:
            la = self.launches[li]
            la.n_done, la.end_ps, _ = totals.pop(li)
            t = max(la.end_ps, key[0])
            self.engine.push_host(t, self.pod._launch_done, la, observe=True)
            soonest = min(soonest, t)
        return soonest


# ============================================================================================ one run over N processes
def _encode_chip_done(codec, msg):
    launch, group = msg
    return codec._launch_index[id(launch)], group


def _decode_chip_done(codec, data):
    li, group = data
    return codec.engine._barrier_chip_done, (codec.launches[li], group)


# a chip's notice that its cores reached a barrier over several chips (Engine._barrier_chip_done)
register("_barrier_chip_done", "_barrier_chip_done", _encode_chip_done, _decode_chip_done)

TIMEOUT_S = 60.0            # the bound on every wait of a partitioned run (a silent worker; transport.py)
_LEN = struct.Struct("<Q")


class _Transport:
    """How the parent and its forked workers reach each other: shared-memory rings or gloo over a file store."""

    def __init__(self, kind: str, n: int):
        self.kind, self.n, self.seg, self.path = kind, n, None, None
        if kind in ("auto", "shm"):
            import multiprocessing as mp

            from .shm_ring import RingSegment
            try:
                self.seg = RingSegment.create(n, 1 << 20, RingSegment.make_locks(mp.get_context("fork"), n))
                self.kind = "shm"
            except OSError:             # no shared memory here (e.g. no /dev/shm): gloo, unless shm was asked for
                if kind == "shm":
                    raise
                self.kind = "gloo"
        if self.kind == "gloo":
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                raise ArgumentError(f"workers={n}, transport='gloo': this process already belongs to a "
                                    f"torch.distributed group of {dist.get_world_size()}; forked workers cannot "
                                    f"join it (use transport='shm', or a torchrun job of {n} ranks)")
            self.renew()

    def renew(self) -> None:
        """gloo: a fresh file store (each run's group meets in its own)."""
        import tempfile
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)
        fd, self.path = tempfile.mkstemp(prefix="ascend_emu_gloo_")
        os.close(fd)
        os.unlink(self.path)            # the file store creates it

    def open(self, rank: int):
        from .transport import GlooTransport, ShmTransport
        if self.kind == "shm":
            return ShmTransport(self.seg, rank, timeout_s=TIMEOUT_S)
        return GlooTransport(rank, self.n, init_method=f"file://{self.path}", timeout_s=TIMEOUT_S)

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)


def run_partitioned(pod) -> None:
    """``Engine.run`` for a pod with ``workers`` > 1: inside a ``torchrun`` job of as many ranks, run this rank's
    partition and share what every rank changed; otherwise fork the workers, run worker 0 here and merge what the
    others changed. Raises what this worker raised, ``WorkerError`` naming another worker that failed or died, or
    the ``DeadlockError`` one process would raise."""
    if not pod.engine.heap and not pod.engine.timers:
        return                          # nothing to run: no worker to start
    launches = [la for la in pod._launches if not la.done]
    try:
        _run_partitioned(pod, launches)
    except BaseException:
        close_workers(pod)          # the run's launches end with its error: nothing stays parked
        raise


def _run_partitioned(pod, launches: list) -> None:
    prof = pod.profile
    parts = pod._parts
    if parts is None or parts.workers != pod.workers or not any(la.start_ps is not None for la in launches):
        # a launch parked in an earlier run continues where its cores are (a torchrun rank holds them)
        parts = partition(prof, prof.dies, pod.workers, weights=work_estimate(pod, launches), layout="interleaved")
    pod._parts = parts
    before = Snapshot(pod)
    rank = torchrun_rank(pod.workers)
    if pod._live_rank is not None:      # a kept forked worker, running the parent's next run
        rank = pod._live_rank[0]
        results = _run_kept(pod, parts, before)
    elif rank is not None:
        results = _run_torchrun(pod, parts, rank, before)
    else:
        results = _run_forked(pod, parts, before)
    here = 0 if rank is None else rank
    blocked = []
    for r, res in sorted(results.items()):
        if r != here:
            merge(pod, before, res)
        blocked += res["blocked"]
    pod.worker_stats = [{"dies": parts.dies_of(r), **{k: res[k] for k in COUNTERS}}
                        for r, res in sorted(results.items())]
    if _DEFAULT[1] is not None:
        _DEFAULT[1].append(pod.worker_stats)
    if pod._live is not None and pod._live_rank is None:
        from .journal import Journal
        pod._journal = Journal(pod)     # what the host does until the next run, for the kept workers
    if blocked:
        from .errors import DeadlockError
        raise DeadlockError("deadlock: no event can make progress; blocked cores:\n  " + "\n  ".join(blocked),
                            blocked)


def torchrun_rank(workers: int) -> int | None:
    """This process's rank when it is one of ``workers`` ranks of a ``torchrun`` job (RANK and WORLD_SIZE in the
    environment), else None (the pod forks its own workers)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) == workers:
        return int(env["RANK"])
    return None


def _run_torchrun(pod, parts, rank: int, before) -> dict:
    """Every rank runs the same script: each runs its partition over the job's gloo group, then every rank takes
    every other's changes (an all-gather), so each holds the whole pod afterwards."""
    transport = getattr(pod, "_torchrun_transport", None)
    if transport is None:
        from .transport import GlooTransport
        transport = pod._torchrun_transport = GlooTransport(timeout_s=TIMEOUT_S)    # kept for the next runs
    keep: list = []
    try:
        part, blocked = _run_here(pod, parts, rank, transport, keep)
    except Exception as e:          # every rank takes the others' GM back to the event that raised first
        if keep:
            try:
                gathered = transport._gather(keep[0].failure(e))
            except WorkerError:     # a rank is gone: its GM with it
                raise e from None
            after_failure(keep[0], dict(enumerate(gathered)))
        raise
    res = harvest(pod, part, before, blocked)
    if rank == 0 and part.replayer is not None:     # every rank reports worker 0's races
        res["races"] = race_state(part.replayer.san)
    gathered = transport._gather(res)
    if rank != 0 and part.recorder is not None:
        adopt_races(pod.sanitizer, gathered[0]["races"], pod)
    return dict(enumerate(gathered))


def _run_forked(pod, parts, before) -> dict:
    """Fork workers 1..N-1 (or wake those kept since the last run), run worker 0 here; returns every worker's
    changes (worker 0's: its counters only). Workers that hold a launch the run leaves parked are kept
    (``pod._live``) for the next run; the others end."""
    import sys
    live = pod._live
    if live is None:
        sys.stdout.flush()                      # what the parent printed is not printed again by its workers
        sys.stderr.flush()
        live = _Live(_Transport(pod.transport, pod.workers), parts)
        for rank in range(1, pod.workers):
            rd, wr = os.pipe()
            crd, cwr = os.pipe()
            pid = os.fork()
            if pid == 0:                        # the worker: never returns
                os.close(rd)
                os.close(cwr)
                live.forget()                   # the other workers' pipes: their ends must close with the parent
                _worker(pod, parts, rank, live.link, before, wr, crd)
            os.close(wr)
            os.close(crd)
            live.children[rank] = (pid, rd)
            live.commands[rank] = cwr
    kept, pod._live = pod._live, None
    link, children = live.link, live.children
    try:
        if kept is not None:
            live.start(pod)
        transport = link.open(0)
        keep: list = []
        try:
            part, blocked = _run_here(pod, parts, 0, transport, keep)
        except Exception as e:      # this worker's error, or another's (WorkerError): every worker's GM first
            if keep:
                transport.close()
                results = _collect(children)
                first = after_failure(keep[0], {r: res[2] if res[0] == "error" else None
                                                for r, res in results.items()})
                if first not in (None, 0):      # another worker's error came first (one process raises that)
                    raise WorkerError(first, f"failed: {results[first][1]}") from e
                if first is None and not isinstance(e, WorkerError):
                    _first_failure(results)
            raise
        finally:        # also when the run raises: a gloo group left up would refuse this pod's next gloo run
            transport.close()
        results = _collect(children)
        _first_failure(results)
        results = {r: res[1] for r, res in results.items()}
        stranded = part.stranded(results)
        if stranded and not blocked:    # the kept workers merge every worker's changes, as torchrun ranks do
            everyone = {**results, 0: harvest(pod, part, before, blocked)}
            live.tell(("stay", pickle.dumps(everyone, protocol=pickle.HIGHEST_PROTOCOL)))
            pod._live = live
            live.keep(pod)
    except WorkerError as e:
        raise _named(e, parts, children) from e
    finally:
        if pod._live is not live:
            live.close()
    results[0] = {"blocked": blocked, **counters(part)}
    return results


def _run_kept(pod, parts, before) -> dict:
    """A kept worker's run (its ``pod.synchronize`` in ``_serve``): run its partition, send its changes, and
    take every worker's (``("stay", ...)``: the run leaves launches parked) or end (the parent said "exit")."""
    rank, link, out, cmd = pod._live_rank
    if not _run_send(pod, parts, rank, link, before, out):
        _exit(1)
    return _stay_or_exit(cmd)


def _run_send(pod, parts, rank: int, link, before, out: int) -> bool:
    """A forked worker's run: its partition, then its changes (or what it raised) to the parent; whether it ran."""
    keep: list = []
    try:
        transport = link.open(rank)
        part, blocked = _run_here(pod, parts, rank, transport, keep)
        transport.close()
        result = ("ok", harvest(pod, part, before, blocked))
    except BaseException as e:
        result = ("error", f"{type(e).__name__}: {e}", keep[0].failure(e) if keep else None)
    _send(out, result)
    return result[0] == "ok"


def _run_here(pod, parts, rank: int, transport, keep: list | None = None) -> tuple:
    """Run this process's partition; returns it and its blocked cores' descriptions (``keep`` gets the partition,
    also when the run raises)."""
    eng = pod.engine
    part = Partition(pod, parts, rank, transport)
    if keep is not None:
        keep.append(part)
    own_done = eng.on_core_done         # the pod's weak callback: a strong one would make a cycle
    eng.part, eng.on_core_done = part, part.core_done
    san = pod.sanitizer
    if san is not None:         # the engine and the pod tell a recorder; worker 0 replays every worker's records
        carry = pod._partition_carry
        rec = part.recorder = Recorder(san, part)
        part.popped = rec.popped
        rec._issued.update(carry.get("race_issued", {}))
        if rank == 0:
            part.replayer = Replayer(pod, part, san)
            part.replayer.ins.update(carry.get("race_ins", {}))
        eng.sanitizer = pod.sanitizer = san.redirect = rec
        pod.gm.on_alloc = rec.track
    pod._partition_carry = {}
    try:
        part.run()
    except BaseException as e:
        if not isinstance(e, WorkerError):
            part.failed_at = (eng.now, eng.origin, eng.event_count)
        if not isinstance(e, (WorkerError, RaceError)):     # a RaceError: every worker raises it (race_sync)
            transport.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        eng.part, eng.on_core_done = None, own_done
        if san is not None:
            eng.sanitizer = pod.sanitizer = san
            san.redirect = None
            if part.replayer is None:       # worker 0 replayed them; the others counted them
                san.host_writes = part.recorder.host_writes
            pod.gm.on_alloc = san.track
    pod._partition_carry = part.carry()
    return part, [eng._describe_block(c) for c in eng.cores if c.blocked_on is not None and not c.launch.persistent]


def _worker(pod, parts, rank: int, link, before, out: int, cmd: int) -> None:
    code = 1
    pod.engine.progress = None              # one progress report: the parent's
    try:
        if _run_send(pod, parts, rank, link, before, out):
            code = 0
            results = _stay_or_exit(cmd)
            for r, res in sorted(results.items()):
                if r != rank:
                    merge(pod, before, res)
            # what the parent's ``Pod.synchronize`` does after the run, so this replica is where a torchrun rank is
            pod._result(pod.engine, pod.host_ps, before.run_launches(pod))
            pod._in_run = False
            if pod.sanitizer is not None:
                with contextlib.suppress(RaceError):    # the parent raises it and ends this worker
                    pod.sanitizer.run_done()
            _serve(pod, rank, link, out, cmd)
    finally:
        _exit(code)


def _serve(pod, rank: int, link, out: int, cmd: int) -> None:
    """A kept worker between runs: at each "run" command, repeat the host's calls since the last run
    (journal.py) and run the next ``synchronize`` as this worker (``_run_kept``); end at "exit" or when the
    parent is gone."""
    import gc

    from .journal import Journal
    gc.enable()
    while True:
        _, payload, path = _read(cmd)           # ("run", the journal, the gloo store of this run)
        link.path = path
        try:
            Journal.replay(pod, payload)
        except BaseException as e:
            _send(out, ("error", f"repeating the host's calls: {type(e).__name__}: {e}", None))
            _exit(1)
        _send(out, ("ready",))
        pod._live_rank = (rank, link, out, cmd)
        pod.synchronize()


def _exit(code: int) -> None:
    import sys
    sys.stdout.flush()                      # what the kernels printed here
    sys.stderr.flush()
    os._exit(code)


def _send(fd: int, item) -> None:
    _send_raw(fd, pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))


def _read(fd: int):
    """The next message on a command pipe; the parent gone (end of file) or "exit" ends this worker."""
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                _exit(0)
            buf.extend(chunk)
        return bytes(buf)
    item = pickle.loads(exactly(_LEN.unpack(exactly(_LEN.size))[0]))
    if item == "exit":
        _exit(0)
    return item


def _stay_or_exit(cmd: int) -> dict:
    """After a run: every worker's changes ("stay": launches stay parked here), or the end of this worker."""
    _, everyone = _read(cmd)
    return pickle.loads(everyone)


class _Live:
    """The forked workers of a run, kept between runs while launches are parked on them (``pod._live``):
    their pids and pipes (results to the parent, commands to them) and the transport they share."""

    def __init__(self, link, parts):
        self.link, self.parts = link, parts
        self.children: dict = {}            # rank -> (pid, read end of its results)
        self.commands: dict = {}            # rank -> write end of its commands
        self._finalizer = None

    def forget(self) -> None:
        """In a newly forked worker: close the parent's ends of the other workers' pipes."""
        for _, rd in self.children.values():
            os.close(rd)
        for fd in self.commands.values():
            os.close(fd)

    def tell(self, item) -> None:
        """Send ``item`` to every worker; a worker that is gone raises ``WorkerError`` naming it."""
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        for r, fd in sorted(self.commands.items()):
            status = _exit_status(self.children[r][0])
            if status != "still running":
                raise WorkerError(r, f"died between runs ({status})")
            try:
                _send_raw(fd, data)
            except OSError as e:
                raise WorkerError(r, f"died between runs ({e.strerror})") from None

    def keep(self, pod) -> None:
        import weakref
        if self._finalizer is None:         # a pod collected (or the interpreter ending) ends its workers
            self._finalizer = weakref.finalize(pod, self.close)

    def start(self, pod) -> None:
        """The next run on the kept workers: the host's calls since the last run, and a fresh gloo store."""
        if self.link.kind == "gloo":
            self.link.renew()
        else:       # not the last run's "finished": each worker marks itself running when its run opens the rings
            from .shm_ring import RUNNING
            self.link.seg.set_status(0, RUNNING)
            for r in self.children:
                self.link.seg.set_status(r, 0)
        journal, pod._journal = pod._journal, None
        self.tell(("run", journal.payload(pod), self.link.path))
        for r, res in sorted(_collect(self.children, "its answer to the run").items()):    # bounded
            if res[0] != "ready":
                raise WorkerError(r, res[1] if res[0] == "dead" else f"failed: {res[1]}")

    def close(self) -> None:
        """End the workers (bounded): "exit", then ``_reap``; release the transport."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        data = pickle.dumps("exit", protocol=pickle.HIGHEST_PROTOCOL)
        for fd in self.commands.values():
            try:
                _send_raw(fd, data)
            except OSError:
                pass
            os.close(fd)
        self.commands = {}
        _reap(self.children)
        self.children = {}
        self.link.close()


def _send_raw(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def close_workers(pod) -> None:
    """End the forked workers ``pod`` keeps for parked launches (a run raised, or ``Pod.close``)."""
    live, pod._live, pod._journal = pod._live, None, None
    if live is not None:
        live.close()


def after_failure(part, payloads: dict) -> int | None:
    """A run raised: fold the other workers' GM (``payloads`` {rank: ``Partition.failure``, None when it sent
    none}) into this process's, and take every worker's back to the event that raised first (its key is the
    order of one process, so the GM is the one process's when it raised: what other workers' events after it
    wrote in the same window is undone). Returns the rank whose event raised first (None: none reported one,
    e.g. a worker that died; then every worker's GM stays where its last window ended)."""
    mine = part.failure(None)
    payloads = {**payloads, part.rank: mine}
    failed = {r: p["failed_at"] for r, p in payloads.items() if p is not None and p["failed_at"] is not None}
    # the same key on several workers is a host event they all ran (a RaceError at a launch's end): the lowest rank
    first = min(failed, key=lambda r: (failed[r], r)) if failed else None
    stores = part.codec.stores
    for r, p in sorted(payloads.items()):
        if p is None:
            continue
        if r != part.rank:
            for uid, data in p["gm"].items():
                stores[uid].data[...] = np.frombuffer(data, np.uint8)
        if first is not None:
            key = failed[first]
            for at, view, rows, old in reversed(p["undo"]):
                if at > key:
                    arr = part.codec.view_of(view).arr
                    if rows is None:
                        arr[...] = old
                    else:
                        arr[rows] = old
    return first


def _first_failure(results: dict) -> None:
    """Raise the ``WorkerError`` of the first worker (by rank) whose result is not "ok"."""
    for r, res in sorted(results.items()):
        if res[0] == "dead":
            raise WorkerError(r, res[1])
        if res[0] != "ok":
            raise WorkerError(r, f"failed: {res[1]}")


def _collect(children: dict, what: str = "its result") -> dict:
    """Each worker's result, read from its pipe within the bound: {rank: ("ok", its changes) | ("error", what it
    raised, ``Partition.failure``) | ("dead", how it ended)}."""
    import select
    import time
    # appended in place (results can be GBs), after what an earlier call read past its message (a kept worker's)
    results, buffers = {}, {r: _SURPLUS.pop(rd, bytearray()) for r, (_, rd) in children.items()}
    deadline = time.monotonic() + TIMEOUT_S
    open_fds = {rd: r for r, (_, rd) in children.items() if not _whole(buffers[r])}
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            for r in open_fds.values():
                results[r] = ("dead", f"sent no result within {TIMEOUT_S:g} s")
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(left, 1.0))
        for rd in ready:
            chunk = os.read(rd, 1 << 20)
            buf = buffers[open_fds[rd]]
            buf.extend(chunk)
            if not chunk or _whole(buf):
                del open_fds[rd]            # its result (a kept worker stays up) or its end
    for r, buf in buffers.items():
        if r in results:
            continue
        if not _whole(buf):
            results[r] = ("dead", f"died before sending {what} ({_exit_status(children[r][0], 1.0)})")
            continue
        end = _LEN.size + _LEN.unpack_from(buf)[0]
        if len(buf) > end:                  # a kept worker's next message
            _SURPLUS[children[r][1]] = buf[end:]
        results[r] = pickle.loads(memoryview(buf)[_LEN.size:end])
    return results


_SURPLUS: dict = {}         # results pipe -> bytes read past the message ``_collect`` took


def _whole(buf) -> bool:
    """Whether ``buf`` holds a whole message."""
    return len(buf) >= _LEN.size and len(buf) >= _LEN.size + _LEN.unpack_from(buf)[0]


def _dies(parts, rank: int) -> str:
    """``(dies 0..1, 4..5, 8..9, ...; 224 dies)``: the first runs of consecutive dies a worker holds."""
    dies = parts.dies_of(rank)
    if len(dies) == 1:
        return f"(die {dies[0]})"
    runs, lo = [], dies[0]
    for prev, d in zip(dies, dies[1:] + [None]):
        if d is None or d != prev + 1:
            runs.append(f"{lo}..{prev}" if prev > lo else f"{lo}")
            lo = d
    if len(runs) == 1:
        return f"(dies {runs[0]})"
    return f"(dies {', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}; {len(dies)} dies)"


def _exit_status(pid: int, wait_s: float = 0.0) -> str:
    """How process ``pid`` ended (reaping it); ``wait_s``: how long to wait for it to end (its pipes closed, it
    is on its way out)."""
    import time
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "already reaped"
        if done or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    if done == 0:
        return "still running"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _named(e: WorkerError, parts, children: dict) -> WorkerError:
    """``e`` naming the worker's dies; when the transport could not tell which peer left (gloo), the worker whose
    process ended."""
    rank, cause = e.worker, e.cause
    if rank is None:
        import time
        deadline = time.monotonic() + 5.0
        while rank is None and time.monotonic() < deadline:
            for r, (pid, _) in sorted(children.items()):
                status = _exit_status(pid)
                if status != "still running":
                    rank, cause = r, f"died ({status})"
                    break
            else:
                time.sleep(0.05)
        if rank is None:
            return e
    return WorkerError(rank, f"{_dies(parts, rank)} {cause}")


def _reap(children: dict) -> None:
    """Wait (bounded) for every forked worker, killing those still running."""
    import signal
    import time
    deadline = time.monotonic() + 5.0
    for pid, rd in children.values():
        _SURPLUS.pop(rd, None)
        try:
            os.close(rd)
        except OSError:
            pass
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
