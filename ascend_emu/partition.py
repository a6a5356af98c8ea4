"""Which worker process runs which dies in a partitioned run, and how far the workers may run apart (DESIGN.md 10).

    parts = partition(prof, range(64), workers=3)          # whole chips, contiguous, balanced by dies
    parts = partition(prof, range(64), 3, weights=w)       # ... balanced by w[die], each die's estimated work
    parts = partition(prof, range(64), 3, weights=w, layout="interleaved")   # chips dealt out, what runs use
    parts.dies_of(1), parts.worker_of(17), lookahead_ps(prof, parts, jitter=0.3)

A worker owns whole chips (``unit="chip"``: the two dies of a package meet over the die-to-die link, whose latency
is the shortest in the pod) or whole servers (``unit="server"``: only inter-node traffic crosses workers). Everything
one worker does to another's dies travels over the fabric, so it takes effect no sooner than the fabric latency
between them after its cause: that is the look-ahead, how long a window of the conservative parallel simulation may
be. Seeded jitter can shorten a latency by its fraction, and the look-ahead with it.

A window ends when the slowest worker reaches it, so the run takes as long as its busiest worker: the dies are
split by their work, not their number. ``work_estimate`` (work.py) gives each die's work for a run. And since every
window waits for its slowest worker, the work must be even within each window, not only over the run: dies of one
role (attention, expert, a trampoline) sit next to each other and work in the same phases, so a contiguous split
that balances the totals can still give one worker a phase's whole work while the other waits (A2E at 160 x 288:
both workers waited a third of the run). ``layout="interleaved"`` deals the units out one at a time to the worker
with the least work so far, so neighbours of one role land on different workers and every phase is shared; it also
keeps a pair of roles that talk (an attention die and its trampoline) on one worker as often as on two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ArgumentError

UNITS = ("chip", "server")
LAYOUTS = ("contiguous", "interleaved")


@dataclass(frozen=True)
class Partitioning:
    """``owner``: {die: worker}; ``unit``: what a worker holds whole ("chip" or "server")."""
    workers: int
    unit: str
    owner: dict

    def worker_of(self, die: int) -> int:
        try:
            return self.owner[die]
        except KeyError:
            raise ArgumentError(f"die {die} is not in this partitioning (dies {min(self.owner)}.."
                                f"{max(self.owner)})") from None

    def dies_of(self, worker: int) -> list:
        if not 0 <= worker < self.workers:
            raise ArgumentError(f"worker={worker} out of range 0..{self.workers - 1}")
        return sorted(d for d, w in self.owner.items() if w == worker)


def partition(prof, dies, workers: int, unit: str = "chip", weights=None,
              layout: str = "contiguous") -> Partitioning:
    """Split ``dies`` (a count or the dies) over ``workers`` in whole ``unit``s, as even in work as whole units
    allow. ``layout="contiguous"``: in runs, a worker takes units until it holds its share of the total work and
    leaves at least one unit for each worker after it; ``"interleaved"``: each unit in turn goes to the worker with
    the least work so far (then the fewest units, then the lowest rank; see the module doc). ``weights``: each die's
    work (a sequence indexed by die, or {die: work}; >= 0, finite); None: one per die (an even split of the dies).
    A split where every weight is 0 is by dies."""
    if unit not in UNITS:
        raise ArgumentError(f"unit={unit!r}: use 'chip' or 'server'")
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout={layout!r}: use 'contiguous' or 'interleaved'")
    dies = sorted(set(range(dies) if isinstance(dies, int) else (int(d) for d in dies)))
    if not dies or dies[0] < 0 or dies[-1] >= prof.dies:
        raise ArgumentError(f"dies: give dies of the pod, 0..{prof.dies - 1}")
    key = prof.chip_of if unit == "chip" else prof.server_of
    groups: dict = {}
    for d in dies:
        groups.setdefault(key(d), []).append(d)
    units = list(groups.values())
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= len(units):
        raise ArgumentError(f"workers={workers!r}: use 1..{len(units)} (each worker runs at least one whole "
                            f"{unit}; these dies span {len(units)})")
    work = _unit_work(units, weights)
    if layout == "interleaved":
        return Partitioning(workers, unit, _dealt(units, work, workers))
    total = sum(work)
    slack = 1e-9 * total                    # sums of float work: a share reached up to rounding is reached
    owner, worker, done = {}, 0, 0.0
    for i, members in enumerate(units):
        if worker < workers - 1 and i > 0 and (done >= (worker + 1) * total / workers - slack
                                               or len(units) - i <= workers - 1 - worker):
            worker += 1
        for d in members:
            owner[d] = worker
        done += work[i]
    return Partitioning(workers, unit, owner)


def _dealt(units: list, work: list, workers: int) -> dict:
    """{die: worker}: each unit in order to the worker with the least work so far (then fewest units, lowest rank).
    The first ``workers`` units go to different workers (a worker with no unit has the least of both)."""
    load = [(0.0, 0, w) for w in range(workers)]
    owner = {}
    for members, w in zip(units, work):
        i = min(range(workers), key=load.__getitem__)
        done, count, rank = load[i]
        for d in members:
            owner[d] = rank
        load[i] = (done + w, count + 1, rank)
    return owner


def _unit_work(units: list, weights) -> list:
    """Each unit's work: the sum of its dies' ``weights`` (checked), or its die count."""
    if weights is None:
        return [float(len(members)) for members in units]
    if isinstance(weights, dict):
        lookup = weights.get
    else:
        weights = list(weights)
        lookup = (lambda d, default: weights[d] if d < len(weights) else default)
    work = []
    for members in units:
        total = 0.0
        for d in members:
            w = lookup(d, None)
            if w is None:
                raise ArgumentError(f"weights: no work given for die {d} (give one per die of the partition)")
            w = float(w)
            if not math.isfinite(w) or w < 0:
                raise ArgumentError(f"weights[{d}]={w!r}: a finite work >= 0")
            total += w
        work.append(total)
    if not any(work):
        return [float(len(members)) for members in units]
    return work


def lookahead_ps(prof, parts: Partitioning, jitter: float = 0.0) -> int:
    """The shortest time (ps) between a cause on one worker's dies and its effect on another's: the fabric latency
    between the closest pair of dies on different workers (plus the inter-node latency when no server holds dies
    of two workers), shortened by ``jitter``'s fraction. One worker has no peer: 0 (its windows are unbounded)."""
    if parts.workers == 1:
        return 0
    servers: dict = {}
    for die, worker in parts.owner.items():
        servers.setdefault(prof.server_of(die), set()).add(worker)
    shared = any(len(workers) > 1 for workers in servers.values())
    ns = prof.fabric_latency_ns + (0.0 if shared else prof.inter_node_latency_ns)
    return int(ns * 1000 * (1.0 - jitter))
