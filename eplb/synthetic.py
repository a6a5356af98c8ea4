"""Synthetic expert loads for tests, benches and the CLI: skewed (lognormal, Zipf) and drifting over time slices."""
from __future__ import annotations

import numpy as np

from . import validate
from .errors import EplbError

KINDS = ("lognormal", "zipf")


def _shape(kind, num_experts, rng):
    if kind == "lognormal":
        return rng.lognormal(0.0, 1.7, num_experts)            # P(x > mean) = P(Z > 0.85) ~ 20 %
    if kind == "zipf":
        v = (np.arange(num_experts) + 1.0) ** -0.7             # ~23 % of ranks above the mean
        return v[rng.permutation(num_experts)] * rng.uniform(0.9, 1.1, num_experts)
    raise EplbError(f"kind={kind!r}: use one of {KINDS}")


def _set_hottest(v, hot_ratio):
    """Set the hottest expert to hot_ratio x the mean load; the others stay below 0.7 x its load."""
    n = len(v)
    i = int(np.argmax(v))
    for _ in range(20):
        rest = v.sum() - v[i]
        v[i] = hot_ratio * rest / (n - hot_ratio)
        others = np.delete(np.arange(n), i)
        if v[others].max() <= 0.7 * v[i]:
            break
        v[others] = np.minimum(v[others], 0.7 * v[i])
    return v


def skewed_load(num_layers: int = 58, num_experts: int = 256, kind: str = "lognormal", hot_ratio: float = 30.0,
                tokens_per_layer: float = 8 * 65536, seed: int = 0) -> np.ndarray:
    """[layers, experts] float64 expected tokens per expert: the hottest expert ~hot_ratio x the mean, ~20 % of
    experts above the mean, a fresh permutation per layer. Each row sums to ``tokens_per_layer``."""
    num_layers = validate.positive(num_layers, "num_layers")
    num_experts = validate.positive(num_experts, "num_experts")
    hot_ratio = validate.finite_float(hot_ratio, "hot_ratio")
    validate.finite_float(tokens_per_layer, "tokens_per_layer", low=0.0)
    if not 1 < hot_ratio < num_experts:
        raise EplbError(f"hot_ratio={hot_ratio} must lie in (1, num_experts={num_experts})")
    rng = np.random.default_rng(seed)
    w = np.stack([_set_hottest(_shape(kind, num_experts, rng), hot_ratio) for _ in range(num_layers)])
    return w * (tokens_per_layer / w.sum(1, keepdims=True))


def drifting_load(num_slices: int = 8, num_layers: int = 58, num_experts: int = 256, kind: str = "lognormal",
                  hot_ratio: float = 30.0, drift: float = 1.0, tokens_per_slice: float = 65536,
                  seed: int = 0) -> np.ndarray:
    """[slices, layers, experts] float64: a skewed load whose hot spots wander. Each expert's log-popularity takes a
    Gaussian random walk over the slices, ``drift`` its standard deviation after the last slice, so the summed load
    hides per-slice peaks that a static balancer does not split. Each slice of a layer sums to tokens_per_slice."""
    num_slices = validate.positive(num_slices, "num_slices")
    drift = validate.finite_float(drift, "drift", low=0.0)
    validate.finite_float(tokens_per_slice, "tokens_per_slice", low=0.0)
    rng = np.random.default_rng(seed + 1)
    base = skewed_load(num_layers, num_experts, kind, hot_ratio, 1.0, seed)
    steps = rng.standard_normal((num_slices, num_layers, num_experts)) * (drift / np.sqrt(max(num_slices - 1, 1)))
    steps[0] = 0.0
    w = base[None] * np.exp(np.cumsum(steps, 0))
    return w * (tokens_per_slice / w.sum(-1, keepdims=True))


def hopping_load(num_slices: int = 16, num_layers: int = 58, num_experts: int = 256, kind: str = "lognormal",
                 hot_ratio: float = 30.0, tokens_per_slice: float = 65536, seed: int = 0) -> np.ndarray:
    """[slices, layers, experts] float64: every slice a skewed load (the hottest expert ``hot_ratio`` x the mean, as
    ``skewed_load``) on a fresh permutation of the experts, so the hot experts move every slice while the summed
    load stays mild (the hard case for a balancer that sees only the sum, or only the slices). Each slice of a layer
    sums to ``tokens_per_slice``."""
    for name, v in (("num_slices", num_slices), ("num_layers", num_layers), ("num_experts", num_experts)):
        validate.positive(v, name)
    validate.finite_float(tokens_per_slice, "tokens_per_slice", low=0.0)
    rng = np.random.default_rng(seed)
    profile = skewed_load(num_layers, num_experts, kind, hot_ratio, 1.0, seed)
    perms = np.argsort(rng.random((num_slices, num_layers, num_experts)), axis=-1)
    w = np.take_along_axis(np.broadcast_to(profile, perms.shape), perms, -1)
    return w * tokens_per_slice
