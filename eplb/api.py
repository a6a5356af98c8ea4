"""``rebalance_experts``: DeepSeek-EPLB-compatible entry point (the format vLLM and SGLang consume).

    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)

Physical slot ``p`` lives on die (GPU) ``p // (num_replicas // num_gpus)``. Outputs are int64 numpy arrays, or CPU
torch tensors when ``weight`` is a torch tensor (drop-in for ``deepseek-ai/EPLB``).
"""
from __future__ import annotations

import numpy as np

from . import validate
from .errors import EplbError
from .placement import place
from .redundancy import aggregate_floor, replicate

ALGOS = ("sliced", "static")
KEEP_TOLERANCE = 0.02       # previous=: keep replicas in place unless that makes the hottest die > 2 % hotter
AGGREGATE_TOLERANCE = 0.08  # sliced: the summed load's hottest replica within 8 % of the static optimum
LOCALITY = ("auto", "node", "none")


def as_loads(weight, name: str = "weight") -> np.ndarray:
    """[layers, experts] or [slices, layers, experts] (numpy, torch, lists) -> float64 [slices, layers, experts]."""
    return validate.loads(weight, name)


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                      algo: str = "sliced", locality: str = "auto", previous=None, refine: bool = True,
                      aggregate_tolerance: float | None = AGGREGATE_TOLERANCE, log2phy_width: int | None = None):
    """Choose replica counts and their placement.

    weight: [layers, experts] or [slices, layers, experts] tokens routed to each logical expert (time slices oldest
    first). num_replicas: physical slots per layer (experts + redundant), a multiple of num_gpus. num_groups:
    expert groups of group-limited routing. num_nodes: server nodes (fast intra-node links). num_gpus: dies, a
    multiple of num_nodes.

    algo: "sliced" (DESIGN.md 7: minimise the sum over slices of the hottest replica) or "static" (DeepSeek's
    objective: the load summed over slices). aggregate_tolerance (sliced, several slices): every expert first gets
    the replicas that keep the hottest replica of the summed load within ``1 + aggregate_tolerance`` of the best
    reachable (the static optimum), the rest go to the per-slice objective, so a drifting load is balanced slice by
    slice without giving up the aggregate; None drops that floor (the per-slice objective alone). locality: "auto"
    (DeepSeek's rule: keep each expert group and all its replicas inside one node when num_groups % num_nodes == 0,
    else place globally), "node" (require that), "none" (global). previous: phy2log [layers, num_replicas] of the
    current layout; replicas the new counts still need stay in their slots (minimal churn), unless that leaves a
    layer's hottest die more than KEEP_TOLERANCE (2 %) hotter than a fresh placement; with one slot per die it never
    does, every expert keeps an old slot and the live reconfiguration takes one round. refine: run the swap pass
    after greedy packing. log2phy_width: the last dim of log2phy; default vLLM's ``num_redundant_experts + 1``
    (``num_replicas - experts + 1``, the most replicas any expert can get), so the width does not depend on the load.

    Returns phy2log [layers, num_replicas] (logical expert of each slot), log2phy [layers, experts, log2phy_width]
    (slots of each expert ascending, -1 padded), logcnt [layers, experts]; all int64.
    """
    is_torch = hasattr(weight, "detach")
    w = as_loads(weight)
    if algo not in ALGOS:
        raise EplbError(f"algo={algo!r}: use one of {ALGOS}")
    if locality not in LOCALITY:
        raise EplbError(f"locality={locality!r}: use one of {LOCALITY}")
    if not isinstance(refine, (bool, np.bool_)):
        raise EplbError(f"refine={refine!r} must be a bool")
    if aggregate_tolerance is not None:
        aggregate_tolerance = validate.finite_float(aggregate_tolerance, "aggregate_tolerance", low=0.0)
    num_slices, num_layers, num_experts = w.shape
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        validate.positive(v, name)
    if num_replicas % num_gpus:
        raise EplbError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise EplbError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_replicas < num_experts:
        raise EplbError(f"num_replicas={num_replicas} is below the {num_experts} logical experts")
    width = _width(log2phy_width, num_replicas, num_experts)
    hier = num_nodes > 1 and (locality == "node" or (locality == "auto" and num_groups % num_nodes == 0))
    if hier and (num_experts % num_groups or num_groups % num_nodes):
        raise EplbError(f"locality='node' needs experts ({num_experts}) % num_groups ({num_groups}) == 0 and "
                        f"num_groups % num_nodes ({num_nodes}) == 0")
    if algo == "static":
        w = w.sum(0, keepdims=True)
    keep = None
    if previous is not None:
        keep = validate.layout(previous, "previous", num_experts=num_experts, num_layers=num_layers,
                               num_slots=num_replicas)
    if hier:
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus, keep, refine, aggregate_tolerance)
    else:
        phy2log = _flat(w, num_replicas, num_gpus, keep, refine, aggregate_tolerance)
    log2phy, logcnt = inverse_map(phy2log, num_experts, width=width)
    if is_torch:
        import torch
        return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)
    return phy2log, log2phy, logcnt


def _width(log2phy_width, num_replicas: int, num_experts: int) -> int:
    """log2phy's last dim: vLLM's num_redundant_experts + 1 by default; an explicit width must hold that many."""
    most = num_replicas - num_experts + 1                 # every expert has >= 1 replica
    if log2phy_width is None:
        return most
    width = validate.positive(log2phy_width, "log2phy_width")
    if width < most:
        raise EplbError(f"log2phy_width={width} is below num_redundant_experts + 1 = {most}, the most replicas one "
                        f"expert can get")
    return width


def _flat(w, num_replicas, num_dies, keep, refine, aggregate_tolerance) -> np.ndarray:
    lower = None
    if w.shape[0] > 1 and aggregate_tolerance is not None:
        lower = aggregate_floor(w.sum(0), num_replicas, num_dies, aggregate_tolerance)
    counts = replicate(w, num_replicas, num_dies, lower=lower)
    load = w.sum(0)
    fresh = place(load, counts, num_dies, refine=refine)
    if keep is None:
        return fresh
    kept = place(load, counts, num_dies, keep=keep, refine=refine)
    hot = lambda p: _max_die_load(load, p, num_dies)
    worse = hot(kept) > (1.0 + KEEP_TOLERANCE) * hot(fresh)          # keeping costs too much balance: move
    return np.where(worse[:, None], fresh, kept)


def _max_die_load(load, phy2log, num_dies) -> np.ndarray:
    """[layers]: the hottest die's load (replicas share their expert's load evenly)."""
    counts = np.zeros_like(load)
    rows = np.arange(load.shape[0])[:, None]
    np.add.at(counts, (np.broadcast_to(rows, phy2log.shape), phy2log), 1)
    rep = np.take_along_axis(load / np.maximum(counts, 1), phy2log, 1)
    return rep.reshape(load.shape[0], num_dies, -1).sum(-1).max(-1)


def _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus, keep, refine, aggregate_tolerance) -> np.ndarray:
    """Groups -> nodes (balanced, equal group count per node), then redundancy and placement inside each node."""
    num_slices, num_layers, num_experts = w.shape
    group_size = num_experts // num_groups
    per_node = num_groups // num_nodes
    slots_node = num_replicas // num_nodes
    dies_node = num_gpus // num_nodes
    group_load = w.sum(0).reshape(num_layers, num_groups, group_size).sum(-1)
    node_of = _pack_groups(group_load, num_nodes, per_node)            # [layers, groups]
    if keep is not None:
        node_of = np.where(_nodes_of_previous(keep, num_groups, group_size, slots_node, per_node), 
                           _prev_nodes(keep, num_groups, group_size, slots_node), node_of)
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    for layer in range(num_layers):
        for node in range(num_nodes):
            groups = np.flatnonzero(node_of[layer] == node)
            experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
            sub_keep = None
            lo, hi = node * slots_node, (node + 1) * slots_node
            if keep is not None:
                local = np.full(num_experts, -1, dtype=np.int64)
                local[experts] = np.arange(len(experts))
                k = keep[layer, lo:hi]
                sub_keep = np.where(k >= 0, local[np.maximum(k, 0)], -1)[None]
            sub = _flat(w[:, layer:layer + 1, experts], slots_node, dies_node, sub_keep, refine, aggregate_tolerance)
            phy2log[layer, lo:hi] = experts[sub[0]]
    return phy2log


def _pack_groups(group_load, num_nodes, per_node) -> np.ndarray:
    """Greedy: groups by load descending, each to the least-loaded node with room (DeepSeek's balanced packing)."""
    num_layers, num_groups = group_load.shape
    node_of = np.empty((num_layers, num_groups), dtype=np.int64)
    for layer in range(num_layers):
        load = np.zeros(num_nodes)
        room = np.full(num_nodes, per_node)
        for g in np.argsort(-group_load[layer], kind="stable"):
            n = int(np.argmin(np.where(room > 0, load, np.inf)))
            node_of[layer, g] = n
            load[n] += group_load[layer, g]
            room[n] -= 1
    return node_of


def _prev_nodes(keep, num_groups, group_size, slots_node) -> np.ndarray:
    """Node of each group in a previous layout: the node of the group's lowest slot ([layers, groups])."""
    num_layers, num_replicas = keep.shape
    first = np.full((num_layers, num_groups), num_replicas, dtype=np.int64)
    slot = np.broadcast_to(np.arange(num_replicas), keep.shape)
    ok = keep >= 0
    g = np.where(ok, keep // group_size, 0)
    rows = np.broadcast_to(np.arange(num_layers)[:, None], keep.shape)
    np.minimum.at(first, (rows[ok], g[ok]), slot[ok])
    return np.minimum(first // slots_node, num_replicas // slots_node - 1)


def _nodes_of_previous(keep, num_groups, group_size, slots_node, per_node) -> np.ndarray:
    """[layers, 1] bool: the previous layout's group -> node map is valid (equal group count per node)."""
    nodes = _prev_nodes(keep, num_groups, group_size, slots_node)
    num_nodes = keep.shape[1] // slots_node
    ok = np.stack([(nodes == n).sum(1) == per_node for n in range(num_nodes)]).all(0)
    return ok[:, None]


def inverse_map(phy2log, num_experts: int, *, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [layers, P] (-1 = empty slot) -> log2phy [layers, experts, width] (ascending, -1 padded),
    logcnt [layers, experts]; both int64. width: default the most replicas any expert has (at least 1)."""
    num_experts = validate.positive(num_experts, "num_experts")
    phy2log = validate.layout(phy2log, "phy2log", num_experts=num_experts)
    num_layers, num_slots = phy2log.shape
    valid = phy2log >= 0
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    rows = np.broadcast_to(np.arange(num_layers)[:, None], phy2log.shape)
    np.add.at(logcnt, (rows[valid], phy2log[valid]), 1)
    most = max(int(logcnt.max()) if logcnt.size else 1, 1)
    if width is None:
        width = most
    elif validate.positive(width, "width") < most:
        raise EplbError(f"width={width}: an expert has {most} replicas in phy2log")
    log2phy = np.full((num_layers, num_experts, width), -1, dtype=np.int64)
    key = np.where(valid, rows * num_experts + phy2log, num_layers * num_experts)
    order = np.argsort(key, axis=None, kind="stable")
    k = key.reshape(-1)[order]
    keep = k < num_layers * num_experts
    order, k = order[keep], k[keep]
    start = np.searchsorted(k, k, side="left")
    rank = np.arange(len(k)) - start
    log2phy.reshape(-1, width)[k, rank] = order % num_slots
    return log2phy, logcnt
