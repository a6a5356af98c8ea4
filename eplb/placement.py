"""Placement (DESIGN.md 7): which die's slot holds each replica.

Replicas go, by per-replica load descending, each onto the least-loaded die that has a free slot and no replica of
the same expert yet (never two replicas of one expert on a die). Replicas of a ``keep`` layout that the new counts
still need stay in their slots first (minimal churn for live reconfiguration). With several slots per die a swap
pass then lowers the hottest die while a swap with another die helps (greedy packing alone leaves a few percent).
"""
from __future__ import annotations

import numba
import numpy as np

from . import validate
from .errors import EplbError


@numba.njit(cache=True)
def _hosts(slot_expert, die, slots, e):
    for p in range(die * slots, (die + 1) * slots):
        if slot_expert[p] == e:
            return True
    return False


@numba.njit(cache=True)
def _place_layer(rep_load, counts, num_dies, slots, keep, refine, slot_expert):
    """rep_load [E] float64, counts [E] int64, keep [P] int64 (-1: none) -> slot_expert [P] (in place).
    Returns -1 on success, else the expert that found no die."""
    num_experts = counts.shape[0]
    die_load = np.zeros(num_dies)
    kept = np.zeros(num_experts, np.int64)
    fixed = np.zeros(num_dies * slots, np.bool_)
    slot_expert[:] = -1
    for p in range(num_dies * slots):
        e = keep[p]
        d = p // slots
        if e >= 0 and kept[e] < counts[e] and not _hosts(slot_expert, d, slots, e):
            slot_expert[p] = e
            kept[e] += 1
            fixed[p] = True
            die_load[d] += rep_load[e]
    order = np.argsort(-rep_load, kind="mergesort")
    for e in order:
        for _ in range(counts[e] - kept[e]):
            best = -1
            for d in range(num_dies):
                if best >= 0 and die_load[d] >= die_load[best]:
                    continue
                if _hosts(slot_expert, d, slots, e) or not _hosts(slot_expert, d, slots, -1):
                    continue
                best = d
            if best < 0:
                if not (_relocate(rep_load, e, num_dies, slots, fixed, die_load, slot_expert, False) or
                        _relocate(rep_load, e, num_dies, slots, fixed, die_load, slot_expert, True)):
                    return e
                continue
            for p in range(best * slots, (best + 1) * slots):
                if slot_expert[p] == -1:
                    slot_expert[p] = e
                    break
            die_load[best] += rep_load[e]
    if refine and slots > 1:
        _swap_pass(rep_load, num_dies, slots, fixed, die_load, slot_expert)
    return -1


@numba.njit(cache=True)
def _kept_elsewhere(slot_expert, fixed, f, q):
    for p in range(slot_expert.shape[0]):
        if p != q and fixed[p] and slot_expert[p] == f:
            return True
    return False


@numba.njit(cache=True)
def _relocate(rep_load, e, num_dies, slots, fixed, die_load, slot_expert, move_kept):
    """Every die with a free slot already hosts e: move some replica f from a full die without e into such a free
    slot (f not on that die yet) and put e where f was; a kept replica moves only with ``move_kept``. Returns
    False when no such move exists."""
    for p in range(num_dies * slots):
        if slot_expert[p] != -1:
            continue
        dfree = p // slots
        for q in range(num_dies * slots):
            f = slot_expert[q]
            d = q // slots
            if f < 0 or (fixed[q] and not move_kept) or d == dfree or _hosts(slot_expert, d, slots, e) or \
                    _hosts(slot_expert, dfree, slots, f):
                continue
            if fixed[q] and not _kept_elsewhere(slot_expert, fixed, f, q):
                continue                    # f's only kept slot: moving it would cost a reconfiguration round
            slot_expert[p] = f
            slot_expert[q] = e
            fixed[q] = False
            die_load[dfree] += rep_load[f]
            die_load[d] += rep_load[e] - rep_load[f]
            return True
    return False


@numba.njit(cache=True)
def _swap_pass(rep_load, num_dies, slots, fixed, die_load, slot_expert):
    """Swap a replica of the hottest die with one (or an empty slot) of another die while that lowers the max."""
    for _ in range(16 * num_dies):
        hot = 0
        for d in range(1, num_dies):
            if die_load[d] > die_load[hot]:
                hot = d
        top = die_load[hot]
        best_new = top * (1.0 - 1e-12)
        best_a = -1
        best_b = -1
        for a in range(hot * slots, (hot + 1) * slots):
            ea = slot_expert[a]
            if ea < 0 or fixed[a]:
                continue
            for d in range(num_dies):
                if d == hot or _hosts(slot_expert, d, slots, ea):
                    continue
                for b in range(d * slots, (d + 1) * slots):
                    eb = slot_expert[b]
                    if fixed[b]:
                        continue
                    lb = rep_load[eb] if eb >= 0 else 0.0
                    delta = rep_load[ea] - lb
                    if delta <= 0.0:
                        continue
                    new = max(top - delta, die_load[d] + delta)
                    if new < best_new and (eb < 0 or not _hosts(slot_expert, hot, slots, eb)):
                        best_new, best_a, best_b = new, a, b
        if best_a < 0:
            return
        ea = slot_expert[best_a]
        eb = slot_expert[best_b]
        lb = rep_load[eb] if eb >= 0 else 0.0
        delta = rep_load[ea] - lb
        slot_expert[best_a] = eb
        slot_expert[best_b] = ea
        die_load[hot] -= delta
        die_load[best_b // slots] += delta


@numba.njit(cache=True)
def _max_die(load, slot_expert, counts, num_dies, slots):
    top = 0.0
    hot = 0
    for d in range(num_dies):
        s = 0.0
        for p in range(d * slots, (d + 1) * slots):
            e = slot_expert[p]
            if e >= 0:
                s += load[e] / counts[e]
        if s > top:
            top, hot = s, d
    return top, hot


@numba.njit(cache=True)
def _move_replicas(load, counts, num_dies, slots, keep, slot_expert, max_moves):
    """Several slots per die: cardinality can defeat packing (e.g. 66 replicas of ~0.55 die-means on 64 dies).
    Move one replica from the expert whose merge costs least to an expert on the hottest die, re-place, keep the
    move while the hottest die gets cooler."""
    num_experts = counts.shape[0]
    rep = np.empty(num_experts)
    trial = np.empty_like(slot_expert)
    top, hot = _max_die(load, slot_expert, counts, num_dies, slots)
    for _ in range(max_moves):
        improved = False
        order = np.argsort(-load[slot_expert[hot * slots:(hot + 1) * slots]] /
                           counts[slot_expert[hot * slots:(hot + 1) * slots]], kind="mergesort")
        for i in order:
            e = slot_expert[hot * slots + i]
            if counts[e] >= num_dies:
                continue
            donor = -1
            cost = 0.0
            for a in range(num_experts):
                if a != e and counts[a] >= 2 and (donor < 0 or load[a] / (counts[a] - 1) < cost):
                    donor, cost = a, load[a] / (counts[a] - 1)
            if donor < 0 or cost >= top:
                continue
            counts[e] += 1
            counts[donor] -= 1
            for x in range(num_experts):
                rep[x] = load[x] / counts[x]
            if _place_layer(rep, counts, num_dies, slots, keep, True, trial) < 0:
                new, new_hot = _max_die(load, trial, counts, num_dies, slots)
                if new < top * (1.0 - 1e-9):
                    slot_expert[:] = trial
                    top, hot = new, new_hot
                    improved = True
                    break
            counts[e] -= 1
            counts[donor] += 1
        if not improved:
            return


@numba.njit(cache=True)
def _place_all(load, counts, num_dies, slots, keep, refine, max_moves, out):
    num_experts = counts.shape[1]
    rep = np.empty(num_experts)
    for layer in range(counts.shape[0]):
        for e in range(num_experts):
            rep[e] = load[layer, e] / counts[layer, e]
        bad = _place_layer(rep, counts[layer], num_dies, slots, keep[layer], refine, out[layer])
        if bad >= 0:        # the new counts do not fit around the kept replicas: place this layer afresh
            keep[layer, :] = -1
            bad = _place_layer(rep, counts[layer], num_dies, slots, keep[layer], refine, out[layer])
        if bad >= 0:
            return layer, bad
        if refine and slots > 1 and max_moves > 0:
            _move_replicas(load[layer], counts[layer], num_dies, slots, keep[layer], out[layer], max_moves)
    return -1, -1


def place(load: np.ndarray, counts: np.ndarray, num_dies: int, *, keep: np.ndarray | None = None,
          refine: bool = True, max_moves: int = 32) -> np.ndarray:
    """Put replicas in slots.

    load: [layers, experts] float, expert load (a replica carries load / count). counts: [layers, experts]
    int64, replicas per expert; every row sums to the slots P, a multiple of ``num_dies``. keep: [layers, P] int64
    expert per slot of a current layout (-1 = empty) whose still-needed replicas stay put (best effort: a layer whose
    new counts cannot fit around them is placed afresh). refine: the swap pass and,
    with several slots per die, up to ``max_moves`` replica moves between experts (counts may change; read them
    back from phy2log). Returns phy2log
    [layers, P] int64: slot p lives on die p // (P / num_dies).
    """
    load = validate.loads(load, "load")
    if load.shape[0] != 1:
        raise EplbError(f"load must be [layers, experts], got shape {load.shape[1:]} with {load.shape[0]} slices")
    load = load[0]
    num_dies = validate.positive(num_dies, "num_dies")
    max_moves = validate.integer(max_moves, "max_moves", low=0)
    if not isinstance(refine, (bool, np.bool_)):
        raise EplbError(f"refine={refine!r} must be a bool")
    counts = validate.int_array(counts, "counts", ndim=2, low=1)
    if counts.shape != load.shape:
        raise EplbError(f"counts has shape {counts.shape}, load has {load.shape}: one count per (layer, expert)")
    num_layers, num_experts = counts.shape
    total = int(counts[0].sum())
    if not (counts.sum(1) == total).all():
        raise EplbError("counts: every layer must have the same number of replicas")
    if total % num_dies:
        raise EplbError(f"{total} replicas do not fill {num_dies} dies evenly (num_replicas % num_gpus != 0)")
    slots = total // num_dies
    if (counts > num_dies).any():
        layer, e = np.argwhere(counts > num_dies)[0]
        raise EplbError(f"expert {e} of layer {layer} has {counts[layer, e]} replicas but there are only "
                        f"{num_dies} dies and a die holds at most one replica of an expert")
    if keep is None:
        keep = np.full((num_layers, total), -1, dtype=np.int64)
    # a copy: layers placed afresh get their row cleared
    keep = validate.layout(keep, "keep", num_experts=num_experts, num_layers=num_layers, num_slots=total).copy()
    out = np.empty((num_layers, total), dtype=np.int64)
    layer, bad = _place_all(np.ascontiguousarray(load, dtype=np.float64), counts, num_dies, slots, keep, refine,
                            max_moves, out)
    if layer >= 0:
        raise EplbError(f"layer {layer}: no die left with a free slot and no replica of expert {bad} "
                        f"({counts[layer, bad]} replicas over {num_dies} dies x {slots} slots)")
    return out
