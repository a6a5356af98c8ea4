"""SPMD: run a per-rank script (one rank's view, as torch_npu scripts are written: one process per rank) for every
rank of an emulated pod, in one process.

    def step(rank):                                   # written for one rank
        y, scale = torch_npu.npu_dynamic_quant(x[rank])
        out = torch_npu.npu_moe_distribute_dispatch_v2(..., ep_rank_id=rank, ...)    # a collective
        return out
    results = ascend_emu.spmd(step, pod, world_size=4)     # [step(0), step(1), step(2), step(3)]

Each rank runs as a greenlet: a cooperative task on the one host thread, switched explicitly, never preempted.
Ranks take turns in a fixed order; a rank runs until it returns or reaches a collective step. Operators that
exchange data between ranks register that step as a ``Collective``: the rank parks there until every rank of its
group has reached the same step of that group, then the step runs once (on the pod, for the whole group) and each
rank resumes with its own share of the result, the woken ranks in group-rank order. The order depends on nothing
but the script, so results, modeled times and traces are deterministic.

Everything a rank does between collectives runs at once (operators on the rank's own die launch and finish before
the rank continues). A group that can never complete (a rank returned, or waits in another group, or reached a
different collective as the same step) raises ``DeadlockError`` / ``ArgumentError`` naming the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ArgumentError, DeadlockError


@dataclass(frozen=True)
class RankContext:
    """What a running rank knows: its rank, the world size, its die and the pod."""
    rank: int
    world_size: int
    die: int
    pod: object
    session: "Session" = field(repr=False, compare=False)


@dataclass
class _Rendezvous:
    """One step of one group: who has arrived with what."""
    name: str
    group: str
    step: int
    size: int
    arrivals: dict = field(default_factory=dict)          # group rank -> (spmd rank, payload)


class Collective:
    """A cross-rank step of an operator. ``run(arrivals)`` gets ``[(context, payload), ...]`` in group-rank order
    once the whole group has arrived and returns one result per group rank, in the same order."""

    def __init__(self, name: str, run):
        self.name = name
        self.run = run

    def __call__(self, payload, *, group: str, group_rank: int, group_size: int):
        """Arrive at this step as ``group_rank`` of ``group_size`` ranks of ``group``; return this rank's result."""
        ctx = current(self.name)
        return ctx.session.arrive(ctx, self, payload, str(group), group_rank, group_size)


_START = object()                                            # resume value of a rank that has not run yet
_ACTIVE: list = []                                           # the running session's context stack (innermost last)


def current(what: str = "this operator") -> RankContext:
    """The calling rank's context; raises ArgumentError outside ``spmd``."""
    session = _ACTIVE[-1] if _ACTIVE else None
    ctx = session.running_context() if session else None
    if ctx is None:
        raise ArgumentError(f"{what} runs across ranks: call it from a per-rank function run by "
                            f"ascend_emu.spmd(fn, pod, world_size)")
    return ctx


def in_spmd() -> bool:
    """True inside a rank of a running ``spmd``."""
    return bool(_ACTIVE) and _ACTIVE[-1].running_context() is not None


class Session:
    """One ``spmd`` run: the rank tasks, their turn order and the open rendezvous."""

    def __init__(self, pod, world_size: int, dies: list):
        self.pod = pod
        self.contexts = [RankContext(r, world_size, d, pod, self) for r, d in enumerate(dies)]
        self.tasks: list = []
        self.running: int | None = None
        self.ready: list = []                                # (rank, value to resume with)
        self.parked: dict = {}                               # rank -> _Rendezvous it waits in
        self.steps: dict = {}                                # (rank, group) -> collective calls made so far
        self.open: dict = {}                                 # (group, step) -> _Rendezvous

    def running_context(self) -> RankContext | None:
        return None if self.running is None else self.contexts[self.running]

    # ------------------------------------------------------------------ run
    def run(self, fn, args: tuple, kwargs: dict) -> list:
        from greenlet import GreenletExit, greenlet
        results: list = [None] * len(self.contexts)
        for ctx in self.contexts:
            def body(rank=ctx.rank):
                results[rank] = fn(rank, *args, **kwargs)
            self.tasks.append(greenlet(body))
        self.ready = [(r, _START) for r in range(len(self.contexts))]
        _ACTIVE.append(self)
        try:
            while self.ready:
                rank, value = self.ready.pop(0)
                self.running = rank
                try:
                    if value is _START:
                        self.tasks[rank].switch()
                    else:
                        self.tasks[rank].switch(value)
                except BaseException as e:
                    e.add_note(f"(raised in spmd rank {rank} of {len(self.contexts)}, die {self.contexts[rank].die})")
                    raise
                finally:
                    self.running = None
            if self.parked:
                raise self._deadlock()
            return results
        finally:
            _ACTIVE.pop()
            for task in self.tasks:                          # a failed run leaves no suspended rank behind
                if task and not task.dead:
                    task.throw(GreenletExit)

    # ------------------------------------------------------------------ collectives
    def arrive(self, ctx: RankContext, op: Collective, payload, group: str, group_rank, group_size):
        from greenlet import getcurrent
        if getcurrent() is not self.tasks[ctx.rank]:
            raise ArgumentError(f"{op.name}: called outside its rank's task (from a nested greenlet or thread)")
        for name, v, hi in (("group_size", group_size, len(self.contexts)), ("group_rank", group_rank, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and not 1 <= v <= hi):
                raise ArgumentError(f"{op.name}: {name}={v!r} must be an int"
                                    f"{f' in 1..{hi} (the spmd world size)' if hi else ' >= 0'}")
        if group_rank >= group_size:
            raise ArgumentError(f"{op.name}: group_rank={group_rank} out of range 0..{group_size - 1} "
                                f"(group {group!r} of {group_size} ranks)")
        step = self.steps.get((ctx.rank, group), 0)
        self.steps[(ctx.rank, group)] = step + 1
        rv = self.open.setdefault((group, step), _Rendezvous(op.name, group, step, group_size))
        if rv.name != op.name or rv.size != group_size:
            raise ArgumentError(f"spmd rank {ctx.rank} reached {op.name} (group size {group_size}) as step {step} of "
                                f"group {group!r}, where ranks {self._who(rv)} reached {rv.name} (group size "
                                f"{rv.size}): every rank of a group must make the same collective calls in order")
        if group_rank in rv.arrivals:
            raise ArgumentError(f"{op.name}: spmd ranks {rv.arrivals[group_rank][0]} and {ctx.rank} both claim "
                                f"group_rank={group_rank} of group {group!r}")
        rv.arrivals[group_rank] = (ctx.rank, payload)
        if len(rv.arrivals) == rv.size:
            del self.open[(group, step)]
            order = [rv.arrivals[g] for g in range(rv.size)]
            results = op.run([(self.contexts[r], p) for r, p in order])
            if len(results) != rv.size:
                raise ArgumentError(f"{op.name}: its step returned {len(results)} results for {rv.size} ranks")
            for (r, _), res in zip(order, results):
                self.parked.pop(r, None)
                self.ready.append((r, res))
        else:
            self.parked[ctx.rank] = rv
        return self.tasks[ctx.rank].parent.switch()        # back to the scheduler; resumes with this rank's result

    def _who(self, rv: _Rendezvous) -> list:
        return sorted(r for r, _ in rv.arrivals.values())

    def _deadlock(self) -> DeadlockError:
        lines = []
        for rank, rv in sorted(self.parked.items()):
            missing = sorted(set(range(rv.size)) - set(rv.arrivals))
            lines.append(f"spmd rank {rank} waits in {rv.name} (step {rv.step} of group {rv.group!r}) for group "
                         f"ranks {missing}")
        done = [r for r, t in enumerate(self.tasks) if t.dead]
        return DeadlockError(f"spmd: {len(self.parked)} ranks wait in collectives that can never complete (ranks "
                             f"{done} have returned):\n" + "\n".join(lines), lines)


def spmd(fn, pod, world_size: int, *, dies=None, args: tuple = (), kwargs: dict | None = None) -> list:
    """Run ``fn(rank, *args, **kwargs)`` for rank 0..world_size-1 as cooperative tasks on ``pod`` and return their
    results in rank order. Rank r runs on die ``dies[r]`` (default r). See the module docstring."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world_size={world_size!r} must be a positive int")
    dies = list(range(world_size)) if dies is None else [pod._check_die(d) for d in dies]
    if len(dies) != world_size:
        raise ArgumentError(f"dies: {len(dies)} dies for world_size={world_size}")
    if len(set(dies)) != len(dies):
        raise ArgumentError(f"dies={dies}: each rank needs its own die")
    for d in dies:
        pod._check_die(d)
    return Session(pod, world_size, dies).run(fn, tuple(args), dict(kwargs or {}))
