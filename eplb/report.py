"""How balanced a layout is: die loads and max/mean ratios, plus the best any replica allocation can do."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .api import as_loads, inverse_map
from . import validate
from .errors import EplbError


@dataclass(frozen=True)
class BalanceReport:
    """Die loads under a layout, each replica carrying an even share of its expert's tokens.

    die_load [slices, layers, dies] float64. per_slice [slices, layers] and per_layer [layers] (on the load summed
    over slices): max/mean die load, 1.0 = perfect (and for a layer without load). overall: sum over layers of the
    hottest die / sum of the mean die (a step waits for its hottest die, layer after layer), on the summed load;
    overall_sliced: the same summed over slices too (what a drifting load costs step by step).
    """
    die_load: np.ndarray
    per_slice: np.ndarray
    per_layer: np.ndarray
    overall: float
    overall_sliced: float

    def to_dict(self) -> dict:
        return {"overall": self.overall, "overall_sliced": self.overall_sliced,
                "per_layer_max": float(self.per_layer.max()), "per_layer_mean": float(self.per_layer.mean()),
                "per_slice_max": float(self.per_slice.max()), "per_slice_mean": float(self.per_slice.mean())}


def _ratio(mx, mean):
    return np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)


def die_loads(weight, phy2log, num_gpus: int | None = None) -> np.ndarray:
    """[slices, layers, dies] float64: load of each die, replicas splitting their expert's load evenly."""
    w = as_loads(weight)
    num_slices, num_layers, num_experts = w.shape
    phy2log = validate.layout(phy2log, "phy2log", num_experts=num_experts, num_layers=num_layers)
    num_slots = phy2log.shape[1]
    num_gpus = num_slots if num_gpus is None else validate.integer(num_gpus, "num_gpus")
    if num_gpus < 1 or num_slots % num_gpus:
        raise EplbError(f"num_gpus={num_gpus} must divide the {num_slots} physical slots")
    _, logcnt = inverse_map(phy2log, num_experts)
    if (logcnt == 0).any():
        layer, e = np.argwhere(logcnt == 0)[0]
        raise EplbError(f"expert {e} of layer {layer} has no replica in phy2log")
    share = w / logcnt[None]                                       # [S, L, E]
    valid = phy2log >= 0
    rep = np.where(valid[None], np.take_along_axis(share, np.maximum(phy2log, 0)[None].repeat(num_slices, 0), 2),
                   0.0)
    return rep.reshape(num_slices, num_layers, num_gpus, num_slots // num_gpus).sum(-1)


def balance_report(weight, phy2log, num_gpus: int | None = None) -> BalanceReport:
    """max/mean die load per layer, per slice and overall. weight [layers, E] or [slices, layers, E]; phy2log
    [layers, P]; num_gpus: dies (default P: one slot per die)."""
    d = die_loads(weight, phy2log, num_gpus)
    agg = d.sum(0)
    per_layer = _ratio(agg.max(-1), agg.mean(-1))
    per_slice = _ratio(d.max(-1), d.mean(-1))
    overall = float(_ratio(agg.max(-1).sum(), agg.mean(-1).sum()))
    overall_sliced = float(_ratio(d.max(-1).sum(), d.mean(-1).sum()))
    return BalanceReport(d, per_slice, per_layer, overall, overall_sliced)


def lower_bound(weight, num_replicas: int, num_gpus: int) -> np.ndarray:
    """[layers] float64: the smallest max/mean die load any replica allocation and placement can reach on the load
    summed over slices: max(1, min over counts of max_e w_e / c_e, divided by the mean die load). The greedy of
    ``redundancy`` attains the inner minimum (it splits the current maximum, which is optimal for min-max)."""
    from .redundancy import replicate
    w = as_loads(weight).sum(0)
    num_replicas = validate.positive(num_replicas, "num_replicas")
    num_gpus = validate.positive(num_gpus, "num_gpus")
    counts = replicate(w[None], num_replicas, num_gpus)
    best = (w / counts).max(-1)
    mean = w.sum(-1) / num_gpus
    return np.maximum(1.0, _ratio(best, mean))
