"""The pod: dies, their global memory, streams of kernel launches, and the result of a run.

``Pod.launch`` runs one kernel and returns its ``RunResult``. For concurrency, make streams: launches on one stream run
in order; different streams run concurrently on disjoint cores (a launch whose cores are busy waits for them).
Launch overhead depends on the stream's mode: "single-op" (host dispatch per kernel) or "graph" (captured graph).
A persistent launch may stay blocked in a poll when everything else is done: it is parked, not deadlocked, and the
next ``synchronize`` continues it (e.g. after ``host_write`` of its stop flag); with ``workers`` > 1 the forked workers
holding it stay up until then and repeat the host's calls in between (workers.py, journal.py).
"""
from __future__ import annotations

import gc
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

from .arguments import check_cores, check_die, check_dies, check_us
from .engine import Core, Engine
from .errors import AddressError, ArgumentError, KernelError
from .jitter import Jitter
from .journal import journaled
from .kernel import Kernel, KernelContext
from .memory import GlobalMemory, GMTensor
from .profile import HardwareProfile, cloudmatrix384
from .timing import Traffic
from .trace import Trace
from .workers import check_workers, close_workers, run_partitioned

PS_PER_US = 1_000_000
DEFAULT_PROGRESS = None     # callback(modeled_us, instructions) given to new pods (the CLI's progress bar)
# sanitize mode of pods made without one (``sanitize=None``): False, True or "collect" (``sanitizer.every_pod``, the
# pytest plugin's --ascend-sanitize, the CLI's --sanitize); each such pod's sanitizer is appended to SANITIZERS
# when that is a list
DEFAULT_SANITIZE = False
SANITIZERS = None
DEFAULT_JITTER = None       # (seed, fraction) for pods made without a jitter_seed (``ascend_emu.explore``)


@contextmanager
def pod_defaults(*, sanitize=False, jitter_seed: int | None = None, jitter: float = 0.3):
    """Pods made inside without options of their own sanitize in mode ``sanitize`` (False, True or "collect") and
    jitter with ``jitter_seed`` (None: not); yields the list their sanitizers are appended to. For callers whose pods
    are made by the code they call: the CLI's --sanitize, pytest's --ascend-sanitize, ``explore``."""
    global DEFAULT_SANITIZE, SANITIZERS, DEFAULT_JITTER
    previous = DEFAULT_SANITIZE, SANITIZERS, DEFAULT_JITTER
    found: list = []
    DEFAULT_SANITIZE, SANITIZERS = sanitize, found
    DEFAULT_JITTER = None if jitter_seed is None else (jitter_seed, jitter)
    try:
        yield found
    finally:
        DEFAULT_SANITIZE, SANITIZERS, DEFAULT_JITTER = previous


class _WeakPod:
    """The ``pod`` attribute of streams and launches, held weakly: a pod holds its streams and launches, and their
    strong references back would make every pod a reference cycle, freed (its GM, L2 and trace with it) only by a
    pass of the cyclic GC instead of when the last reference to it goes."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        pod = obj._pod()
        if pod is None:
            raise ArgumentError(f"the pod of this {type(obj).__name__.lower()} was freed: keep a reference to the "
                                f"pod while you use its streams and launches")
        return pod

    def __set__(self, obj, pod) -> None:
        obj._pod = weakref.ref(pod)


class _WeakCall:
    """``method`` called through a weak reference to its object (the engine's ``on_core_done``, into its pod: a
    bound method would be a reference cycle); does nothing once the object is gone."""

    __slots__ = ("ref", "fn")

    def __init__(self, method):
        self.ref = weakref.ref(method.__self__)
        self.fn = method.__func__

    def __call__(self, *args):
        obj = self.ref()
        if obj is not None:
            self.fn(obj, *args)


class Launch:
    """One kernel launch on one or more dies (a handle: times are filled in as it runs)."""

    pod = _WeakPod()

    def __init__(self, pod, stream, kernel: Kernel, args: tuple, numeric: bool, persistent: bool,
                 wait_timeout_us, name: str | None):
        self.pod = pod
        self.stream = stream
        self.serial = pod._launch_serial      # names it in messages and logs between workers (race_log.py)
        pod._launch_serial += 1
        self.kernel = kernel
        self.name = name or kernel.name
        self.args = args
        self.dies = list(stream.dies)
        self.numeric = numeric
        self.persistent = persistent
        self.wait_timeout_ps = None if (wait_timeout_us is None or persistent) else int(wait_timeout_us * PS_PER_US)
        self.barriers: dict = {}
        self.cores: list[Core] = []
        self.start_ps = None
        self.end_ps = None
        self.n_done = 0
        prof = pod.profile
        multi = len(self.dies) > 1
        # SyncAll: one atomic round trip to the barrier word plus the poll; across dies the fabric adds its latency
        self.barrier_ps = int(prof.barrier_ns * 1000) + (2 * int(prof.fabric_latency_ns * 1000) if multi else 0)
        self.die_barrier_ps = int(prof.barrier_ns * 1000)
        # over several chips a barrier counts per chip at its leader (the launch's first die on it), the chips
        # tell each other (a fabric round trip, ``barrier_trip_ps``) and each releases its cores (Engine._sync_barrier)
        leaders: dict = {}
        for d in self.dies:
            leaders.setdefault(prof.chip_of(d), d)
        self.barrier_leaders = sorted(leaders.values())
        self.barrier_leader = {d: leaders[prof.chip_of(d)] for d in self.dies} if len(leaders) > 1 else None
        self.barrier_trip_ps = self.barrier_ps - self.die_barrier_ps if multi else 0
        self._partners = {}
        self._group_sizes = None
        self._chip_sizes = None
        self.after: list = []
        self.error: BaseException | None = None    # what ended the run this launch was part of, if it raised
        self.traffic = Traffic()      # GM bytes its transfers moved through the L2s, the HBMs and the fabric
        # host functions called as fn(launch) at the modeled time it finishes, inside the run (cf. CUDA's
        # cudaLaunchHostFunc): they may read its GM outputs and queue further launches, taking no modeled time
        self.on_done: list = []
        self.host_writes_before = None      # queued during a run: the sanitizer's host-write count then

    @property
    def done(self) -> bool:
        return self.end_ps is not None

    def group_size(self, group: str, die: int | None = None) -> int:
        if group == "all":
            return len(self.cores)
        sizes = self._group_sizes
        if sizes is None:       # counted once: every barrier arrival asks, and a pod-wide launch has 10^4 cores
            sizes = self._group_sizes = {}
            for c in self.cores:
                for key in (("die", c.die), (c.kind, None)):
                    sizes[key] = sizes.get(key, 0) + 1
        return sizes.get((group, die if group == "die" else None), 0)

    def chip_group_size(self, group: str, leader: int) -> int:
        """Cores of barrier group ``group`` on the chip whose leader die is ``leader`` (``barrier_leader``)."""
        sizes = self._chip_sizes
        if sizes is None:
            sizes = self._chip_sizes = {}
            for c in self.cores:
                lead = self.barrier_leader[c.die]
                for g in ("all", c.kind):
                    sizes[(g, lead)] = sizes.get((g, lead), 0) + 1
        return sizes.get((group, leader), 0)

    def partners(self, core: Core) -> list:
        return self._partners.get(id(core), [])

    def _build(self, engine: Engine, t: int, cores_start: int) -> None:
        k = self.kernel.cores
        st = self.stream
        # a partitioned run: a worker builds contexts and generators only for the cores it runs (the others are
        # replicas that messages name; nothing reads their context or generator); of a launch it runs no core of,
        # the first core is built, so a kernel that is not a generator function fails on every worker alike
        part = engine.part
        owned = None if part is None else part.owned
        first = owned is not None and not any(owned[d] for d in self.dies)
        for die in self.dies:
            built = owned is None or owned[die]
            aics = list(st.aic) if k in ("aic", "mix") else []
            aivs = list(st.aiv) if k == "aiv" else []
            if k == "mix":
                aivs = [a * 2 + j for a in aics for j in range(self.pod.profile.aiv_per_aic)]
            cores_aic = [Core(die, "aic", i, self) for i in aics]
            cores_aiv = [Core(die, "aiv", i, self) for i in aivs]
            if first:               # (block 0 of its kind, group 0, sub-block 0: as built below)
                first, some = False, cores_aic or cores_aiv
                some[0].ctx = KernelContext(engine, some[0], self, 0, len(some), 0, 0)
            for bi, c in enumerate(cores_aic if built else ()):
                c.ctx = KernelContext(engine, c, self, bi, len(aics), bi, 0)
            for bi, c in enumerate(cores_aiv if built else ()):
                group = bi // self.pod.profile.aiv_per_aic if k == "mix" else bi
                sub = bi % self.pod.profile.aiv_per_aic if k == "mix" else 0
                c.ctx = KernelContext(engine, c, self, bi, len(aivs), group, sub)
            if k == "mix":
                for gi, a in enumerate(cores_aic):
                    pair = cores_aiv[gi * 2: gi * 2 + 2]
                    self._partners[id(a)] = pair
                    for v in pair:
                        self._partners[id(v)] = [a]
            self.cores.extend(cores_aic + cores_aiv)
        self._group_sizes = self._chip_sizes = None
        for c in self.cores:
            if c.ctx is None:       # a replica
                continue
            try:
                gen = self.kernel.fn(c.ctx, *self.args)
            except Exception as e:
                raise KernelError(f"kernel '{self.name}' failed before its first instruction on {c.where}: "
                                  f"{type(e).__name__}: {e}") from e
            if not hasattr(gen, "send"):
                raise KernelError(f"kernel '{self.name}' is not a generator function: a kernel yields its "
                                  f"instructions (yield ctx.copy_gm_to_ub(...))")
            c.gen = gen
        self.start_ps = t
        for c in self.cores:
            engine.start_core(c, cores_start)


class Stream:
    """An ordered queue of launches on a subset of cores of one or more dies."""

    pod = _WeakPod()

    def __init__(self, pod, dies, aiv, aic, mode: str):
        prof = pod.profile
        if mode not in ("single-op", "graph"):
            raise ArgumentError(f"mode={mode!r}: use 'single-op' or 'graph'")
        self.pod = pod
        self.dies = pod.check_dies(dies)
        self.aiv = check_cores(aiv, prof.aiv_per_die, "aiv")
        self.aic = check_cores(aic, prof.aic_per_die, "aic")
        self.mode = mode
        self.queue: list[Launch] = []
        self.running: Launch | None = None
        self.free_ps = 0
        self.aiv_given = aiv is not None

    @property
    def overhead_ps(self) -> int:
        p = self.pod.profile
        return int((p.launch_graph_us if self.mode == "graph" else p.launch_single_op_us) * PS_PER_US)

    @journaled
    def launch(self, kernel, args=(), *, numeric: bool = True, persistent: bool = False,
               wait_timeout_us: float | None = 10_000.0, name: str | None = None, after=()) -> Launch:
        """Queue ``kernel(ctx, *args)``; returns the Launch handle. Run with ``pod.synchronize()``.

        ``after``: launches (of any stream) that must finish before this one starts (an event wait)."""
        if not isinstance(kernel, Kernel):
            if not callable(kernel):
                raise ArgumentError(f"kernel={kernel!r}: pass a @kernel generator function")
            kernel = Kernel(kernel, "aiv")
        if not isinstance(args, (tuple, list)):
            raise ArgumentError(f"args={args!r}: the kernel's arguments as a tuple")
        wait_timeout_us = check_us(wait_timeout_us, "wait_timeout_us", positive=True)
        if not isinstance(after, (tuple, list)) or not all(isinstance(d, Launch) for d in after):
            raise ArgumentError(f"after={after!r}: a list of Launch handles (what stream.launch returns)")
        if kernel.cores in ("aic", "mix") and not self.aic:
            raise AddressError(f"kernel '{kernel.name}' needs AIC cores; this stream has none")
        if kernel.cores == "aiv" and not self.aiv:
            raise AddressError(f"kernel '{kernel.name}' needs AIV cores; this stream has none")
        if kernel.cores == "mix":
            need = {a * 2 + j for a in self.aic for j in range(2)}
            if not need <= set(self.aiv) and self.aiv_given:
                raise AddressError(f"MIX kernel '{kernel.name}': AIC {sorted(self.aic)} pair with AIV "
                                   f"{sorted(need)}, which this stream does not hold")
        failed = [d for d in after if d.error is not None]
        if failed:
            raise ArgumentError(f"after=: launch {failed[0].name!r} never finished (its run raised "
                                f"{type(failed[0].error).__name__}); launch it again instead of waiting for it")
        la = Launch(self.pod, self, kernel, tuple(args), numeric, persistent, wait_timeout_us, name)
        la.after = [d for d in after if not d.done]
        san = self.pod.sanitizer
        if self.pod._in_run and san is not None:    # queued by a host function: after the host's writes so far
            la.host_writes_before = san.host_writes
        if self.pod._in_run and numeric:            # a numeric launch queued by a host function during a run
            self.pod._pin_torch()
        self.queue.append(la)
        self.pod._launches.append(la)
        part = self.pod.engine.part
        if part is not None:                        # queued by a host function of a partitioned run (workers.py)
            part.launch_queued(la)
        if self.running is None:
            # queued by a host function during a run (Launch.on_done): not before the run's present
            now = self.pod.engine.now if self.pod._in_run else 0
            self._next(max(self.pod.host_ps, self.free_ps, now))
        return la

    def _next(self, t: int) -> None:
        if not self.queue:
            self.running = None
            return
        la = self.queue.pop(0)
        self.running = la
        overhead = self.overhead_ps
        jitter = self.pod.jitter
        if jitter is not None:
            overhead = jitter.latency(overhead)
        self.pod.engine.push_host(t + overhead, self.pod._try_start, la)


@dataclass
class LaunchInfo:
    """One launch of a run: its dies, core count, start / end (us) and the GM traffic of its transfers (bytes;
    ``timing.Traffic``: through the L2s, moved by the HBMs on misses and write-backs, across dies)."""
    name: str
    dies: list
    cores: int
    start_us: float
    end_us: float | None
    l2_bytes: int = 0
    hbm_bytes: int = 0
    fabric_bytes: int = 0

    @property
    def duration_us(self) -> float | None:
        return None if self.end_us is None else self.end_us - self.start_us


@dataclass
class RunResult:
    """What a run produced: modeled times (us), where the time went, and the timeline.

    ``modeled_us``: end to end, from the host's submit (launch overhead included) to the last write landing.
    ``kernel_us``: from the first kernel start to the last kernel end. ``pipe_busy``: {(die, unit, pipe): us}.
    ``utilization``: per pipe, busy time / (cores that ran x kernel span). ``servers``: shared servers' busy
    time, bytes and utilisation over the run (``hbm{die}``: bytes read on L2 misses plus dirty lines written back;
    ``l2.{die}``: every byte of GM traffic of that die). ``l2``: per die, this run's L2 traffic in bytes
    (``read_hit_bytes``, ``read_miss_bytes``, ``write_bytes``, ``writeback_bytes``) and ``resident_bytes`` now
    (``dirty_bytes`` of them still to be written back: the L2 is not flushed at the end of a run). ``races``: what
    the race sanitizer found during the run (``Pod(sanitize="collect")``; ``races.Race``).
    """

    modeled_us: float
    kernel_us: float
    start_us: float
    end_us: float
    launches: list
    pipe_busy: dict
    utilization: dict
    servers: dict
    bytes_moved: int
    instructions: int
    trace: Trace | None
    parked: list = field(default_factory=list)
    l2: dict = field(default_factory=dict)
    races: list = field(default_factory=list)

    def hbm_bytes(self, die: int | None = None) -> int:
        """Bytes the HBM of ``die`` (default: every die) moved during the run: L2 misses and write-backs."""
        return sum(v["bytes"] for k, v in self.servers.items()
                   if k.startswith("hbm") and (die is None or k == f"hbm{die}"))

    def plot(self, path: str, **kw) -> str:
        if self.trace is None:
            raise ValueError("this run was made with trace=False: no timeline to plot")
        return self.trace.plot(path, **kw)

    def busiest_port(self) -> tuple[str | None, float]:
        """(name, utilisation) of the busiest fabric port (UB or die-to-die) of the run; (None, 0.0) if none."""
        ports = {k: v for k, v in self.servers.items() if k.startswith(("ub.", "d2d."))}
        if not ports:
            return None, 0.0
        name = max(ports, key=lambda k: ports[k]["utilization"])
        return name, ports[name]["utilization"]

    def busy_by_pipe(self) -> dict:
        """{pipe: total busy us over all cores}."""
        out: dict = {}
        for (_, _, pipe), us in self.pipe_busy.items():
            out[pipe] = out.get(pipe, 0.0) + us
        return dict(sorted(out.items()))

    def summary(self) -> str:
        lines = [f"modeled {self.modeled_us:.3f} us end to end, kernels {self.kernel_us:.3f} us, "
                 f"{self.instructions} instructions, {self.bytes_moved} bytes moved"]
        for pipe, us in self.busy_by_pipe().items():
            lines.append(f"  {pipe:<7} busy {us:12.3f} us (all cores)  utilisation {self.utilization.get(pipe, 0):.1%}")
        return "\n".join(lines)


class Pod:
    """An emulated pod of ``profile.dies`` dies sharing one GM address space.

    ``sanitize``: check every run for races between cores (``ascend_emu.sanitizer``): True raises ``RaceError`` at
    the end of the launch that raced, "collect" keeps going and lists them in ``run.races`` (and ``pod.races``);
    None follows ``pod.DEFAULT_SANITIZE`` (off unless the CLI's --sanitize or pytest's --ascend-sanitize set it).
    ``jitter_seed``: perturb fabric, memory, flag and launch latencies by up to ``jitter`` (a fraction) with draws
    from this seed (``ascend_emu.jitter``): the same seed gives the same run, other seeds other interleavings; None
    follows ``pod.DEFAULT_JITTER`` (off unless ``explore`` set it). ``workers``: run each ``synchronize`` over this
    many local processes, each owning whole chips (``ascend_emu.workers``; the same results as one), exchanging
    messages over ``transport`` ("auto": shared memory, "shm", or "gloo"); None follows
    ``workers.default_workers`` (1 unless the CLI's --workers set it)."""

    def __init__(self, profile: HardwareProfile | None = None, *, trace: bool = True,
                 max_modeled_us: float | None = 1e6, launch_mode: str = "single-op", sanitize=None,
                 jitter_seed: int | None = None, jitter: float = 0.3, workers: int | None = None,
                 transport: str = "auto"):
        if launch_mode not in ("single-op", "graph"):
            raise ArgumentError(f"launch_mode={launch_mode!r}: use 'single-op' or 'graph'")
        if profile is not None and not isinstance(profile, HardwareProfile):
            raise ArgumentError(f"profile={profile!r}: pass a HardwareProfile (e.g. cloudmatrix384(dies=2))")
        max_modeled_us = check_us(max_modeled_us, "max_modeled_us", positive=True)
        self.profile = profile or cloudmatrix384()
        # a run over several processes (workers.py): worker processes and how they exchange messages
        self.workers = check_workers(workers, transport, self.profile)
        self.transport = transport
        self.worker_stats: list = []      # per worker of the last partitioned run: its dies, windows, messages,
        # host sync points (syncs), wall time waiting at window ends and in all (wait_s, run_s)
        self._partition_carry: dict = {}  # what parked launches keep between partitioned runs (workers.py)
        self._live = None                 # forked workers kept between runs: they hold parked launches (workers.py)
        self._journal = None              # ... and the host's pod calls since, which they repeat (journal.py)
        self._live_rank = None            # in a kept worker: (its rank, transport, result and command pipes)
        self._parts = None                # the last partitioned run's split of the dies (parked launches keep it)
        self.launch_mode = launch_mode    # default mode of streams (e.g. "graph": a decode step captured as a graph)
        self.gm = GlobalMemory(self.profile.dies, self.profile.hbm_bytes)
        self.trace_on = trace
        self.engine = Engine(self.profile, Trace(clock_ghz=self.profile.clock_ghz) if trace else None)
        self.engine.paths.log_usage = bool(trace)   # the trace's bandwidth counters come from the servers' logs
        self.engine.on_core_done = _WeakCall(self._core_done)
        self.engine.gm = self.gm
        if DEFAULT_PROGRESS is not None:
            self.on_progress(DEFAULT_PROGRESS)
        # each run's bound on simulated time, from its start: a livelock raises instead of running forever
        self.max_modeled_ps = None if max_modeled_us is None else int(max_modeled_us * PS_PER_US)
        self.host_ps = 0
        self._launches: list[Launch] = []
        self._launch_serial = 0
        self._streams: list[Stream] = []
        self._busy_cores: set = set()
        self._waiting: list[Launch] = []
        self._in_run = False              # inside synchronize (host functions queue at the engine's present)
        self._torch_threads = None        # torch's thread count before the run pinned it to 1 (_pin_torch)
        self.killed: list = []            # cores stopped by kill_die
        Jitter.check_fraction(jitter)    # even when no seed turns it on
        if jitter_seed is None and DEFAULT_JITTER is not None:
            jitter_seed, jitter = DEFAULT_JITTER
        self.jitter = None if jitter_seed is None else Jitter(jitter_seed, jitter)
        if self.jitter is not None:
            eng = self.engine
            self.jitter.home = lambda: eng.home
        self.engine.jitter = self.engine.paths.jitter = self.jitter
        self.sanitizer = self._sanitizer(DEFAULT_SANITIZE if sanitize is None else sanitize)

    def _sanitizer(self, mode):
        if mode is False:
            return None
        if mode is not True and mode != "collect":
            raise ArgumentError(f"sanitize={mode!r}: use False, True (raise RaceError) or 'collect' (list the "
                                f"races in run.races)")
        from .sanitizer import Sanitizer
        san = self.engine.sanitizer = Sanitizer(self.engine, mode)
        self.gm.on_alloc = san.track
        if SANITIZERS is not None:
            SANITIZERS.append(san)
        return san

    @property
    def races(self) -> list:
        """Every race the sanitizer found on this pod so far (empty when not sanitizing)."""
        return [] if self.sanitizer is None else list(self.sanitizer.races)

    # ------------------------------------------------------------------ memory
    def _check_die(self, die) -> int:
        return check_die(die, self.profile.dies)

    def check_dies(self, dies, arg: str = "dies") -> list[int]:
        """``dies`` as a list of distinct dies of this pod (``ascend_emu.arguments.check_dies``): what every API
        taking a die list (streams, communicators, EP groups) accepts."""
        return check_dies(dies, self.profile.dies, arg)

    def on_progress(self, fn) -> None:
        """Call ``fn(modeled_us, instructions)`` periodically during runs (None to stop)."""
        self.engine.progress = None if fn is None else (lambda t, n: fn(t / PS_PER_US, n))

    def alloc(self, die: int, shape, dtype, *, phantom: bool = False, name: str | None = None) -> GMTensor:
        """Allocate GM on ``die`` (zero-filled; ``phantom`` = shape and dtype only, for timing-only runs)."""
        return self.gm.alloc(self._check_die(die), shape, dtype, phantom=phantom, name=name)

    def to_gm(self, die: int, array, *, name: str | None = None, dtype=None, copy: bool = True) -> GMTensor:
        """Copy a host array (numpy or torch) into newly allocated GM on ``die``.

        ``copy=False``: no copy: the GM tensor's bytes are the array's own, which needs a CPU array of the GM dtype
        (``dtype`` or the array's), C-contiguous, writeable and not empty (``ascend_emu.memory.aliasable``), else
        ArgumentError. Aliasing rules: kernels read what the array holds when each read happens in simulated time,
        and their GM writes land in the array; the host may change the array between runs (like a host write
        before a launch) but not while a run is going (from a callback): that is outside simulated time and the
        emulator cannot order it. Use it for large inputs the kernels only read (weights), where a copy would cost
        more than the run."""
        return self.gm.from_array(self._check_die(die), array, name=name, dtype=dtype, copy=copy)

    def gm_at(self, die: int, addr: int, shape, dtype) -> GMTensor:
        return self.gm.at(self._check_die(die), addr, shape, dtype)

    @journaled
    def kill_die(self, die: int, *, at_us: float | None = None) -> None:
        """Fault injection: at simulated time ``at_us`` (default: now) every core of ``die`` stops for good; its
        in-flight writes do not land and its launches finish without it. Peers notice only through the protocol
        (missing heartbeats, poll timeouts), as on the real machine."""
        self._check_die(die)
        at_us = check_us(at_us, "at_us")
        t = self.host_ps if at_us is None else int(at_us * PS_PER_US)

        def fault(_):
            killed = self.engine.kill_die(die, self.engine.now)
            self.killed.extend(killed)
            if self.sanitizer is not None:
                self.sanitizer.killed(killed)
        self.engine.push_host(max(t, self.engine.now), fault)

    @journaled
    def invalidate_l2(self) -> None:
        """Drop what every die's L2 holds, dirty lines included and without writing them back: the next run starts
        with cold caches, as on a fresh pod (e.g. to time a kernel cold after runs that warmed the L2)."""
        self.engine.paths.caches.invalidate()

    def blocked(self) -> list:
        """What every blocked core waits for (kernel, core, since when, on what): e.g. the parked persistent
        launches of the last run, for a protocol that wants to report a stall as its own error."""
        return self.engine._blocked_names()

    @journaled
    def host_write(self, tensor: GMTensor, values, *, at_us: float | None = None) -> None:
        """Write GM from the host at simulated time ``at_us`` (default: now); waiting polls see it land."""
        if not isinstance(tensor, GMTensor):
            raise AddressError(f"host_write: tensor must be a GM tensor, got {type(tensor).__name__}")
        values = tensor.host_values(values)
        at_us = check_us(at_us, "at_us")
        t = self.host_ps if at_us is None else int(at_us * PS_PER_US)
        self.engine.host_write(tensor, values, t)

    @property
    def now_us(self) -> float:
        """The pod's present: the host's time between runs, the run's present inside one (a host function)."""
        return (self.engine.now if self._in_run else self.host_ps) / PS_PER_US

    # ------------------------------------------------------------------ launching
    @journaled
    def stream(self, die: int = 0, *, dies=None, aiv=None, aic=None, mode: str | None = None) -> Stream:
        """A stream on ``dies`` (default [die]) using the given AIV/AIC cores (counts or index lists); ``mode``
        None: the pod's ``launch_mode``."""
        s = Stream(self, [die] if dies is None else dies, aiv, aic, mode or self.launch_mode)
        self._streams.append(s)
        return s

    def launch(self, kernel, *, die: int = 0, dies=None, aiv=None, aic=None, args=(), mode: str | None = None,
               numeric: bool = True, persistent: bool = False, wait_timeout_us: float | None = 10_000.0,
               name: str | None = None) -> RunResult:
        """Run one kernel to completion and return the run's result.

        ``aiv``/``aic``: core counts or index lists (default: every core of the kind the kernel uses; a MIX kernel
        takes ``aic`` groups, each AIC with its two AIVs). ``numeric=False`` runs timing-only: local tiles are
        phantom unless allocated with ``phantom=False``."""
        s = self.stream(die, dies=dies, aiv=aiv, aic=aic, mode=mode)
        s.launch(kernel, args, numeric=numeric, persistent=persistent, wait_timeout_us=wait_timeout_us, name=name)
        return self.synchronize()

    def _try_start(self, la: Launch) -> None:
        k = la.kernel.cores
        st = la.stream
        keys = set()
        for d in la.dies:
            if k in ("aic", "mix"):
                keys |= {(d, "aic", i) for i in st.aic}
            if k == "aiv":
                keys |= {(d, "aiv", i) for i in st.aiv}
            if k == "mix":
                keys |= {(d, "aiv", a * 2 + j) for a in st.aic for j in range(2)}
        if keys & self._busy_cores or any(not d.done for d in la.after):
            self._waiting.append(la)
            return
        self._busy_cores |= keys
        la._keys = keys
        if self.sanitizer is not None:
            self.sanitizer.launch_starting(la)
        cores_start = self.engine.now
        if la.kernel.comm:     # the fitted start-up residual of fused dispatch / combine (Kernel docstring)
            cores_start += int(self.profile.comm_start_us * PS_PER_US)
        la._build(self.engine, self.engine.now, cores_start)

    def _core_done(self, core: Core) -> None:
        la = core.launch
        la.n_done += 1
        if la.n_done < len(la.cores):
            return
        # the launch is pod-level: what follows its end (the stream's next launch, launches waiting for its cores,
        # on_done) is a host event, ordered among the host's own, whichever die's core finished last
        la.end_ps = max(c.time for c in la.cores)
        self.engine.push_host(max(la.end_ps, self.engine.now), self._launch_done, la, observe=True)

    def _launch_done(self, la: Launch) -> None:
        self._busy_cores -= la._keys
        la.stream._next(la.end_ps)
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            self._try_start(w)
        if self.sanitizer is not None:
            self.sanitizer.launch_done(la)      # may raise RaceError (sanitize=True)
        if not la.on_done:
            return
        part = self.engine.part
        if part is not None:        # a partitioned run: every worker takes the whole pod's GM, then runs them
            part.host_sync()
        for fn in la.on_done:
            fn(la)
        if part is not None:
            part.host_ran()

    def synchronize(self) -> RunResult:
        """Run until every queued launch has finished (persistent ones may stay parked); return the result."""
        eng = self.engine
        t0 = self.host_ps
        runs = [la for la in self._launches if not la.done]
        queued_before = len(self._launches)
        if self.sanitizer is not None:
            self.sanitizer.run_starting(parked=any(la.start_ps is not None for la in runs))
        eng.run_start = t0
        eng.horizon_ps = None if self.max_modeled_ps is None else t0 + self.max_modeled_ps
        if any(la.numeric for la in runs):
            self._pin_torch()
        gc_was = gc.isenabled()
        gc.disable()   # the run allocates ~10 objects per instruction and frees none of them cyclically
        try:
            try:
                self._in_run = True
                if self.workers > 1:
                    run_partitioned(self)
                else:
                    eng.run()
            except BaseException as e:      # a kernel error, a deadlock, Ctrl-C: the pod stays usable
                self._abandon(e)
                races = None if self.sanitizer is None else self.sanitizer.pending_error(e)
                if races is not None:       # races found before it are its likely cause
                    raise races from e
                raise
            finally:
                self._in_run = False
                if self._torch_threads is not None:
                    sys.modules["torch"].set_num_threads(self._torch_threads)
                    self._torch_threads = None
            runs += self._launches[queued_before:]      # queued during the run by host functions (on_done)
            res = self._result(eng, t0, runs)
            if self.sanitizer is not None:
                res.races = self.sanitizer.run_done()   # may raise RaceError (sanitize=True)
            for la in runs:
                if la.done:     # a finished core is inert: its link back would make a cycle with la.cores
                    for c in la.cores:
                        c.launch = None
            return res
        finally:
            # back on only once the finished cores (and the instruction records they hold) are dropped: the first
            # collection then walks what is still alive, not every object the run made
            if gc_was:
                gc.enable()

    def __del__(self):
        # the engine's helpers point back at it (remote, staging, the sanitizer, the jitter's clock, its cached sync
        # handlers, the contexts of cores still parked): with the pod gone nothing runs on it any more, so drop them
        # and reference counting frees the engine, the GM and the L2s now instead of a pass of the cyclic GC later
        eng = self.__dict__.get("engine")
        if eng is None:             # __init__ raised before the engine was made
            return
        eng.remote = eng.staging = eng.sanitizer = eng.jitter = eng.part = None
        eng.paths.jitter = None
        eng._sync_handlers = {}
        eng.heap, eng.timers, eng.cores = [], [], []
        gm = self.__dict__.get("gm")
        if gm is not None:
            gm.on_alloc = None

    def close(self) -> None:
        """End the forked worker processes this pod keeps for launches parked on their dies (``workers > 1``; they
        also end when the pod is collected or the interpreter exits); those launches end with an error."""
        if self._live is not None:
            from .errors import EmulatorError
            self._abandon(EmulatorError("the pod was closed while launches were parked on its forked workers"))

    def _pin_torch(self) -> None:
        """One torch thread for the rest of the run (tile-sized matmuls: the pool costs more than it gives). Only
        numeric runs import torch for it: a timing-only run never computes, and torch costs ~2 s of CPU to load."""
        if self._torch_threads is not None:
            return
        try:
            import torch
        except ImportError:  # pragma: no cover
            return
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def _abandon(self, error: BaseException) -> None:
        """A run raised: every launch it left unfinished (queued, running or parked) ends with ``error`` and never
        resumes; its cores are free again. GM keeps what landed before the error (writes still in flight are
        lost), a killed die stays dead, host writes and faults still to come stay queued. The next launch starts
        once everything the run had booked is over, so it runs as on a fresh pod."""
        eng = self.engine
        for la in self._launches:
            if not la.done:
                la.error = error
        for st in self._streams:
            st.queue = []
            st.running = None
        self._launches = []
        self._waiting = []
        self._busy_cores = set()
        self._partition_carry = {}      # of the launches just ended (workers.py)
        close_workers(self)
        end = max(self.host_ps, eng.now, eng.last_activity,
                  max((s.free for s in eng.paths.servers.values()), default=0))
        eng.abandon()
        if self.sanitizer is not None:
            self.sanitizer.abandon()
        self.host_ps = eng.last_activity = end
        self._reset_counters(eng)

    def _reset_counters(self, eng) -> None:
        """Per-run totals start from zero for the next run."""
        for s in eng.paths.servers.values():
            s.busy_ps = 0
            s.bytes = 0
            if s.log is not None:
                s.log = []
        eng.paths.caches.take_stats()
        eng.busy = {}
        eng.bytes_moved = 0
        eng.n_instr = 0
        eng.trace = Trace(clock_ghz=self.profile.clock_ghz) if self.trace_on else None

    def _result(self, eng, t0: int, runs: list) -> RunResult:
        end = max(eng.last_activity, t0)
        self.host_ps = end
        eng.cores = [c for c in eng.cores if not c.done]
        done = [la for la in runs if la.done]
        parked = [la for la in runs if not la.done]
        k0 = min((la.start_ps for la in runs if la.start_ps is not None), default=t0)
        k1 = max((la.end_ps for la in done), default=end)
        span = max(k1 - k0, 1)
        for la in parked:                   # a parked persistent kernel's work so far belongs to this run
            for c in la.cores:
                for pipe, ps in c.busy.items():
                    key = (c.die, c.unit, pipe)
                    eng.busy[key] = eng.busy.get(key, 0) + ps
                c.busy = {}
        busy_us = {k: v / PS_PER_US for k, v in eng.busy.items()}
        n_cores: dict = {}
        seen = set()                        # distinct cores: a stream's many launches reuse the same ones
        for la in runs:
            for c in la.cores:
                if (c.die, c.unit) not in seen:
                    seen.add((c.die, c.unit))
                    n_cores[c.kind] = n_cores.get(c.kind, 0) + 1
        util: dict = {}
        per_pipe: dict = {}
        for (_, unit, pipe), v in eng.busy.items():
            per_pipe[pipe] = per_pipe.get(pipe, 0) + v
        for pipe, v in per_pipe.items():
            kind = "aic" if pipe in ("CUBE", "MTE1", "FIXP") else None
            n = n_cores.get(kind, 0) if kind else sum(n_cores.values())
            if pipe in ("VECTOR", "MTE3"):
                n = n_cores.get("aiv", 0) or n
            util[pipe] = min(1.0, v / (max(n, 1) * span))
        servers = {}
        for name, s in sorted(eng.paths.servers.items()):
            if s.bytes:
                servers[name] = {"busy_us": s.busy_ps / PS_PER_US, "bytes": s.bytes,
                                 "utilization": min(1.0, s.busy_ps / span)}
                if eng.trace is not None and s.log:
                    eng.trace.add_counter(s.die, name, s.log)
        res = RunResult(
            modeled_us=(end - t0) / PS_PER_US, kernel_us=(k1 - k0) / PS_PER_US, start_us=t0 / PS_PER_US,
            end_us=end / PS_PER_US,
            launches=[LaunchInfo(la.name, la.dies, len(la.cores), (la.start_ps or t0) / PS_PER_US,
                                 None if la.end_ps is None else la.end_ps / PS_PER_US, **la.traffic.to_dict())
                      for la in runs],
            pipe_busy=dict(sorted(busy_us.items())), utilization=dict(sorted(util.items())), servers=servers,
            bytes_moved=eng.bytes_moved, instructions=eng.n_instr, trace=eng.trace,
            parked=[la.name for la in parked], l2=eng.paths.caches.take_stats())
        self._reset_counters(eng)
        self._launches = parked
        return res
