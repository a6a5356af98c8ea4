"""Which worker process runs which dies in a partitioned run, and how far the workers may run apart (DESIGN.md 10).

    parts = partition(prof, range(64), workers=3)          # whole chips, contiguous, balanced by dies
    parts.dies_of(1), parts.worker_of(17), lookahead_ps(prof, parts, jitter=0.3)

A worker owns whole chips (``unit="chip"``: the two dies of a package meet over the die-to-die link, whose latency
is the shortest in the pod) or whole servers (``unit="server"``: only inter-node traffic crosses workers). Everything
one worker does to another's dies travels over the fabric, so it takes effect no sooner than the fabric latency
between them after its cause: that is the look-ahead, how long a window of the conservative parallel simulation may
be. Seeded jitter can shorten a latency by its fraction, and the look-ahead with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ArgumentError

UNITS = ("chip", "server")


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


def partition(prof, dies, workers: int, unit: str = "chip") -> Partitioning:
    """Split ``dies`` (a count or the dies) over ``workers`` in contiguous runs of whole ``unit``s, as even in dies
    as whole units allow: a worker takes units until it holds its share of the dies, and leaves at least one unit
    for each worker after it."""
    if unit not in UNITS:
        raise ArgumentError(f"unit={unit!r}: use 'chip' or 'server'")
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
    owner, worker, done = {}, 0, 0
    for i, members in enumerate(units):
        if worker < workers - 1 and i > 0 and (done >= (worker + 1) * len(dies) / workers
                                               or len(units) - i <= workers - 1 - worker):
            worker += 1
        for d in members:
            owner[d] = worker
        done += len(members)
    return Partitioning(workers, unit, owner)


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
