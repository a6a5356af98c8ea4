"""Load collection: tokens per (die, layer, expert, time slice), counted right after gating.

    col = LoadCollector(num_layers=58, num_experts=256, num_dies=16, window=8)
    col.record(topk_ids, layer=3, die=rank)      # every step, right after gating: one bincount
    col.advance()                                 # at each time-slice boundary
    loads = col.loads()                           # [slices, layers, experts], summed over the DP group's dies

The counter is a ring of ``window`` slices of int64 counts [window, dies, layers, experts]; ``record`` costs one
bincount per call. ``loads`` returns the window oldest slice first (the current, still-filling
slice last), which is the input ``rebalance_experts`` takes.
"""
from __future__ import annotations

import numpy as np

from . import validate
from .errors import EplbError


class LoadCollector:
    """Per-die expert load counters over a sliding window of time slices."""

    def __init__(self, num_layers: int, num_experts: int, num_dies: int = 1, window: int = 1):
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("num_dies", num_dies),
                        ("window", window)):
            validate.positive(v, name)
        self.num_layers, self.num_experts, self.num_dies, self.window = num_layers, num_experts, num_dies, window
        self.counts = np.zeros((window, num_dies, num_layers, num_experts), dtype=np.int64)
        self.slice = 0            # slices completed so far; the current one is counts[slice % window]

    def record(self, topk_ids, layer: int | None = None, die: int = 0) -> None:
        """Count one gating output. topk_ids: [tokens, k] for ``layer``, or [layers, tokens, k] with layer=None;
        ids < 0 (dropped or padding tokens) are skipped."""
        ids = validate.int_array(topk_ids, "topk_ids")
        die = validate.integer(die, "die", low=0, high=self.num_dies - 1)
        cur = self.counts[self.slice % self.window, die]
        if layer is None:
            if ids.ndim < 2 or ids.shape[0] != self.num_layers:
                raise EplbError(f"topk_ids must be [layers={self.num_layers}, tokens, k] when layer is None, "
                                f"got {ids.shape}")
            flat = ids.reshape(self.num_layers, -1).astype(np.int64)
            self._check(flat)
            keyed = flat + (np.arange(self.num_layers) * self.num_experts)[:, None]
            keyed = keyed[flat >= 0]
            cur += np.bincount(keyed, minlength=self.num_layers * self.num_experts).reshape(cur.shape)
            return
        layer = validate.integer(layer, "layer", low=0, high=self.num_layers - 1)
        flat = ids.reshape(-1).astype(np.int64)
        self._check(flat)
        cur[layer] += np.bincount(flat[flat >= 0], minlength=self.num_experts)

    def add_counts(self, counts, die: int = 0) -> None:
        """Add ready-made counts [layers, experts] (e.g. a Collect kernel's GM buffer) to the current slice."""
        c = validate.int_array(counts, "counts", ndim=2, low=0)
        die = validate.integer(die, "die", low=0, high=self.num_dies - 1)
        if c.shape != (self.num_layers, self.num_experts):
            raise EplbError(f"counts must be [layers={self.num_layers}, experts={self.num_experts}], got {c.shape}")
        self.counts[self.slice % self.window, die] += c

    def _check(self, flat):
        if flat.size and flat.max() >= self.num_experts:
            raise EplbError(f"topk_ids holds expert {flat.max()} >= num_experts={self.num_experts}")

    def advance(self) -> None:
        """Close the current time slice; the oldest slice of the window is cleared for reuse."""
        self.slice += 1
        self.counts[self.slice % self.window] = 0

    def loads(self, dies=None) -> np.ndarray:
        """[slices, layers, experts] int64 over the window (oldest first; at most ``slice + 1`` slices), summed over
        ``dies`` (default: all, i.e. the DP group)."""
        n = min(self.slice + 1, self.window)
        order = [(self.slice - n + 1 + i) % self.window for i in range(n)]
        sel = slice(None) if dies is None else \
            validate.int_array(dies, "dies", ndim=1, low=0, high=self.num_dies - 1).tolist()
        return self.counts[order][:, sel].sum(1)

    def total(self, dies=None) -> np.ndarray:
        """[layers, experts] int64: the window summed over time (static loads)."""
        return self.loads(dies).sum(0)

    @staticmethod
    def merge(collectors) -> "LoadCollector":
        """Sum collectors of the same shape and slice (e.g. one per DP group) into a new one (an all-reduce)."""
        cs = list(collectors)
        if not cs:
            raise EplbError("merge needs at least one collector")
        a = cs[0]
        for c in cs[1:]:
            if c.counts.shape != a.counts.shape or c.slice != a.slice:
                raise EplbError(f"cannot merge collectors of shapes {a.counts.shape}@{a.slice} and "
                                f"{c.counts.shape}@{c.slice}")
        out = LoadCollector(a.num_layers, a.num_experts, a.num_dies, a.window)
        out.counts = sum(c.counts for c in cs)
        out.slice = a.slice
        return out
