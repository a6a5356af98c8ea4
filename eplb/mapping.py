"""Runtime mapping: each token's logical expert -> one physical replica, rotating over the replicas.

The table ``table[j, e] = log2phy[e, (j + offset) % logcnt[e]]`` ([tokens, logical experts], int32) is built once
per layout; applying it to top-k ids is one vectorised gather. Every die computes its own choice from data it
already has, so no communication is needed. Two ways to index the rows (``by``):

- ``"rank"`` (default): j = how many earlier (token, k) entries of the batch chose the same expert -- the
  per-expert arrival counter dispatch computes anyway for its per-expert layout. Each expert's tokens then split
  across its replicas within one token of even, whatever the routing.
- ``"position"``: j = the token's position in the batch. Free (no counter), even only on average: tokens of
  one expert that sit at positions with the same residue all land on one replica.

``offset`` (e.g. the DP rank of the attention die) staggers where each die's rotation starts, so the remainders
of many dies do not all fall on replica 0.
"""
from __future__ import annotations

import numpy as np

from . import validate
from .errors import EplbError

BY = ("rank", "position")


def rotation_table(log2phy, logcnt, num_tokens: int, *, offset: int = 0) -> np.ndarray:
    """log2phy [E, X] or [layers, E, X] (-1 padded), logcnt [E] or [layers, E] -> [num_tokens, E] or
    [layers, num_tokens, E] int32 physical slot ids. Every expert needs logcnt >= 1."""
    log2phy = validate.int_array(log2phy, "log2phy", ndim=(2, 3), low=-1)
    logcnt = validate.int_array(logcnt, "logcnt", ndim=(1, 2))
    num_tokens = validate.positive(num_tokens, "num_tokens")
    offset = validate.integer(offset, "offset")
    if 0 in log2phy.shape:
        raise EplbError(f"log2phy has an empty dimension, shape {log2phy.shape}")
    if log2phy.ndim == 3:
        if logcnt.shape != log2phy.shape[:2]:
            raise EplbError(f"log2phy {log2phy.shape} and logcnt {logcnt.shape} must be [layers, E, X] and "
                            f"[layers, E]")
        return np.stack([rotation_table(a, c, num_tokens, offset=offset) for a, c in zip(log2phy, logcnt)])
    if log2phy.ndim != 2 or logcnt.shape != log2phy.shape[:1]:
        raise EplbError(f"log2phy {log2phy.shape} and logcnt {logcnt.shape} must be [E, X] and [E]")
    if (logcnt < 1).any() or (logcnt > log2phy.shape[1]).any():
        e = int(np.flatnonzero((logcnt < 1) | (logcnt > log2phy.shape[1]))[0])
        raise EplbError(f"expert {e} has logcnt {logcnt[e]}; it must lie in 1..{log2phy.shape[1]} (the log2phy width)")
    j = np.arange(num_tokens)[:, None] + int(offset)
    idx = j % logcnt[None, :]
    table = np.take_along_axis(log2phy.T, idx, axis=0)          # [tokens, E]
    if (table < 0).any():
        raise EplbError("log2phy has -1 inside the first logcnt entries of an expert")
    return table.astype(np.int32)


def arrival_rank(topk_ids) -> np.ndarray:
    """[tokens, k] int -> [tokens, k] int64: how many earlier entries (row-major) hold the same id (ids < 0
    are padding and get rank 0)."""
    ids = validate.int_array(topk_ids, "topk_ids").reshape(-1)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.searchsorted(sorted_ids, sorted_ids, side="left")
    rank = np.empty_like(ids)
    rank[order] = np.arange(len(ids)) - first
    rank[ids < 0] = 0
    return rank.reshape(np.shape(topk_ids))


def map_experts(table, topk_ids, *, by: str = "rank") -> np.ndarray:
    """Logical top-k ids [tokens, k] -> physical slot ids [tokens, k] int32 via ``table`` [rows, E]; ids < 0
    (padding) stay -1. ``by``: "rank" or "position" (module docstring)."""
    table = validate.int_array(table, "table", ndim=2, low=0)
    ids = validate.int_array(topk_ids, "topk_ids", ndim=2)
    if by not in BY:
        raise EplbError(f"by={by!r}: use one of {BY}")
    if ids.size and table.shape[0] == 0:
        raise EplbError("table has no rows")
    if ids.size and ids.max() >= table.shape[1]:
        raise EplbError(f"topk_ids holds expert {ids.max()} >= {table.shape[1]} logical experts")
    if by == "rank":
        rows = arrival_rank(ids)
    else:
        rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)
    if rows.size and rows.max() >= table.shape[0]:
        raise EplbError(f"the table has {table.shape[0]} rows; this batch needs row {rows.max()} "
                        f"(build it with num_tokens >= the batch size)")
    out = table[rows, np.maximum(ids, 0)]
    return np.where(ids >= 0, out, -1).astype(np.int32)
