"""Failure shrink: a new layout on the surviving dies that keeps at least one replica of every expert."""
from __future__ import annotations

import numpy as np

from .api import as_loads, inverse_map, rebalance_experts
from . import validate
from .errors import EplbError


def shrink(weight, phy2log, failed_dies, num_gpus: int, *, algo: str = "sliced"):
    """Re-plan after die failures, keeping the slot numbering of the survivors.

    weight: [layers, E] or [slices, layers, E]. phy2log: [layers, P] current layout on ``num_gpus`` dies (slot p on
    die p // (P / num_gpus)). failed_dies: die ids. Survivors keep the replicas the new counts still need in their
    slots (minimal reload); placement is global (a failure leaves nodes with unequal die counts).

    Returns (phy2log, log2phy, logcnt) over the original P slots: slots of failed dies hold -1 and appear in no
    log2phy row; log2phy keeps the layout's vLLM width, P - E + 1. Raises EplbError when the survivors have fewer
    slots than there are experts.
    """
    w = as_loads(weight)
    num_experts = w.shape[-1]
    cur = validate.layout(phy2log, "phy2log", num_experts=num_experts, num_layers=w.shape[1])
    num_layers, num_slots = cur.shape
    num_gpus = validate.positive(num_gpus, "num_gpus")
    if num_slots % num_gpus:
        raise EplbError(f"num_gpus={num_gpus} must divide the {num_slots} physical slots")
    slots = num_slots // num_gpus
    failed = sorted(set(validate.int_array(failed_dies, "failed_dies", ndim=(0, 1)).reshape(-1).tolist()))
    bad = [d for d in failed if not 0 <= d < num_gpus]
    if bad:
        raise EplbError(f"failed die {bad[0]} out of range 0..{num_gpus - 1}")
    alive = np.array([d for d in range(num_gpus) if d not in failed], dtype=np.int64)
    if len(alive) * slots < num_experts:
        raise EplbError(f"{len(failed)} failed dies leave {len(alive)} dies x {slots} slots = {len(alive) * slots} "
                        f"slots for {num_experts} experts: every expert needs one")
    keep_slots = (alive[:, None] * slots + np.arange(slots)).reshape(-1)
    sub, _, _ = rebalance_experts(w, len(keep_slots), 1, 1, len(alive), algo=algo, locality="none",
                                  previous=cur[:, keep_slots])
    out = np.full_like(cur, -1)
    out[:, keep_slots] = sub
    log2phy, logcnt = inverse_map(out, num_experts, width=num_slots - num_experts + 1)
    if (logcnt == 0).any():                                   # placement guarantees it; check anyway
        layer, e = np.argwhere(logcnt == 0)[0]
        raise EplbError(f"shrink lost expert {e} of layer {layer}")
    return out, log2phy, logcnt
