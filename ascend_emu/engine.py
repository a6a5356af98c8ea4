"""The deterministic discrete-event scheduler (DESIGN.md 3.3).

One event queue ordered by (time, origin, count); integer picoseconds. Every event has a home: the die whose state it
works on (a core's die for its instructions, the owning die for a GM landing), or the host (launches, host
writes, faults). An event pushed while another runs takes that one's home as its origin and the origin's next count, so
the order of events at one time depends only on the history of their origins, never on how the dies' events
interleave: the key a partitioned run (DESIGN.md 10) can compute inside each partition. The host has two origins: what
it does (a launch starting, a host write, a fault: ``HOST``, -1) comes before every die's events at equal times, what
it observes (a launch ending, its on_done) after them (``Engine.host_after``, numbered after the dies), so it sees what
landed then. Whatever one die does to another's state goes through ``send`` (a timestamped event whose home is the
other die: a message).

Kernels are generators, one per core; a core's scalar unit issues instructions in order (``issue_cycles`` each) and
never waits for a pipe unless the instruction is blocking (a poll, an atomic, a barrier, a scalar read of local
data). Each instruction waits for: its pipe (in order), and per-tile read-after-write / write-after-read /
write-after-write dependencies on the core's buffers and on the GM ranges the core touched (the way Ascend C queues
and the compiler's auto-sync order them).
Transfers then reserve shared servers in simulated-time order (timing.py). Data moves at start (inputs sampled) and
lands at end (GM writes), so what one core sees of another is what simulated time allows. A transfer whose GM
operand lives on another die is staged over the dies it uses (staging.py): each books its own servers when the
transfer's message reaches it, and a remote source is sampled when the request reaches its owner.

Waits are event-driven: a poll sleeps until a write to what it watches lands. When no event is left and cores are
still blocked, or a wait passes its bound, a ``DeadlockError`` names every blocked core and what it waits for.

The install compiles this module with Cython; ``engine.pxd`` declares the C types of its classes, fields and hot
locals (times are C integers: -1 stands for "not known yet"). The code here is the code that runs either way
(``_build.py``).
"""
from __future__ import annotations

from types import GeneratorType

import numpy as np

try:                # the install compiles this module (engine.pxd declares the GC calls _untracked makes)
    import cython
    from cython import cast
    _COMPILED = cython.compiled
except ImportError:  # pragma: no cover - Cython is a build requirement
    _COMPILED = False

    def cast(_type, x):
        return x

from . import cube_math
from .cache import footprint, rows_footprint
from .dtypes import fp32, int32
from .errors import ArgumentError, DeadlockError, EmulatorError, HazardError, KernelError, locate
from .isa import COMPUTE, OPS, SYNC, TRANSFER, Instr, cost_vector, rows_of
from .origin import Issuer, origin_at, origin_of
from .polls import Polls
from .remote import Remote
from .staging import Staging
from .timing import Paths
from .tracker import Regions
from .views import View

_GENERATOR = GeneratorType
_COST_VECTOR = cost_vector
_KERNEL_END = OPS["kernel_end"]
_PIPE_BARRIER = OPS["pipe_barrier"]
_BARRIER = OPS["barrier"]
_LOAD = OPS["copy_gm_to_ub"]       # a local one is lent its GM source (a lazy load, Engine._execute)
_FIXPIPE, _FIXPIPE_L1 = OPS["copy_l0c_to_gm"], OPS["copy_l0c_to_l1"]   # read their scale tile (p["scale"]) too
_HOST_BLOCK = 1 << 24       # host actions one host event may push at most (a launch's core starts), _host_block
_HOST = "host"              # the argument of host events that outlive a run that raises (push_host)
HOST = -1                   # the home of the host's actions (its count: the last entry of Engine._counts)
_PIPE_END = "pipe end"      # a waiter of an instruction's pipe end (its end and every earlier one of its pipe)
_LENT = "lent"              # Instr.result of a transfer holding its source lent (Engine._execute)
# the engine's own events are small ints on the heap (a bound method per push would be allocated and called through
# Python); any other callable (data paths, landings, the pod's host events) is called with its argument
_EV_RESUME, _EV_RESERVE, _EV_SYNC, _EV_COMMIT, _EV_RESUME_AFTER, _EV_EXECUTE = range(6)


class Core:
    """Run-time state of one core during one launch."""

    __slots__ = ("die", "kind", "idx", "unit", "launch", "ctx", "gen", "time", "pipe_last", "gm_regs",
                 "unscheduled", "max_end", "drain", "resume_value", "blocked_on", "done", "xflags",
                 "block_start", "_busy", "killed", "traffic", "issuer")

    def __init__(self, die: int, kind: str, idx: int, launch):
        self.die = die
        self.kind = kind
        self.idx = idx
        self.unit = f"{kind}{idx}"
        self.launch = launch
        self.ctx = None
        self.gen = None
        self.time = 0
        self.pipe_last = {}       # pipe -> its _Last: the latest instruction issued to it
        self.gm_regs = {}
        self.unscheduled = 0      # issued non-blocking instructions whose times are not known yet
        self.max_end = 0          # latest visible end among this core's scheduled instructions
        self.drain = None         # the instruction waiting for everything issued before it to finish
        self.resume_value = None
        self.blocked_on = None
        self.done = False
        self.xflags = {}          # (flag_id, from_unit or None) -> count: cross-core flag counters aimed at me
        self.block_start = 0
        self._busy = {}           # pipe -> its busy ps during this launch (a _Busy: added to in place)
        self.killed = False       # its die was killed (fault injection): its pending work is dropped
        self.traffic = launch.traffic     # GM traffic of its transfers: one record per launch, shared by its cores
        self.issuer = None        # tracing: its generator as origin.origin_at last saw it

    @property
    def where(self) -> str:
        return f"die {self.die} {self.kind} {self.idx}"

    @property
    def busy(self) -> dict:
        """pipe -> busy ps of this core during this launch, in the order its pipes were first charged."""
        return {pipe: b.ps for pipe, b in self._busy.items()}

    @busy.setter
    def busy(self, value: dict) -> None:
        self._busy = {pipe: _Busy(ps) for pipe, ps in value.items()}

    def _charge(self, pipe, dur: int) -> None:
        """``pipe`` was busy ``dur`` ps more (one instruction's; an int object less than a dict entry of ints)."""
        b = self._busy.get(pipe)
        if b is None:
            b = self._busy[pipe] = _Busy(0)
        b.ps += dur


class _Last:
    """The latest instruction a core issued to one pipe (Core.pipe_last): replaced in place, where a dict's item
    assignment cost a probe and a store per instruction."""

    __slots__ = ("ins",)

    def __init__(self):
        self.ins = None


class _Busy:
    """One pipe's busy ps on one core (Core.busy), added to in place."""

    __slots__ = ("ps",)

    def __init__(self, ps: int):
        self.ps = ps


class Engine:
    def __init__(self, prof, trace=None):
        self.prof = prof
        self.paths = Paths(prof)
        self.l2_lat, self.hbm_lat = self.paths.l2_lat, self.paths.hbm_lat   # C fields: read once per transfer
        self.line_bytes = prof.l2_line_bytes
        self.dma_active = set()       # DMA engines working on a descriptor
        self.dma_queue = {}           # DMA engine -> descriptors waiting for it, in arrival order
        self.heap = []
        self.timers = []
        # tie-break of events at one time: (origin, count), the pushes counted per origin: dies 0.., then the host's
        # observations (host_after), then its actions (HOST = -1, the last entry)
        self.host_after = prof.dies
        self._counts = [0] * (prof.dies + 2)
        self.home = HOST              # home of the event being processed: the origin of what it pushes
        self.now = 0
        self.trace = trace
        self.issue_ps = prof.cycles_to_ps(prof.issue_cycles)
        self.polls = Polls()          # the wait_gm polls waiting for a landing
        self.cores: list[Core] = []
        self.dead_dies: set = set()   # killed dies: cores of later launches on them are dead on arrival
        self.busy: dict = {}
        self.n_instr = 0
        self.bytes_moved = 0
        self.horizon_ps = None        # the run's bound on simulated time (absolute ps), set per run by the pod
        self.run_start = 0            # when the current run started (ps)
        self.last_activity = 0
        self._flows = {}              # home -> trace flow ids counted on it (_next_flow)
        self.on_core_done = None      # callback(core) set by the pod
        self.progress = None          # callback(now_ps, instructions) every 16k events, for progress bars
        self.n_lent = 0               # transfers holding a lent source (Store.lent), over every store
        self.lent_stores: set = set()  # the stores with lent sources (Store.lent) or lazy loads (Store.loads)
        # opt-in observers, None on the fast path: the race sanitizer (sanitizer.Sanitizer: told of issues,
        # dependencies, transfers, GM landings, sync handlers and blocking completions) and the seeded latency
        # perturbation of transfers (jitter.Jitter)
        self.sanitizer = None
        self.jitter = None
        self._sync_handlers = {}      # OpSpec -> its bound _sync_* handler
        self.remote = Remote(self)    # scalar accesses of another die's GM, answered by the owner (remote.py)
        self.staging = Staging(self)  # bulk transfers between dies, timed at each die they use (staging.py)
        # a partitioned run (workers.Partition): which dies this process owns; ``send`` to another's die posts a
        # message, host events are replicated on every worker. None: one process owns every die
        self.part = None
        self.origin = self.event_count = 0    # the key (after ``now``) of the event being processed

    # ------------------------------------------------------------------ event core
    def push(self, t: int, fn, arg) -> None:
        """Queue ``fn(arg)`` (or one of the engine's ``_EV_*`` events) at time ``t`` on the current event's home."""
        home = self.home
        _heap_push(self.heap, _event(t, home, self._count(home), home, fn, arg))

    def send(self, t: int, die: int, fn, arg) -> None:
        """Queue ``fn(arg)`` at ``t`` on die ``die``'s state, from the current event: the one way an event acts on
        another die (a message; the owner of a die's state in a partitioned run receives it). Within one die it is
        ``push``."""
        home = self.home
        count = self._count(home)
        part = self.part
        if part is not None and not part.owned[die]:
            part.post(t, home, count, die, fn, arg)
            return
        _heap_push(self.heap, _event(t, home, count, die, fn, arg))

    def push_host(self, t: int, fn, arg=_HOST, observe: bool = False) -> None:
        """Queue a host event ``fn(arg)`` at ``t``: pod-level work, ordered among the host's own events whatever
        die's event queued it. An action (a launch starting, a host write, an injected fault) comes before the dies'
        events at ``t``; with ``observe`` (a launch ending) after them. With the default ``arg`` it belongs to the
        pod, not to a launch, so it outlives a run that raises (``abandon``)."""
        host = self.host_after if observe else HOST
        _heap_push(self.heap, _event(t, host, self._count(host), host, fn, arg))
        if self.part is not None:       # windows stop at host events (workers.py)
            self.part.host_event_at(t)

    def _host_block(self) -> None:
        """A host event starts: the host's actions pushed from now on count from the next block of ``_HOST_BLOCK``.
        The order of events is unchanged (counts only grow), and the count of each host action is the same on
        every worker of a partitioned run: within a host event, a landing may wake polls that only the worker
        owning the word holds, so the workers' counts differ by its answers until the next block."""
        c = self._counts
        c[-1] = ((c[-1] // _HOST_BLOCK) + 1) * _HOST_BLOCK

    def _count(self, origin: int) -> int:
        """The next count of ``origin``'s pushes: the tie-break of events (and timers) at one time after the origin."""
        n = self._counts[origin] + 1
        self._counts[origin] = n
        return n

    def _slice(self, die, unit, track, name, start: int, end: int, args) -> None:
        """``Trace.add_slice`` on the engine's trace without a Python call (one per instruction of a traced run)."""
        self.trace.records.append(_untracked_but((die, unit, track, name, start, end, args), args))

    def _next_flow(self) -> int:
        """A trace flow id, unique and counted on the current home (the same in any partitioning)."""
        n = self._flows.get(self.home, 0) + 1
        self._flows[self.home] = n
        return ((self.home + 1) << 40) | n

    def abandon(self) -> None:
        """A run raised: drop every core of it and every pending event but the host's, so the next run starts
        clean. What already landed in GM stays; writes still in flight are lost."""
        for core in self.cores:
            gen = core.gen
            core.gen = core.ctx = core.drain = core.blocked_on = core.issuer = None
            core.done = core.killed = True
            if gen is not None:
                try:
                    gen.close()
                except Exception:   # a kernel that yields or raises while being closed: it is dropped anyway
                    pass
        self.cores = []
        heap = []
        for e in self.heap:
            if e.arg is _HOST:
                _heap_push(heap, e)
        self.heap = heap
        self.timers = []
        self.polls = Polls()
        self.dma_active = set()
        self.dma_queue = {}
        for st in self.lent_stores:
            st.lent = st.loads = None
        self.lent_stores = set()
        self.n_lent = 0
        self.staging.abandon()

    def run(self, until: int = -1) -> None:
        """Process events until none is left; raise DeadlockError if cores remain blocked. ``until`` >= 0: only
        the events before that time (a window of a partitioned run, workers.py), without the deadlock check.

        An exception out of an event (a data path, a landing, a handler) says where it happened: the kernel, core,
        instruction and simulated time of that event."""
        heap, timers = self.heap, self.timers
        horizon = -1 if self.horizon_ps is None else self.horizon_ps    # engine.pxd: a C value in the build
        progress = self.progress
        # a sanitized partitioned run: told of every event popped (race_log.Recorder.popped orders the logs)
        popped = None if self.part is None else self.part.popped
        tick = 0
        arg = None
        try:
            while heap or timers:
                if timers and (not heap or _time_of(timers[0]) < _time_of(heap[0])):
                    if 0 <= until <= _time_of(timers[0]):
                        break
                    arg = None
                    self._fire_timer()          # a bound that expires raises, or (on_timeout="return") resumes
                    continue
                if 0 <= until <= _time_of(heap[0]):
                    break
                ev = _heap_pop(heap)
                # the key read into the C fields straight from the Event (a local would be an int object each)
                fn = ev.fn
                arg = ev.arg
                self.now = ev.t
                self.origin = ev.origin     # the event's key, for a partitioned run's launch ends (workers.py)
                self.event_count = ev.count
                self.home = ev.die
                if popped is not None:
                    popped(ev.t, ev.origin, ev.count)
                if type(fn) is int:    # type(): the type slot, where .__class__ is an attribute lookup
                    if fn == _EV_RESUME:
                        self._resume(arg)
                    elif fn == _EV_RESERVE:
                        self._reserve(arg)
                    elif fn == _EV_EXECUTE:
                        self._execute(arg)
                    elif fn == _EV_SYNC:
                        self._handle_sync(arg)
                    elif fn == _EV_COMMIT:
                        self._commit(arg)
                    else:
                        self._resume_after(arg)
                else:
                    if ev.die < 0 or ev.die >= self.host_after:
                        self._host_block()
                    fn(arg)
                if progress is not None:
                    tick += 1
                    if tick & 0x3FFF == 0:
                        progress(self.now, self.n_instr)
                if horizon >= 0 and self.now > horizon:
                    raise DeadlockError(f"simulated time passed the run's bound of "
                                        f"{(horizon - self.run_start) / 1e6:.1f} us (at {horizon / 1e6:.1f} us) with "
                                        f"work still pending (a livelock, or raise max_modeled_us)",
                                        self._blocked_names())
        except EmulatorError as e:
            raise locate(e, self._where(arg))
        except Exception as e:      # a data path or a landing met what its checks let through: say where
            raise KernelError(f"{type(e).__name__}: {e} [{self._where(arg)}]") from e
        finally:
            self.home = HOST        # between runs the host acts (host writes, launches)
        if until >= 0:
            return
        if self.n_lent:
            self._settle_all()
        blocked = [c for c in self.cores if c.blocked_on is not None and not c.launch.persistent]
        if blocked:
            lines = [self._describe_block(c) for c in self.cores if c.blocked_on is not None]
            raise DeadlockError("deadlock: no event can make progress; blocked cores:\n  " + "\n  ".join(lines),
                                lines)

    def _where(self, arg) -> str:
        """Where the event of ``arg`` (an instruction, a core, a launch, a host event) happened, for messages."""
        at = f"at {self.now / 1e6:.3f} us"
        arg = getattr(arg, "handle", arg)       # a staged transfer's message: where its instruction was issued
        if isinstance(arg, Instr):
            core = arg.core
            if core is None:
                return f"{arg.spec.name} {at}"
            return f"kernel '{core.launch.name}' {core.where}, {arg.spec.name} {at}"
        if isinstance(arg, Core):
            return f"kernel '{arg.launch.name}' {arg.where} {at}"
        if hasattr(arg, "kernel"):      # a launch starting
            return f"kernel '{arg.name}' starting {at}"
        return f"host event {at}"

    def _blocked_names(self):
        return [self._describe_block(c) for c in self.cores if c.blocked_on is not None]

    def _fire_timer(self):
        ev = _heap_pop(self.timers)
        t, home, ins = ev.t, ev.die, ev.arg
        self.home = home
        c = ins.core
        if home != c.die:           # the bound of a poll of another die's words expires where the poll waits
            if self.polls.remove(ins) and not c.killed:
                self.now = max(self.now, t)
                self.remote.expired(ins)
            return
        if ins.end < 0 and c.blocked_on is ins and not c.killed:
            self.now = max(self.now, t)
            if ins.p.get("on_timeout") == "return":      # the kernel handles it (resend, give up): yields None
                self.polls.remove(ins)
                self._complete_blocking(ins, t, None)
                return
            self._wait_bound_exceeded(ins, t)

    def _wait_bound_exceeded(self, ins, t: int):
        raise DeadlockError(f"wait bound exceeded at {t / 1e6:.3f} us: {self._describe_block(ins.core)}",
                            [self._describe_block(x) for x in self.cores if x.blocked_on is not None])

    def _add_timer(self, t: int, ins) -> None:
        """Bound ``ins`` (a poll) at ``t``: ordered by the current home's count, like its events."""
        home = self.home
        _heap_push(self.timers, _event(t, home, self._count(home), home, None, ins))

    def _describe_block(self, core: Core) -> str:
        ins = core.blocked_on
        what = ins.spec.name
        p = ins.p or {}
        if what == "wait_gm":
            v = ins.srcs[0]
            cur = v.arr
            cur = "phantom" if cur is None else np.array2string(np.asarray(cur).reshape(-1)[:8], separator=",")
            detail = f"wait_gm on {v.describe()} until {p['how']} {p['cmp']} {p['value']} (now {cur})"
        elif what == "barrier":
            la, group = core.launch, p["group"]
            if group != "die" and la.barrier_leader is not None:    # counted per chip (_sync_barrier)
                leader = la.barrier_leader[core.die]
                st = la.barriers.get((group, leader))
                detail = (f"barrier '{group}' ({len(st) if st else 0} of {la.chip_group_size(group, leader)} "
                          f"cores of its chip arrived)")
            else:
                st = la.barriers.get((group, core.die) if group == "die" else group)
                detail = f"barrier '{group}' ({len(st) if st else 0} of {la.group_size(group, core.die)} cores arrived)"
        elif what == "cross_core_wait":
            detail = f"cross_core_wait flag {p['flag']} (counters {dict(core.xflags)})"
        else:
            detail = what
        return (f"kernel '{core.launch.name}' {core.where} blocked since {core.block_start / 1e6:.3f} us "
                f"in {detail}")

    # ------------------------------------------------------------------ cores
    def start_core(self, core: Core, t: int) -> None:
        core.time = t
        if self.part is None:
            self.cores.append(core)
        elif self.part.started(core):   # else another worker runs it; this one keeps a replica (messages name it)
            self.cores.append(core)
        if core.die in self.dead_dies:
            self.send(t, core.die, self._dead_on_arrival, core)
            return
        self.send(t, core.die, _EV_RESUME, core)

    def _dead_on_arrival(self, core: Core) -> None:
        """A core of a launch that starts on a die killed earlier: it never runs; its launch counts it done."""
        if core.done:
            return
        core.killed = core.done = True
        if core.gen is not None:
            core.gen.close()
        if self.on_core_done is not None:
            self.on_core_done(core)

    def _resume(self, core: Core) -> None:
        if core.killed:
            return
        if self.now > core.time:
            core.time = self.now
        core.blocked_on = None
        gen = core.gen
        val = core.resume_value
        core.resume_value = None
        while True:
            try:
                # a generator's next() is its send(None) without looking the method up (once per instruction)
                ins = next(gen) if val is None and type(gen) is _GENERATOR else gen.send(val)
            except StopIteration:
                self._finish_kernel(core)
                return
            except EmulatorError as e:
                raise locate(e, f"kernel '{core.launch.name}' {core.where} at {core.time / 1e6:.3f} us")
            except Exception as e:  # a bug in the user's kernel: wrap once, with the location
                raise KernelError(f"kernel '{core.launch.name}' raised {type(e).__name__}: {e} "
                                  f"[{core.where} at {core.time / 1e6:.3f} us]") from e
            val = None
            if type(ins) is not Instr:
                if isinstance(ins, (int, np.integer)) and not isinstance(ins, bool):   # yield n: n scalar cycles
                    if ins < 0:
                        raise locate(ArgumentError(f"yield {ins}: a scalar cycle count must be >= 0"),
                                     f"kernel '{core.launch.name}' {core.where} at {core.time / 1e6:.3f} us")
                    core.time += self.prof.cycles_to_ps(int(ins))
                    continue
                raise KernelError(f"kernel '{core.launch.name}' yielded {ins!r}; yield instructions made by the "
                                  f"context (ctx.copy_gm_to_ub(...), ctx.vec.add(...), ...) or a cycle count "
                                  f"[{core.where}]")
            instr = ins               # an Instr (engine.pxd): its fields without attribute lookups
            self.issue(core, instr)
            if instr.blocking or core.drain is instr:
                core.blocked_on = ins
                core.block_start = core.time
                return

    def _finish_kernel(self, core: Core) -> None:
        ins = Instr(_KERNEL_END, (), (), None, blocking=True)
        self.issue(core, ins)
        core.blocked_on = ins
        core.block_start = core.time

    def _complete_from_afar(self, ins: Instr, t: int, value) -> None:
        """Blocking ``ins`` finishes at ``t`` by what happened on the current home (a landing its poll saw, the reply
        of an atomic, the last core at a barrier): on its own die at once, from another die (or the host) as a
        message arriving at ``t``; until then a bound of its own may still expire."""
        if ins.core.die == self.home:
            self._complete_blocking(ins, t, value)
        else:
            self.send(t, ins.core.die, self._complete_arrived, (ins, value))

    def _complete_arrived(self, msg) -> None:
        ins, value = msg
        core = ins.core
        if ins.end < 0 and core.blocked_on is ins and not core.killed:
            self._complete_blocking(ins, self.now, value)

    def _complete_blocking(self, ins: Instr, t: int, value=None) -> None:
        """A blocking instruction finished at ``t``: record it, release its dependents, resume the core."""
        if self.sanitizer is not None:
            self.sanitizer.completed(ins, value)
        if ins.start < 0:
            ins.start = t
        ins.busy_end = t
        ins.end = t
        core = ins.core
        if self.trace is not None and t > core.block_start and ins.spec is not _KERNEL_END:
            self._slice(core.die, core.unit, "WAIT", ins.spec.name, core.block_start, t, ins.origin)
        if ins.waiters:
            self._release(ins)
        if (ins.spec is _BARRIER or ins.spec is _PIPE_BARRIER) and self.sanitizer is None:
            # a barrier drains the core: everything it issued before has ended by now, so no later instruction can
            # wait on those GM records (they could only raise its ready time to one it is already past); dropping
            # them keeps a core's records, and the instructions they hold, to what it issued since
            core.gm_regs = {}
        if ins.spec is _KERNEL_END:
            for pipe, ps in core.busy.items():      # a fresh dict of ints
                key = (core.die, core.unit, pipe)
                self.busy[key] = self.busy.get(key, 0) + ps
            core._busy = {}
            core.done = True
            core.blocked_on = None
            core.time = t
            # everything it issued is visible now: drop its dependency records, tiles and generator, so a big run
            # does not keep every instruction it made alive until the launch handle goes away
            if core.ctx is not None:
                core.ctx._retire()
            core.gen = core.ctx = core.drain = core.issuer = None
            core.pipe_last = {}
            core.gm_regs = {}
            self.last_activity = max(self.last_activity, t)
            if self.on_core_done is not None:
                self.on_core_done(core)
            return
        core.resume_value = value
        self.push(t, _EV_RESUME, core)

    # ------------------------------------------------------------------ issue and dependencies
    def issue(self, core: Core, ins: Instr) -> None:
        """Take one instruction from a core's scalar unit at the core's current time."""
        spec = ins.spec
        ins.core = core
        ins.ready = core.time
        core.time += self.issue_ps
        if self.trace is not None:      # the kernel line that issued it, for the slices' args
            if spec is _KERNEL_END:     # its generator has finished
                ins.origin = origin_of(self.trace._origins, core.gen, core.launch.name)
            else:
                iss = core.issuer
                if iss is None:     # the sites and kernel name kept in it: no attribute lookups per instruction
                    iss = core.issuer = Issuer(self.trace._origins, core.launch.name)
                ins.origin = origin_at(iss, iss.sites, core.gen, iss.kernel)
        self.n_instr += 1
        kind = spec.kind
        if kind == SYNC:
            after = ins.p.get("after") if ins.p else None
            if spec is _KERNEL_END or spec is _PIPE_BARRIER or spec is _BARRIER or after == "all":
                # everything issued before must be visible: the scalar unit waits for the drain (Ascend C's SyncAll
                # starts with PipeBarrier<PIPE_ALL>, so a barrier orders the core's own GM writes before it)
                if core.unscheduled:
                    core.drain = ins
                    ins.pending += 1
                elif core.max_end > ins.ready:
                    ins.ready = core.max_end
            elif type(after) is str:
                cell = core.pipe_last.get(after)
                if cell is not None:
                    self._dep(ins, cell.ins, _PIPE_END)
            elif after is not None:          # several pipes: after every earlier instruction of each
                for pipe in after:
                    cell = core.pipe_last.get(pipe)
                    if cell is not None:
                        self._dep(ins, cell.ins, _PIPE_END)
        else:
            pipe_last = core.pipe_last
            cell = pipe_last.get(spec.pipe)
            if cell is None:
                cell = pipe_last[spec.pipe] = _Last()
            last = cell.ins
            if last is not None:    # in-order pipe: start after the previous instruction frees it
                if last.busy_end >= 0:      # known (a staged transfer knows it before its end: staging.py)
                    if last.busy_end > ins.ready:
                        ins.ready = last.busy_end
                else:
                    ws = last.waiters
                    if ws is None:
                        ws = last.waiters = []
                    ws.append(ins)
                    ws.append(False)
                    ins.pending += 1
            ins.pipe_prev = last
            cell.ins = ins
        real = True
        for v in ins.srcs:
            self._track(core, ins, v, False)
            if v.store.data is None:
                real = False
        for v in ins.dsts:
            self._track(core, ins, v, True)
            if v.store.data is None:
                real = False
        ins.real = real
        if self.sanitizer is not None:
            self.sanitizer.issued(core, ins)
        if not ins.blocking and core.drain is not ins:
            core.unscheduled += 1
        if ins.pending == 0:
            self._ready(ins)

    def _close_pipe(self, ins: Instr) -> None:
        """My times are known: so are those of every earlier instruction of my pipe (a pipe starts them in order),
        so the latest end among them is known too; ``after=`` that pipe waits for it."""
        end = ins.end
        prev = ins.pipe_prev
        if prev is not None:
            if prev.pipe_end < 0:       # a staged transfer before me has not heard back (staging.py): known then
                self.staging.close_after(prev, ins)
                return
            ins.pipe_prev = None
            if prev.pipe_end > end:
                end = prev.pipe_end
        ins.pipe_end = end

    def _scheduled(self, ins: Instr) -> None:
        """A non-blocking instruction's times are known: account it toward its core's drain."""
        self._close_pipe(ins)
        core = ins.core
        if ins.end > core.max_end:
            core.max_end = ins.end
        core.unscheduled -= 1
        if core.unscheduled == 0 and core.drain is not None:
            d = core.drain
            core.drain = None
            if core.max_end > d.ready:
                d.ready = core.max_end
            if not d.blocking:        # counted from now on, like any issued instruction
                core.unscheduled += 1
            d.pending -= 1
            if d.pending == 0:
                self._ready(d)
            if not d.blocking:        # the scalar unit waited for the drain; now it goes on
                self.push(max(d.ready, self.now), _EV_RESUME, core)

    def _dep(self, ins: Instr, other: Instr, which) -> None:
        """``ins`` waits for ``other``'s end (True), busy end (False) or pipe end (_PIPE_END)."""
        if other.end >= 0:
            if which is True:
                v = other.end
            elif which is False:
                v = other.busy_end
            elif other.pipe_end >= 0:
                v = other.pipe_end
            else:                       # its pipe end waits for a staged transfer before it (staging.py)
                if other.end > ins.ready:
                    ins.ready = other.end
                self._dep(ins, other.pipe_prev, _PIPE_END)
                return
            if v > ins.ready:
                ins.ready = v
        elif which is False and other.busy_end >= 0:    # a staged transfer in flight: its mover is done
            if other.busy_end > ins.ready:
                ins.ready = other.busy_end
        else:
            ws = other.waiters
            if ws is None:
                ws = other.waiters = []
            ws.append(ins)
            ws.append(which)
            ins.pending += 1

    def _track(self, core: Core, ins: Instr, v, write: bool) -> None:
        """Add ``ins``'s dependencies through operand ``v``: a local tile's regions are its store's, a GM tensor's
        are this core's own records of that tensor (tracker.py)."""
        st = v.store
        regs = st.regions
        if regs is None:                       # GM: tracked per core
            regs = core.gm_regs.get(st.uid)
            if regs is None:
                regs = core.gm_regs[st.uid] = Regions()
        blk = v._blk
        regs.track(ins, v.lo, v.hi, (blk if blk is not None else v._layout())[2], write, core.time, self.sanitizer)

    # ------------------------------------------------------------------ scheduling
    def _ready(self, ins: Instr) -> None:
        """All dependencies are known: compute kinds get their times now, the others wait for their time."""
        kind = ins.spec.kind
        if kind == COMPUTE:
            self._schedule_compute(ins)
            if ins.waiters:
                self._release(ins)
        elif kind == TRANSFER:
            self.push(ins.ready, _EV_RESERVE, ins)
        else:
            self.push(ins.ready, _EV_SYNC, ins)

    def _schedule_compute(self, ins: Instr) -> None:
        start = ins.ready
        dur, lat = ins.dur, ins.lat
        cost = ins.spec.cost
        if dur == 0 and cost is not None:
            # the vector ops' cost by a C call (a call through the OpSpec's field goes through Python's arguments)
            dur, lat = cost_vector(ins, self.prof) if cost is _COST_VECTOR else cost(ins, self.prof)
        ins.start = start
        ins.busy_end = start + dur
        ins.end = start + dur + lat
        core = ins.core
        spec = ins.spec
        core._charge(spec.pipe, dur)
        if self.trace is not None:
            self._slice(core.die, core.unit, spec.pipe, spec.name, start, start + dur, ins.origin)
        if ins.real and spec.execute is not None:
            self.push(start, _EV_EXECUTE, ins)
        if ins.blocking:
            self._close_pipe(ins)
            core.resume_value = None
            self.push(ins.end, _EV_RESUME_AFTER, ins)
        else:
            self._scheduled(ins)
        if ins.end > self.last_activity:
            self.last_activity = ins.end

    def _resume_after(self, ins: Instr) -> None:
        core = ins.core
        if self.trace is not None and self.now > core.block_start:
            self._slice(core.die, core.unit, "WAIT", ins.spec.name, core.block_start, self.now, ins.origin)
        core.resume_value = ins.result
        self._resume(core)

    def _release(self, ins: Instr) -> None:
        stack = None            # the compute waiters scheduled on the way, whose own waiters are released next
        x = ins
        while True:
            if x is None:
                if not stack:
                    return
                x = stack.pop()
            ws = x.waiters
            x.waiters = None
            if not ws:
                x = None
                continue
            end, busy_end, pipe_end = x.end, x.busy_end, x.pipe_end
            for i in range(0, len(ws), 2):      # flat pairs: waiter, which time: end (True), busy end (False), pipe end
                w = ws[i]
                which = ws[i + 1]
                if which is True:
                    v = end
                elif which is False:
                    v = busy_end
                elif pipe_end >= 0:
                    v = pipe_end
                else:       # my pipe end waits for a staged transfer before me (staging.py): wait for it there
                    if end > w.ready:
                        w.ready = end
                    w.pending -= 1
                    self._dep(w, x.pipe_prev, _PIPE_END)
                    continue
                if v > w.ready:
                    w.ready = v
                w.pending -= 1
                if w.pending == 0:
                    k = w.spec.kind
                    if k == COMPUTE:
                        self._schedule_compute(w)
                        if stack is None:
                            stack = [w]
                        else:
                            stack.append(w)
                    elif k == TRANSFER:
                        self.push(w.ready, _EV_RESERVE, w)
                    else:
                        self.push(w.ready, _EV_SYNC, w)
            x = None

    def _reserve(self, ins: Instr) -> None:
        """A transfer is ready (in time order): look up its bytes in the L2s, take the shared servers on its route,
        then move the data.

        A DMA descriptor comes here twice: when ready, to queue on its engine (which takes descriptors one at a time,
        in arrival order, and is busy from a descriptor's start-up until its last byte has passed every server), and
        when its start-up is over, for its bytes to take the L2, HBM and fabric servers in time order with everyone
        else's (booking them when queued behind other descriptors would block earlier traffic)."""
        spec = ins.spec
        core = ins.core
        if core.killed:
            return
        if self.n_lent and spec.gm_rows and len(ins.srcs) > 1 and ins.srcs[1].store.loads:
            self._settle_reads(ins.srcs[1])     # a row tile: read for the timing already
        r = ins.path
        eng = r.engine
        if eng is not None and ins.start < 0:
            if eng in self.dma_active:
                self.dma_queue.setdefault(eng, []).append(ins)
            else:
                self._dma_begin(ins)
            return
        if r.stage:                       # a GM operand on another die: timed at each die it uses (staging.py)
            self.staging.start(ins)
            return
        nbytes = ins.nbytes
        start = self.now if eng is None else ins.start
        flow = start + r.startup
        finish = flow
        mover = 0.0                       # ps the core's mover needs for the bytes
        lat = self.l2_lat
        line = self.line_bytes
        gm_bytes = hbm_lines = 0          # this transfer's bytes through the L2s, lines it made the HBMs move
        c = r.read_cache
        if c is not None:                 # a GM source, through the L2 of the die that owns it
            c.access(self._footprint(ins.srcs[0], ins), False)
            lines = c.hit + c.miss
            miss_b = nbytes * c.miss // lines if lines else 0
            mover = (nbytes - miss_b) / r.rate_hit + miss_b / r.rate_miss if eng is None else 0.0
            finish = _book(r.read_l2, nbytes, flow, finish)
            gm_bytes += nbytes
            hbm_lines += c.miss + c.evicted
            if c.miss or c.evicted:
                finish = _book(r.read_hbm, (c.miss + c.evicted) * line, flow, finish)
            if c.miss:
                lat = self.hbm_lat
        c = r.write_cache
        if c is not None:                 # a GM destination: write-allocate into the owner's L2
            c.access(self._footprint(ins.dsts[0], ins), True)
            if eng is None:
                mover += nbytes / r.rate_write
            finish = _book(r.write_l2, nbytes, flow, finish)
            gm_bytes += nbytes
            hbm_lines += c.evicted
            if c.evicted:
                finish = _book(r.write_hbm, c.evicted * line, flow, finish)
        links = r.links
        for i in range(len(links)):
            finish = _book(links[i], nbytes, flow, finish)
        tr = core.traffic
        tr.l2_bytes += gm_bytes
        tr.hbm_bytes += hbm_lines * line
        if links:
            tr.fabric_bytes += nbytes
        if eng is not None:
            mover = nbytes / eng.bw
        elif r.remote_rate > 0.0 and nbytes / r.remote_rate > mover:
            mover = nbytes / r.remote_rate      # latency-bound: outstanding bytes per round trip
        mover_ps = int(mover)
        if flow + mover_ps > finish:
            finish = flow + mover_ps
        ins.start = start
        ins.busy_end = finish
        if self.jitter is None:
            ins.end = finish + r.link_lat + lat
        else:                             # seeded perturbation of the fabric and memory latency
            ins.end = self.jitter.transfer_end(ins, finish, r.link_lat + lat)
        self._occupy(ins, flow)
        if ins.end > self.last_activity:
            self.last_activity = ins.end
        self._scheduled(ins)
        if self.sanitizer is not None:    # before the data path: at equal times its checks see what the data sees
            self.sanitizer.transfer(ins)
        if ins.real:
            if start <= self.now:     # a DMA reads its source when its bytes start to flow
                self._execute(ins)
            else:
                self.push(start, _EV_EXECUTE, ins)
            if spec.commit is not None:       # lands on the die that owns the destination
                self.send(ins.end, ins.dsts[0].store.die, _EV_COMMIT, ins)
        if ins.waiters:
            self._release(ins)

    def _occupy(self, ins: Instr, flow: int) -> None:
        """Transfer ``ins``'s mover (its core's pipe or its DMA engine) is busy from its start to its busy end, its
        bytes flowing from ``flow``: count the time and bytes, free the engine then, trace the slice."""
        spec = ins.spec
        core = ins.core
        r = ins.path
        eng = r.engine
        nbytes = ins.nbytes
        start = ins.start
        finish = ins.busy_end
        self.bytes_moved += nbytes
        dur = finish - start
        core._charge(spec.pipe, dur)
        if eng is not None:
            eng.busy_ps += dur
            eng.bytes += nbytes
            self.push(finish, self._dma_next, eng)
        if self.trace is not None:     # compact records: the trace builds their args dicts when read (trace.py)
            if eng is not None:
                self.trace.records.append(_untracked_but((core.die, "dma" + eng.name.split(".")[1], "DMA",
                                                          spec.name, start, finish, ins.origin, nbytes, core.unit),
                                                         ins.origin))
                if eng.log is not None:
                    eng.log.append(_untracked_but((flow, finish, nbytes), None))
            else:
                self.trace.records.append(_untracked_but((core.die, core.unit, spec.pipe, spec.name, start, finish,
                                                          ins.origin, nbytes), ins.origin))

    def _footprint(self, view, ins: Instr) -> tuple:
        """The L2 lines a transfer's GM operand touches: the view's, or for a gather / scatter only its rows."""
        if ins.spec.gm_rows:
            return rows_footprint(view, rows_of(ins), self.line_bytes)
        fp = view._l2fp
        if fp is None:
            # memoised on the view (cache.footprint) as long as it lives: its ints off the GC's lists, or the first
            # collection after the run walks every one (a gen-0 pass of ~25k objects after a prolog call)
            fp = _untracked(footprint(view, self.line_bytes))
        return fp

    def _dma_begin(self, ins: Instr) -> None:
        """The engine takes descriptor ``ins`` now: its start-up runs, then its bytes flow (``_reserve`` again)."""
        eng = ins.path.engine
        self.dma_active.add(eng)
        ins.start = self.now
        self.push(self.now + ins.path.startup, _EV_RESERVE, ins)

    def _dma_next(self, eng) -> None:
        """A descriptor's last byte has passed: the engine takes the next queued one (or goes idle)."""
        q = self.dma_queue.get(eng)
        while q:
            ins = q.pop(0)
            if not ins.core.killed:
                self._dma_begin(ins)
                return
        self.dma_active.discard(eng)

    def _commit(self, ins: Instr) -> None:
        v = ins.dsts[0]
        if self.n_lent:
            self._unlend_overlapping(v)       # other transfers still to copy out of what this landing overwrites
            if ins.result is _LENT:           # the source is as it was at the start: copy it once, from there
                self._unlend(ins)
                ins.result = ins.loan.arr
        if ins.core is not None and ins.core.killed:
            return
        if self.part is not None:
            self.part.writing(v, ins.result[0] if ins.spec.gm_rows else None)    # a scatter's sample: (rows, values)
        ins.spec.commit(ins)
        ins.result = None
        self.gm_written(v.store, v.lo, v.hi, ins)

    # ------------------------------------------------------------------ data paths: sources copied once
    # A GM-bound copy samples its source at its start and lands it at its end. Rather than copying the source twice
    # (into a sample, then into GM), the engine lends the source to the transfer (``Instr.loan``): the landing copies
    # it straight into GM, and a write into a lent range before the landing first takes the sample the transfer would
    # have taken (``_unlend_overlapping``). A local GM -> UB load is lent the same way (a lazy load): its GM source
    # stands for its UB tile until something reads the tile (``_settle_reads``: the copy happens then), writes the
    # tile or the source (the copy happens first; a later load over the whole tile drops it), or the run ends; a
    # GM-bound copy out of such a tile borrows the GM bytes it stands for (``_stand_in``), so a GM -> UB -> GM relay
    # copies its bytes once. A fixpipe that lands its L0C tile unconverted lends the tile the same way (``_lends``).
    # Every write of the run goes through one of: ``_execute`` (the data paths), ``_commit``,
    # a remote read's arrival and the landings of scalar stores, atomics and host writes; every read of a tile
    # through ``_execute`` (a gather's row tile also in ``_reserve``); host writes outside a run find nothing lent
    # (a run ends with every landing done and every lazy load settled: ``_settle_all``).
    def _execute(self, ins: Instr) -> None:
        """Run ``ins``'s data path now (its start), after taking the samples its writes would spoil."""
        spec = ins.spec
        if spec.lends:
            src = ins.srcs[0]
            loan = src
            if self.n_lent and src.store.loads:
                loan = self._stand_in(src)
            self._lend(ins, loan)
            return
        if self.n_lent:
            self._settle_srcs(ins)
            if spec is _LOAD:
                self._drop_covered(ins.dsts[0])
            for v in ins.dsts:
                self._unlend_overlapping(v)
        if spec is _FIXPIPE and _lends(ins):
            cube_math.settle(ins.srcs[0])       # its int8 steps land now, as ex_fixpipe's read would land them
            self._lend(ins, ins.srcs[0])        # the L0C tile stands for its sample until the landing or a write
            return
        if spec is _LOAD and ins.core is not None and self.sanitizer is None and self.part is None:
            self._lend(ins, ins.srcs[0])        # a lazy load: the GM source stands for the tile
            st = ins.dsts[0].store
            if st.loads is None:
                st.loads = set()
                self.lent_stores.add(st)
            st.loads.add(ins)
            return
        spec.execute(ins)

    def _settle_srcs(self, ins: Instr) -> None:
        """``ins`` is about to read its operands: lazy loads into them copy now."""
        for v in ins.srcs:
            if v.store.loads:
                self._settle_reads(v)
        spec = ins.spec
        if spec is _FIXPIPE or spec is _FIXPIPE_L1:
            scale = ins.p["scale"]
            if isinstance(scale, View) and scale.store.loads:
                self._settle_reads(scale)

    def _lend(self, ins: Instr, loan) -> None:
        """``ins`` reads ``loan`` later instead of now (``ins.result`` marks it)."""
        st = loan.store
        if st.lent is None:
            st.lent = set()
            self.lent_stores.add(st)
        st.lent.add(ins)
        self.n_lent += 1
        ins.loan = loan
        ins.result = _LENT

    def _stand_in(self, u):
        """What GM-bound copy out of tile view ``u`` should borrow: the GM bytes a lazy load into ``u`` stands for
        (a box of its source when ``u`` is a box of the load's tile, same dtype, the tile C-contiguous and shaped
        like the source), else ``u`` itself after the lazy loads it overlaps have copied."""
        lo, hi = u.lo, u.hi
        st = u.store
        for x in st.loads:                      # disjoint: a load settles those its tile overlaps (_execute)
            d = x.dsts[0]
            if not (d.lo < hi and lo < d.hi):
                continue
            if d.lo <= lo and hi <= d.hi and u.dtype == d.dtype and u.strides == d.strides and d.is_contiguous:
                s = x.loan
                if u.shape == d.shape:
                    if s.shape == d.shape:
                        return s
                elif s.shape == d.shape and len(u.shape) == len(d.shape):
                    rem = lo - d.lo
                    idx = []
                    for k in range(len(d.shape)):
                        i, rem = divmod(rem, d.strides[k])
                        if i + u.shape[k] > d.shape[k]:
                            break
                        idx.append(slice(i, i + u.shape[k]))
                    else:
                        if rem == 0:
                            return s[tuple(idx)]
            self._settle_reads(u)
            return u
        return u

    def _settle_reads(self, v) -> None:
        """View ``v`` is about to be read: lazy loads into it copy now."""
        lo, hi = v.lo, v.hi
        st = v.store
        loads = st.loads
        if not loads:
            return
        for x in [x for x in loads if x.dsts[0].lo < hi and lo < x.dsts[0].hi]:
            self._unlend(x)
            x.result = None
            x.spec.execute(x)                 # the copy (isa.ex_copy)

    def _drop_covered(self, v) -> None:
        """A load is about to write every byte of tile view ``v``: lazy loads into bytes of it are void."""
        st = v.store
        loads = st.loads
        if not loads:
            return
        lo, hi = v.lo, v.hi
        whole = v.is_contiguous
        for x in list(loads):
            d = x.dsts[0]
            if lo <= d.lo and d.hi <= hi and (whole or (lo == d.lo and hi == d.hi and v.shape == d.shape and
                                                        v.strides == d.strides)):
                self._unlend(x)
                x.result = None

    def _unlend_overlapping(self, v) -> None:
        """A write into view ``v`` is about to happen: transfers that lent a range of it sample it now, lazy loads
        into it or out of it copy now."""
        st = v.store
        lent = st.lent
        loads = st.loads
        if not lent and not loads:
            return
        lo, hi = v.lo, v.hi
        hit = [x for x in lent if x.loan.lo < hi and lo < x.loan.hi] if lent else []
        if loads:
            hit += [x for x in loads if x.dsts[0].lo < hi and lo < x.dsts[0].hi]
        for ins in hit:
            self._unlend(ins)
            if ins.spec is _LOAD:
                ins.result = None
            ins.spec.execute(ins)             # the sample (isa.ex_sample), a lazy load's copy (isa.ex_copy)

    def _unlend(self, ins: Instr) -> None:
        st = ins.loan.store
        st.lent.discard(ins)
        self.n_lent -= 1
        if not st.lent:
            st.lent = None
            if not st.loads:
                self.lent_stores.discard(st)
        if ins.spec is _LOAD:                 # also filed under its tile
            st = ins.dsts[0].store
            st.loads.discard(ins)
            if not st.loads:
                st.loads = None
                if not st.lent:
                    self.lent_stores.discard(st)

    def _settle_all(self) -> None:
        """The run is over: lazy loads still pending copy now (the tiles hold what the kernels loaded)."""
        for st in list(self.lent_stores):
            if st.loads:
                for x in list(st.loads):
                    self._unlend(x)
                    x.result = None
                    x.spec.execute(x)

    # ------------------------------------------------------------------ GM visibility and watchers
    def gm_written(self, store, lo: int, hi: int, writer=None) -> None:
        """A write to [lo, hi) of a GM store became visible now: complete the polls it satisfies (polls.py finds
        the ones it overlaps and checks each distinct poll once)."""
        if self.sanitizer is not None:
            self.sanitizer.landed(store, lo, hi, writer)
        if self.part is not None:       # what this worker ships back at the end (workers.py)
            self.part.written.add(store.uid)
        if store.uid not in self.polls.stores:      # no poll watches this store (a data landing): no call
            return
        done = self.polls.landed(store.uid, lo, hi, self._poll_ok)
        if done is None:
            return
        for ins in done:
            v = ins.srcs[0]
            t = self.now + ins.p["lat"]
            if self.trace is not None and writer is not None and writer.core is not None:
                fid = self._next_flow()
                wc = writer.core
                track = writer.spec.pipe if writer.spec.kind != SYNC else "SYNC"
                at = writer.busy_end if writer.busy_end > 0 else self.now
                self.trace.add_flow(fid, (wc.die, wc.unit, track, at),
                                    (ins.core.die, ins.core.unit, "WAIT", t), "flag")
            if ins.start <= 0:
                ins.start = self.now
            self._complete_from_afar(ins, t, np.array(v.arr, copy=True))

    @staticmethod
    def _poll_ok(ins: Instr) -> bool:
        p = ins.p
        word = p.get("word")
        if word is not None:                  # one integer word (isa.word_poll): Python ints, no ufunc
            return word[0](ins.srcs[0].arr.item(), word[1])
        hits = p["fn"](ins.srcs[0].arr, p["value"])
        if hits.size == 1:                    # a one-word flag: any and all agree, no reduction needed
            return bool(hits)
        return bool(hits.any() if p["how"] == "any" else hits.all())

    def host_write(self, view, values, t: int) -> None:
        """A host-side write to GM at simulated time ``t`` (e.g. the stop flag of a persistent kernel)."""
        def land(_):
            if self.n_lent:
                self._unlend_overlapping(view)
            if self.part is not None:
                self.part.writing(view)
            view.write(values)
            self.gm_written(view.store, view.lo, view.hi)
        self.push_host(max(t, self.now), land)

    # ------------------------------------------------------------------ sync instructions
    def _handle_sync(self, ins: Instr) -> None:
        if ins.core.killed:
            return
        if self.sanitizer is not None:
            self.sanitizer.sync(ins)
        handler = self._sync_handlers.get(ins.spec)
        if handler is None:
            handler = self._sync_handlers[ins.spec] = getattr(self, "_sync_" + ins.spec.name)
        handler(ins)

    def kill_die(self, die: int, t: int) -> list:
        """Fault injection at ``t``: every core of ``die`` stops for good (its queued and in-flight instructions are
        dropped, its waits released, its launches count it as finished); returns the killed cores."""
        killed = []
        self.dead_dies.add(die)
        for c in self.cores:
            if c.die == die and not c.done and not c.killed:
                c.killed = True
                c.blocked_on = None
                c.time = max(c.time, t)
                if c.gen is not None:
                    c.gen.close()
                killed.append(c)
        if self.part is not None:   # replicas of other workers' cores: what arrives from them is dropped
            for c in self.part.replicas:
                if c.die == die and not c.done:
                    c.killed = True
        self.polls.drop(_killed)
        for c in killed:
            c.done = True
            if self.on_core_done is not None:
                self.on_core_done(c)
        return killed

    def _sync_kernel_end(self, ins):
        self._complete_blocking(ins, self.now)

    def _sync_pipe_barrier(self, ins):
        self._complete_blocking(ins, self.now)

    def _sync_gm_load(self, ins):
        v = ins.srcs[0]
        _need_real(v, "gm_load")
        if v.store.die != ins.core.die:     # another die's word: read there, when the request arrives
            ins.start = self.now
            self.remote.load(ins)
            return
        self._complete_blocking(ins, self.now + ins.p["lat"], np.array(v.arr, copy=True))

    def _sync_gm_store(self, ins):
        ins.start = self.now
        ins.busy_end = self.now + ins.p["issue"]
        ins.end = self.now + ins.p["lat"]
        self._trace_scalar(ins)
        v = ins.dsts[0]
        _need_real(v, "gm_store")
        self.send(ins.end, v.store.die, self._store_landed, ins)
        if ins.end > self.last_activity:
            self.last_activity = ins.end
        self._scheduled(ins)
        if ins.waiters:
            self._release(ins)

    def _store_landed(self, ins):
        """A posted ``gm_store`` lands, on the die that owns its word."""
        v = ins.dsts[0]
        if self.n_lent:
            self._unlend_overlapping(v)
        if self.part is not None:
            self.part.writing(v)
        v.arr[...] = ins.p["value"]
        self.gm_written(v.store, v.lo, v.hi, ins)

    # an atomic acts at the die that owns its word half its round trip after the issue (``ins.start``); the old
    # value travels back the other half
    def _sync_atomic_add(self, ins):
        _need_real(ins.dsts[0], "atomic_add")
        ins.start = self.now
        self.send(self.now + ins.p["lat"] // 2, ins.dsts[0].store.die, self._add_landed, ins)

    def _add_landed(self, ins):
        v = ins.dsts[0]
        if self.n_lent:
            self._unlend_overlapping(v)
        if self.part is not None:
            self.part.writing(v)
        a = v.arr
        old = np.array(a, copy=True)
        a += np.asarray(ins.p["value"]).astype(a.dtype)
        self.gm_written(v.store, v.lo, v.hi, ins)
        self._complete_from_afar(ins, ins.start + ins.p["lat"], _scalar(old))

    def _sync_atomic_cas(self, ins):
        _need_real(ins.dsts[0], "atomic_cas")
        ins.start = self.now
        self.send(self.now + ins.p["lat"] // 2, ins.dsts[0].store.die, self._cas_landed, ins)

    def _cas_landed(self, ins):
        v = ins.dsts[0]
        a = v.arr
        old = _scalar(np.array(a, copy=True))
        if old == ins.p["expected"]:
            if self.n_lent:
                self._unlend_overlapping(v)
            if self.part is not None:
                self.part.writing(v)
            a[...] = ins.p["value"]
            self.gm_written(v.store, v.lo, v.hi, ins)
        self._complete_from_afar(ins, ins.start + ins.p["lat"], old)

    def _sync_wait_gm(self, ins):
        v = ins.srcs[0]
        _need_real(v, "wait_gm")
        ins.start = self.now
        if v.store.die != ins.core.die:     # another die's words: checked there, and bounded there
            self.remote.poll(ins)
            return
        if self._poll_ok(ins):
            self._complete_blocking(ins, self.now + ins.p["lat"], np.array(v.arr, copy=True))
            return
        self.polls.add(ins)
        timeout = ins.p.get("timeout_ps")
        if timeout is not None:
            self._add_timer(self.now + timeout, ins)

    def _sync_barrier(self, ins):
        core = ins.core
        launch = core.launch
        group = ins.p["group"]
        if group == "die" or launch.barrier_leader is None:
            key = (group, core.die) if group == "die" else group
            arrived = launch.barriers.setdefault(key, [])
            arrived.append(ins)
            if len(arrived) == launch.group_size(group, core.die):
                del launch.barriers[key]
                t = self.now + (launch.die_barrier_ps if group == "die" else launch.barrier_ps)
                for w in arrived:
                    self._complete_from_afar(w, t, None)
            return
        # over several chips: the arrival counts at its chip's leader die (same chip: same worker of a partitioned
        # run, at once); a chip whose cores have all arrived tells every chip's leader one fabric round trip later
        # (the only messages between workers: at least the look-ahead), and each leader releases its own chip's
        # cores a die barrier after the last chip's notice, ``barrier_ps`` after the last arrival
        self.send(self.now, launch.barrier_leader[core.die], self._barrier_arrived, ins)

    def _barrier_arrived(self, ins):
        """``ins`` (a barrier over several chips) arrives at its chip's leader die."""
        launch = ins.core.launch
        group = ins.p["group"]
        leader = self.home
        key = (group, leader)
        arrived = launch.barriers.setdefault(key, [])
        arrived.append(ins)
        if len(arrived) == launch.chip_group_size(group, leader):
            t = self.now + launch.barrier_trip_ps
            for other in launch.barrier_leaders:
                self.send(t, other, self._barrier_chip_done, (launch, group))

    def _barrier_chip_done(self, msg):
        """A chip's cores have all arrived at barrier ``group`` of ``launch``: at the last chip's notice this
        leader releases its chip's cores."""
        launch, group = msg
        leader = self.home
        key = (group, leader, "chips")
        n = launch.barriers.get(key, 0) + 1
        if n < len(launch.barrier_leaders):
            launch.barriers[key] = n
            return
        del launch.barriers[key]
        t = self.now + launch.die_barrier_ps
        for w in launch.barriers.pop((group, leader)):
            self._complete_from_afar(w, t, None)

    def _sync_cross_core_set(self, ins):
        core = ins.core
        ins.start = self.now
        ins.busy_end = ins.end = self.now
        self._trace_scalar(ins)
        t = self.now + ins.p["lat"]
        flag = ins.p["flag"]
        targets = core.launch.partners(core)
        if not targets:
            raise HazardError(f"cross_core_set flag {flag} from {core.where}: no paired core in this launch "
                              f"(launch a MIX kernel with aic and aiv cores)")

        def land(_):
            for tgt in targets:
                key = (flag, core.unit if tgt.kind == "aic" else None)
                n = tgt.xflags.get(key, 0) + 1
                if n > self.prof.cross_core_flag_max:
                    raise HazardError(
                        f"cross-core flag {flag} set {n} times by {core.where} toward {tgt.where} without a wait: "
                        f"the counter holds {self.prof.cross_core_flag_max}, real hardware hangs here")
                tgt.xflags[key] = n
                w = tgt.blocked_on
                # only a wait whose own time has come may consume the set; an issued-but-future wait
                # takes it when its handler runs
                if (w is not None and w.spec.name == "cross_core_wait" and w.p["flag"] == flag
                        and w.start >= 0 and w.end < 0):
                    self._try_xwait(w, ins)
        self.push(t, land, ins)
        self._scheduled(ins)
        if ins.waiters:
            self._release(ins)

    def _sync_cross_core_wait(self, ins):
        ins.start = self.now
        self._try_xwait(ins, None)

    def _try_xwait(self, ins, setter) -> None:
        if ins.end >= 0:
            return
        core = ins.core
        flag = ins.p["flag"]
        if core.kind == "aic":
            keys = [(flag, p.unit) for p in core.launch.partners(core)]
        else:
            keys = [(flag, None)]
        if all(core.xflags.get(k, 0) > 0 for k in keys):
            for k in keys:
                core.xflags[k] -= 1
            t = self.now + self.paths.prof.cycles_to_ps(self.prof.scalar_op_cycles)
            if self.trace is not None and setter is not None:
                sc = setter.core
                self.trace.add_flow(self._next_flow(), (sc.die, sc.unit, "SYNC", setter.start),
                                    (core.die, core.unit, "WAIT", t), "cross-core flag")
            self._complete_blocking(ins, t)

    def _trace_scalar(self, ins):
        if self.trace is not None:
            c = ins.core
            # instants on their own track: handlers run at arbitrary points and must not overlap pipe slices
            self._slice(c.die, c.unit, "SYNC", ins.spec.name, ins.start, ins.start, ins.origin)


# ---------------------------------------------------------------------------------------------- the event queue
class Event:
    """A queued event: ``fn(arg)`` (or an engine ``_EV_*`` event) at ``t`` ps on die ``die``'s state (``HOST`` or
    ``Engine.host_after``: the host's), ordered by the key (t, origin, count), unique per event (counts grow per
    origin). On ``Engine.timers`` a poll's bound: ``arg`` the poll, ``fn`` None. Compiled, its fields are C
    integers, so ordering two events takes no Python comparison and queueing one allocates no int objects."""

    __slots__ = ("t", "origin", "count", "die", "fn", "arg")

    def __getitem__(self, i):
        """The event read as the tuple (t, origin, count, die, fn, arg) (workers.py reads keys so)."""
        return (self.t, self.origin, self.count, self.die, self.fn, self.arg)[i]

    def __repr__(self):
        return f"Event(t={self.t}, origin={self.origin}, count={self.count}, die={self.die}, fn={self.fn!r})"


def _event(t: int, origin: int, count: int, die: int, fn, arg) -> Event:
    e = Event.__new__(Event)        # compiled: the type's tp_new, no arguments parsed
    e.t = t
    e.origin = origin
    e.count = count
    e.die = die
    e.fn = fn
    e.arg = arg
    return e


def queue(heap: list, t: int, origin: int, count: int, die: int, fn, arg) -> None:
    """Queue ``fn(arg)`` on ``heap`` under a key it already has (a message from another worker, messages.py);
    every other event enters through ``Engine.push`` / ``send`` / ``push_host``."""
    _heap_push(heap, _event(t, origin, count, die, fn, arg))


def _time_of(e: Event) -> int:
    return e.t


# ``heapq``'s push and pop, the same steps on the list of events, comparing their keys as C integers
def _before(a: Event, b: Event) -> bool:
    """Whether event (or timer) ``a`` comes before ``b``."""
    if a.t != b.t:
        return a.t < b.t
    if a.origin != b.origin:
        return a.origin < b.origin
    return a.count < b.count


def _heap_push(heap: list, item: Event) -> None:
    heap.append(item)
    _sift_down(heap, len(heap) - 1, item)


def _heap_pop(heap: list) -> Event:
    # the heap holds only Events (pushed by _heap_push): read back by unchecked casts in the build, where a typed
    # read would test each item's type
    last = cast(Event, heap.pop())
    if not heap:
        return last
    first = cast(Event, heap[0])
    end = len(heap)                 # heapq._siftup(heap, 0): the smaller child up to a leaf, then sift down
    pos = 0
    child = 1
    while child < end:
        right = child + 1
        if right < end and not _before(cast(Event, heap[child]), cast(Event, heap[right])):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    _sift_down(heap, pos, last)
    return first


def _sift_down(heap: list, pos: int, item: Event) -> None:
    """heapq._siftdown(heap, 0, pos): ``item`` goes in at ``pos`` and up while it comes before its parent."""
    while pos > 0:
        parent = (pos - 1) >> 1
        up = cast(Event, heap[parent])
        if not _before(item, up):
            break
        heap[pos] = up
        pos = parent
    heap[pos] = item


def _killed(ins: Instr) -> bool:
    return ins.core.killed


def _book(s, nbytes: int, flow: int, finish: int) -> int:
    """``nbytes`` pass server ``s`` once it is free (from ``flow`` on), at its bandwidth; returns the later of
    ``finish`` and the time they have passed."""
    occ = int(nbytes / s.bw)
    t = s.free if s.free > flow else flow
    s.free = t + occ
    s.busy_ps += occ
    s.bytes += nbytes
    if s.log is not None:       # tracing: the bandwidth counters are built from these
        s.log.append(_untracked_but((t, t + occ, nbytes), None))
    return t + occ if t + occ > finish else finish


def _untracked(record: tuple) -> tuple:
    """``record`` (a trace record or a server's log entry) taken off the cyclic GC's lists when nothing in it is
    tracked (ints, strings, a site's args dict of strings: the GC's own rule for tuples, which it applies only when a
    collection reaches them): a traced run makes one or two per instruction and keeps them, and the first collection
    after the run would walk every one (a sixth of the scheduler bench). Compiled only; as Python it is ``record``."""
    if _COMPILED:
        for x in record:
            if PyObject_GC_IsTracked(x):
                return record
        PyObject_GC_UnTrack(record)
    return record


def _untracked_but(record: tuple, x) -> tuple:
    """``_untracked(record)`` for a record whose items are ints and strings but for ``x`` (None: all of them): only
    ``x`` is checked (a trace record's args, once per instruction of a traced run)."""
    if _COMPILED and (x is None or not PyObject_GC_IsTracked(x)):
        PyObject_GC_UnTrack(record)
    return record


def _lends(ins: Instr) -> bool:
    """Whether GM-bound transfer ``ins`` can lend its source to its landing instead of sampling it at its start:
    the sampling copies (``OpSpec.lends``), and a fixpipe that lands its L0C tile as it is (isa.ex_fixpipe: int32 ->
    int32 without a scale, fp32 -> fp32 without a scale or ReLU), whose sample is a plain copy of the tile."""
    if ins.spec.lends:
        return True
    if ins.spec is not _FIXPIPE:
        return False
    p = ins.p
    if p["scale"] is not None:
        return False
    dt = ins.srcs[0].dtype
    if ins.dsts[0].dtype != dt:
        return False
    return dt == int32 or (dt == fp32 and not p["relu"])


def _need_real(v, op: str) -> None:
    if v.store.data is None:
        from .errors import AddressError
        raise AddressError(f"{op} on phantom {v.describe()}: flags, counters and other control data must be "
                           f"real (allocate them with phantom=False)")


def _scalar(a):
    a = np.asarray(a)
    return a.item() if a.size == 1 else a

