"""Redundant-expert selection (DESIGN.md 7): how many replicas each logical expert gets.

The load of a layout is, per layer, the sum over time slices of the hottest replica's load, a replica carrying an
even share ``w[s, e] / count[e]`` of its expert's tokens (rotation makes the split even). Greedy: starting from one
replica per expert, repeatedly give one more replica to the candidate (the hottest expert of some slice) whose even
split lowers that sum the most, until the budget is used. With one slice this is the classic "split the current
maximum" greedy (DeepSeek's ``replicate_experts``), which is optimal for min-max with one replica per die.
"""
from __future__ import annotations

import numba
import numpy as np

from . import validate
from .errors import EplbError


@numba.njit(cache=True)
def _top2(w, c, top_v, top_i, sec_v):
    """Per slice: the largest and second-largest per-replica load w[s, e] / c[e] and the argmax (lowest id wins)."""
    num_slices, num_experts = w.shape
    for s in range(num_slices):
        v1 = -1.0
        i1 = -1
        v2 = -1.0
        for e in range(num_experts):
            v = w[s, e] / c[e]
            if v > v1:
                v2 = v1
                v1 = v
                i1 = e
            elif v > v2:
                v2 = v
        top_v[s] = v1
        top_i[s] = i1
        sec_v[s] = max(v2, 0.0)


@numba.njit(cache=True)
def _replicate_all(w, num_physical, max_count, counts):
    """w [slices, layers, experts] float64 -> counts [layers, experts] (in place: each row starts at its lower
    bounds and gets the replicas up to ``num_physical``)."""
    for layer in range(w.shape[1]):
        lower = counts[layer].copy()
        extra = num_physical - lower.sum()
        if not _replicate_layer(np.ascontiguousarray(w[:, layer]), extra, max_count, lower, counts[layer]):
            return False
    return True


@numba.njit(cache=True)
def _replicate_layer(w, extra, max_count, lower, c):
    """w [slices, experts] float64 -> c [experts] int64 (in place, starts at ``lower``); adds ``extra`` replicas
    and never takes an expert below its lower bound."""
    num_slices, num_experts = w.shape
    total = np.zeros(num_experts)
    for s in range(num_slices):
        for e in range(num_experts):
            total[e] += w[s, e]
    top_v = np.empty(num_slices)
    top_i = np.empty(num_slices, np.int64)
    sec_v = np.empty(num_slices)
    for _ in range(extra):
        _top2(w, c, top_v, top_i, sec_v)
        best = -1
        best_gain = 0.0
        best_share = -1.0
        for s in range(num_slices):
            e = top_i[s]
            if e < 0 or c[e] >= max_count[e]:
                continue
            gain = 0.0                      # drop of sum_s max_e w[s, e] / c[e] if e gets one more replica
            for t in range(num_slices):
                if top_i[t] == e:
                    gain += top_v[t] - max(sec_v[t], w[t, e] / (c[e] + 1))
            share = total[e] / c[e]
            if gain > best_gain or (gain == best_gain and best >= 0 and
                                    (share > best_share or (share == best_share and e < best))):
                best, best_gain, best_share = e, gain, share
        if best < 0:                        # no candidate lowers the objective (ties, caps): split the largest share
            for e in range(num_experts):
                if c[e] >= max_count[e]:
                    continue
                share = total[e] / c[e]
                if best < 0 or share > best_share or (share == best_share and c[e] < c[best]):
                    best, best_share = e, share
            if best < 0:
                return False
        c[best] += 1
    if num_slices > 1:
        _exchange(w, max_count, lower, c, top_v, top_i, sec_v, 4 * extra + 8)
    return True


@numba.njit(cache=True)
def _exchange(w, max_count, lower, c, top_v, top_i, sec_v, max_moves):
    """Greedy is myopic for a sum of maxima: move single replicas from a donor to a slice's hottest expert while
    that lowers sum_s max_e w[s, e] / c[e] (each candidate move is scored in O(slices) from the per-slice top two)."""
    num_slices, num_experts = w.shape
    for _ in range(max_moves):
        _top2(w, c, top_v, top_i, sec_v)
        best_gain = 1e-12 * top_v.sum()
        best_a = -1
        best_b = -1
        for s in range(num_slices):
            b = top_i[s]
            if b < 0 or c[b] >= max_count[b]:
                continue
            for a in range(num_experts):
                if a == b or c[a] <= lower[a]:
                    continue
                gain = 0.0
                for t in range(num_slices):
                    m = top_v[t]
                    if top_i[t] == b:
                        m = max(sec_v[t], w[t, b] / (c[b] + 1))
                    m = max(m, w[t, a] / (c[a] - 1))
                    gain += top_v[t] - m
                if gain > best_gain:
                    best_gain, best_a, best_b = gain, a, b
        if best_a < 0:
            return
        c[best_a] -= 1
        c[best_b] += 1


def replicate(w: np.ndarray, num_physical: int, max_count, *, lower=None) -> np.ndarray:
    """Replica counts for time-sliced loads.

    w: [slices, layers, experts] float, >= 0. num_physical: replicas per layer (>= experts). max_count: int or
    [experts] int, the most replicas one expert may get (the dies it may live on). lower: None (ones) or
    [layers, experts] int, the fewest replicas each expert keeps (``aggregate_floor``); rows must sum to at most
    ``num_physical``. Returns [layers, experts] int64, each >= its lower bound, each row summing to ``num_physical``.
    """
    w = validate.loads(w, "w")
    num_slices, num_layers, num_experts = w.shape
    num_physical = validate.positive(num_physical, "num_replicas")
    extra = num_physical - num_experts
    if extra < 0:
        raise EplbError(f"num_replicas={num_physical} is below the {num_experts} logical experts: every expert "
                        f"needs at least one physical slot")
    cap = validate.int_array(max_count, "max_count", ndim=(0, 1), low=1)
    if cap.ndim == 1 and cap.shape != (num_experts,):
        raise EplbError(f"max_count must be one int or [experts={num_experts}], got shape {cap.shape}")
    cap = np.broadcast_to(cap, (num_experts,)).copy()
    if int(cap.sum()) < num_physical:
        raise EplbError(f"num_replicas={num_physical} exceeds {int(cap.sum())}, the most replicas that fit with "
                        f"at most one replica of an expert per die")
    if lower is None:
        counts = np.ones((num_layers, num_experts), dtype=np.int64)
    else:
        counts = validate.int_array(lower, "lower", ndim=2, low=1)
        if counts.shape != (num_layers, num_experts) or (counts > cap).any() or (counts.sum(1) > num_physical).any():
            raise EplbError(f"lower must be [layers={num_layers}, experts={num_experts}] ints in 1..max_count with "
                            f"rows summing to at most num_replicas={num_physical}")
    wf = np.ascontiguousarray(w, dtype=np.float64)
    _replicate_all(wf, num_physical, cap, counts)
    return counts


def aggregate_floor(total: np.ndarray, num_physical: int, max_count, tolerance: float) -> np.ndarray:
    """[layers, experts] int64: the fewest replicas per expert that keep the hottest replica of the load summed over
    slices (``total`` [layers, experts]) within ``1 + tolerance`` of the best any allocation reaches (the
    one-slice greedy's, optimal for min-max). Rows sum to at most ``num_physical``: the greedy's own counts meet
    every floor. ``replicate(..., lower=floor)`` then spends the rest on the per-slice objective."""
    tolerance = validate.finite_float(tolerance, "tolerance", low=0.0)
    best = replicate(total[None], num_physical, max_count)
    top = (total / best).max(-1, keepdims=True)
    cap = top * (1.0 + tolerance)
    # the factor keeps a share that equals the cap (tolerance 0) from rounding up to one replica more
    floor = np.ceil(total / np.where(cap > 0, cap, 1.0) * (1.0 - 1e-12)).astype(np.int64)
    return np.clip(floor, 1, best)
