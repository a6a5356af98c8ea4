"""Live reconfiguration (DESIGN.md 7): move from one layout to another while decoding, in rounds of four phases.

1. prefetch: DMA the new experts' weights into a staging buffer on each target die; the slots keep serving.
2. disable: publish a mapping without the round's slots (takes effect at the next step boundary).
3. load: copy staging -> slot; the slot is being overwritten and no token may reach it.
4. enable: publish the mapping with the round's slots holding their new experts.

A round may only disable a slot whose current expert keeps another enabled replica, so every expert stays
routable. Layouts made with ``rebalance_experts(..., previous=old)`` on one slot per die keep an old slot of every
expert and need one round; otherwise a slot waits for a later round, and a cycle of single replicas (A's only slot
must become B's while B's only slot must become A's) goes through a spare slot (one whose expert has another
replica) for a round; with no spare slot at all it raises.

Time is counted in decode steps: mappings switch only between steps, a DMA of ``d`` steps started at a boundary
ends ``d`` boundaries later. ``LiveReconfig.run`` records, for every step, the mapping in force and what each slot
holds for the whole step, so an independent checker can verify no token ever reaches an unloaded slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .api import inverse_map
from .errors import EplbError

PHASES = ("prefetch", "disable", "load", "enable")


@dataclass
class StepRecord:
    """One decode step: ``mapping`` [layers, P] routes tokens (-1 = slot disabled), ``holds`` [layers, P] the expert
    whose weights a slot holds during the whole step (-1 = being overwritten), ``phase`` the reconfiguration phase
    running (or "serve")."""
    step: int
    phase: str
    round: int
    mapping: np.ndarray
    holds: np.ndarray


@dataclass
class ReconfigResult:
    steps: list = field(default_factory=list)
    rounds: list = field(default_factory=list)           # per round: (flat slot ids layer * P + slot, experts)
    final: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def plan_rounds(old, new) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split old -> new ([layers, P] phy2log, -1 = empty) into rounds: (flat slot ids, expert loaded into each).
    A round's slots can be disabled together while every expert keeps an enabled replica. A cycle of single
    replicas is broken through a spare slot: a slot whose expert has another replica temporarily takes one
    expert of the cycle and gets its own target in a later round."""
    old = np.asarray(old, dtype=np.int64)
    new = np.asarray(new, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 2:
        raise EplbError(f"old {old.shape} and new {new.shape} must both be [layers, physical_slots]")
    num_layers, num_slots = old.shape
    num_experts = int(max(old.max(), new.max())) + 1
    cur = old.copy().reshape(-1)
    target = new.reshape(-1)
    pending = [int(i) for i in np.flatnonzero(cur != target)]
    rounds = []
    while pending:
        _, live = inverse_map(cur.reshape(old.shape), num_experts)
        take, rest = [], []
        for i in pending:
            layer, e = i // num_slots, cur[i]
            if e < 0 or live[layer, e] >= 2:
                take.append(i)
                if e >= 0:
                    live[layer, e] -= 1
            else:
                rest.append(i)
        first = []
        if take:
            vals = target[take]
        else:
            first, take, vals = _spare(cur, target, rest, live, num_slots)
            rest = rest + take
        rounds.append((np.array(take, dtype=np.int64), np.array(vals, dtype=np.int64)))
        cur[take] = vals
        pending = first + sorted(set(i for i in rest if cur[i] != target[i]) - set(first))
    return rounds


def _spare(cur, target, stuck, live, num_slots):
    """Break a cycle: load the expert of a stuck slot into a slot (same layer, not stuck) whose expert has another
    replica, so the stuck slot can change next round."""
    for i in stuck:
        layer, e = i // num_slots, cur[i]
        lo = layer * num_slots
        for t in range(lo, lo + num_slots):
            x = cur[t]
            if t != i and t not in stuck and x >= 0 and live[layer, x] >= 2 and x != e:
                return [i], [t], [e]            # i goes first next round, before t reclaims e
    layer, slot = divmod(stuck[0], num_slots)
    raise EplbError(f"no safe order: layer {layer} slot {slot} holds the only replica of expert {cur[stuck[0]]} and "
                    f"must become expert {target[stuck[0]]}, in a cycle of {len(stuck)} slots with no spare slot")


class LiveReconfig:
    """Drive old -> new in four-phase rounds over decode steps. ``run(prefetch_steps, load_steps)`` takes the DMA
    duration (in whole steps, >= 1) of each (round, slot) job's prefetch and load, in the order of ``changed``
    (a spare slot appears twice)."""

    def __init__(self, old, new):
        self.old = np.asarray(old, dtype=np.int64)
        self.new = np.asarray(new, dtype=np.int64)
        self.rounds = plan_rounds(self.old, self.new)
        self.changed = np.concatenate([r[0] for r in self.rounds]) if self.rounds else np.zeros(0, dtype=np.int64)

    def run(self, prefetch_steps, load_steps, *, serve_before: int = 1, serve_after: int = 1) -> ReconfigResult:
        pf = self._durations(prefetch_steps, "prefetch_steps")
        ld = self._durations(load_steps, "load_steps")
        res = ReconfigResult(rounds=list(self.rounds))
        mapping = self.old.copy()
        holds = self.old.copy()
        t = 0

        def serve(n, phase, r, busy=None):
            nonlocal t
            for k in range(n):
                h = holds.copy()
                if busy is not None:
                    flat = h.reshape(-1)
                    for s, end in busy:
                        if t + k < end:
                            flat[s] = -1
                res.steps.append(StepRecord(t + k, phase, r, mapping.copy(), h))
            t += n

        serve(serve_before, "serve", -1)
        job = 0
        for r, (slots, experts) in enumerate(self.rounds):
            idx = np.arange(job, job + len(slots))
            job += len(slots)
            # 1. prefetch into staging: slots keep serving their old expert
            serve(int(pf[idx].max()), "prefetch", r)
            # 2. disable at this boundary: every expert keeps an enabled replica (plan_rounds)
            mapping.reshape(-1)[slots] = -1
            self._check_routable(mapping, r)
            # 3. load staging -> slot, slot by slot: a slot holds nothing usable until its copy ends
            ends = [(int(s), t + int(d)) for s, d in zip(slots, ld[idx])]
            serve(max(e for _, e in ends) - t, "load", r, busy=ends)
            holds.reshape(-1)[slots] = experts
            # 4. enable at the next boundary
            mapping.reshape(-1)[slots] = experts
        serve(serve_after, "serve", len(self.rounds))
        res.final = mapping.copy()
        return res

    def _durations(self, d, name):
        d = np.broadcast_to(np.asarray(d, dtype=np.int64), self.changed.shape)
        if d.size and d.min() < 1:
            raise EplbError(f"{name} must be >= 1 step each (a DMA ends at a later step boundary), got {d.min()}")
        return d

    def _check_routable(self, mapping, r):
        num_experts = int(max(self.old.max(), self.new.max())) + 1
        _, cnt = inverse_map(mapping, num_experts)
        present = np.zeros_like(cnt, dtype=bool)
        _, have = inverse_map(self.old, num_experts)
        present |= have > 0
        if ((cnt == 0) & present).any():
            layer, e = np.argwhere((cnt == 0) & present)[0]
            raise EplbError(f"round {r}: disabling its slots leaves expert {e} of layer {layer} without a replica")


def check_no_unloaded_routes(result: ReconfigResult) -> None:
    """Raise EplbError if any step's mapping routes to a slot that does not hold the mapped expert for the whole
    step, or leaves an expert of the old layout without a replica."""
    if not result.steps:
        return
    num_experts = int(max(r.mapping.max() for r in result.steps)) + 1
    need = inverse_map(result.steps[0].mapping, num_experts)[1] > 0
    for rec in result.steps:
        missing = need & (inverse_map(rec.mapping, num_experts)[1] == 0)
        if missing.any():
            layer, e = np.argwhere(missing)[0]
            raise EplbError(f"step {rec.step} ({rec.phase}): expert {e} of layer {layer} has no enabled replica")
        on = rec.mapping >= 0
        bad = on & (rec.holds != rec.mapping)
        if bad.any():
            layer, slot = np.argwhere(bad)[0]
            raise EplbError(f"step {rec.step} ({rec.phase}): layer {layer} slot {slot} is routed to expert "
                            f"{rec.mapping[layer, slot]} but holds {rec.holds[layer, slot]}")
