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
from . import validate
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
    old = validate.layout(old, "old")
    new = validate.layout(new, "new")
    if old.shape != new.shape:
        raise EplbError(f"old {old.shape} and new {new.shape} must both be [layers, physical_slots]")
    num_layers, num_slots = old.shape
    ids, (old, new) = _dense(old, new)
    num_experts = max(len(ids), 1)
    had, has = _replica_counts(old, new)
    lost = (had > 0) & (has == 0)
    if lost.any():
        layer, e = np.argwhere(lost)[0]
        raise EplbError(f"new has no replica of expert {ids[e]} of layer {layer}, which old holds: every expert must "
                        f"stay routable")
    cur = old.copy().reshape(-1)
    target = new.reshape(-1)
    pending = [int(i) for i in np.flatnonzero(cur != target)]
    rounds = []
    while pending:
        if len(rounds) > 2 * len(target):           # each round settles a slot or frees a spare for one
            raise EplbError(f"plan_rounds made no progress after {len(rounds)} rounds (old -> new of shape "
                            f"{old.shape})")
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
            first, take, vals = _spare(cur, target, rest, live, num_slots, ids)
            rest = rest + take
        vals = np.array(vals, dtype=np.int64)
        rounds.append((np.array(take, dtype=np.int64), _sparse(ids, vals)))
        cur[take] = vals
        pending = first + sorted(set(i for i in rest if cur[i] != target[i]) - set(first))
    return rounds


def _dense(*layouts):
    """(ids, layouts with expert ids renumbered 0..n-1 in id order, -1 kept): planning only compares ids, and a
    sparse id (say 10**9) must not size an array."""
    ids = np.unique(np.concatenate([np.ravel(a) for a in layouts]))
    ids = ids[ids >= 0]
    return ids, [np.where(a >= 0, np.searchsorted(ids, a), -1) for a in layouts]


def _sparse(ids, dense):
    return np.where(dense >= 0, ids[np.maximum(dense, 0)] if len(ids) else -1, -1).astype(np.int64)


def _replica_counts(*layouts):
    """[layers, n] replicas of each expert in each layout, over the experts any of them holds (renumbered)."""
    ids, dense = _dense(*layouts)
    return [inverse_map(a, max(len(ids), 1))[1] for a in dense]


def _spare(cur, target, stuck, live, num_slots, ids):
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
    raise EplbError(f"no safe order: layer {layer} slot {slot} holds the only replica of expert "
                    f"{_sparse(ids, cur[stuck[0]])} and must become expert {_sparse(ids, target[stuck[0]])}, in a "
                    f"cycle of {len(stuck)} slots with no spare slot")


class LiveReconfig:
    """Drive old -> new in four-phase rounds over decode steps. ``run(prefetch_steps, load_steps)`` takes the DMA
    duration (in whole steps, >= 1) of each (round, slot) job's prefetch and load, in the order of ``changed``
    (a spare slot appears twice)."""

    def __init__(self, old, new):
        self.rounds = plan_rounds(old, new)
        self.old = validate.layout(old, "old")
        self.new = validate.layout(new, "new")
        self.changed = np.concatenate([r[0] for r in self.rounds]) if self.rounds else np.zeros(0, dtype=np.int64)

    def run(self, prefetch_steps, load_steps, *, serve_before: int = 1, serve_after: int = 1) -> ReconfigResult:
        serve_before = validate.integer(serve_before, "serve_before", low=0)
        serve_after = validate.integer(serve_after, "serve_after", low=0)
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
        d = validate.int_array(d, name, ndim=(0, 1))
        if d.ndim == 1 and d.shape != self.changed.shape:
            raise EplbError(f"{name} must be one int or one per changed slot ({len(self.changed)}), got {d.shape}")
        d = np.broadcast_to(d, self.changed.shape)
        if d.size and d.min() < 1:
            raise EplbError(f"{name} must be >= 1 step each (a DMA ends at a later step boundary), got {d.min()}")
        return d

    def _check_routable(self, mapping, r):
        ids, _ = _dense(self.old, self.new)
        cnt, have = _replica_counts(mapping, self.old, self.new)[:2]
        if ((cnt == 0) & (have > 0)).any():
            layer, e = np.argwhere((cnt == 0) & (have > 0))[0]
            raise EplbError(f"round {r}: disabling its slots leaves expert {ids[e]} of layer {layer} without a "
                            f"replica")


def check_no_unloaded_routes(result: ReconfigResult) -> None:
    """Raise EplbError if any step's mapping routes to a slot that does not hold the mapped expert for the whole
    step, or leaves an expert of the old layout without a replica."""
    if not result.steps:
        return
    ids, _ = _dense(*(r.mapping for r in result.steps))
    counts = _replica_counts(*(r.mapping for r in result.steps))
    need = counts[0] > 0
    for rec, cnt in zip(result.steps, counts):
        missing = need & (cnt == 0)
        if missing.any():
            layer, e = np.argwhere(missing)[0]
            e = ids[e]
            raise EplbError(f"step {rec.step} ({rec.phase}): expert {e} of layer {layer} has no enabled replica")
        on = rec.mapping >= 0
        bad = on & (rec.holds != rec.mapping)
        if bad.any():
            layer, slot = np.argwhere(bad)[0]
            raise EplbError(f"step {rec.step} ({rec.phase}): layer {layer} slot {slot} is routed to expert "
                            f"{rec.mapping[layer, slot]} but holds {rec.holds[layer, slot]}")
