"""DeepEP-style host helpers for MoE dispatch / combine: the layout of a routing, and the windows a ``MoeGroup``
allocates on every die, tensor by tensor, so buffers can be sized before the first call.

    layout = kernels.get_dispatch_layout(topk_idx, num_experts=256, num_ranks=32)
    layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank
    kernels.dispatch_buffer_size_hint(max_bs=96, hidden=7168, num_ranks=32, num_experts=256, topk=8)   # bytes per die
    for t in kernels.moe_buffer_layout(...): print(t.name, t.shape, t.dtype, t.meaning, t.sentinel)

Experts sit on ranks in contiguous blocks (rank r holds experts r*E/R .. (r+1)*E/R - 1), as in DeepEP and the
fused kernels. Compared with DeepEP's ``Buffer.get_dispatch_layout``: a free function (the rank count is an
argument, there is no buffer object), no per-RDMA-rank counts (one flat fabric) and no event (host code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ascend_emu.errors import ArgumentError, DTypeError, ShapeError

TAIL_BYTES = 64              # record tail of the fused kernels: scale, source rank, token, k (fused_moe.TAIL_BYTES)
RECORD_ALIGN = 512           # records are padded to 512 bytes (7.5 KiB at H = 7168 with int8)
HALVES = 2                   # every window is double buffered: calls alternate halves


class DispatchLayout(NamedTuple):
    """``num_tokens_per_rank`` [num_ranks] int32: tokens sending at least one copy to rank r (a token counts once
    per rank however many of its experts live there). ``num_tokens_per_expert`` [num_experts] int32: (token, k)
    selections of each expert. ``is_token_in_rank`` [num_tokens, num_ranks] bool: token t sends to rank r."""
    num_tokens_per_rank: object
    num_tokens_per_expert: object
    is_token_in_rank: object


def get_dispatch_layout(topk_idx, num_experts: int, num_ranks: int) -> DispatchLayout:
    """The layout a dispatch of ``topk_idx`` needs (DeepEP's semantics).

    topk_idx: [num_tokens, num_topk] int32/int64 torch tensor, the experts each token selected; -1 = no selection
    (masked entries count nowhere). num_experts: a multiple of num_ranks. Returns ``DispatchLayout`` (torch)."""
    import torch
    for name, v in (("num_experts", num_experts), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name}={v!r} must be a positive int")
    if num_experts % num_ranks:
        raise ArgumentError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    idx = torch.as_tensor(topk_idx)
    if idx.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"topk_idx dtype {idx.dtype}: use int64 (DeepEP's topk_idx_t) or int32")
    if idx.dim() != 2:
        raise ShapeError(f"topk_idx must be [num_tokens, num_topk], got shape {tuple(idx.shape)}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ArgumentError(f"topk_idx holds {int(idx.min())}..{int(idx.max())}: ids must lie in -1..{num_experts - 1} "
                            f"(-1 = no selection)")
    idx = idx.long()
    valid = idx >= 0
    rank = torch.where(valid, idx // (num_experts // num_ranks), num_ranks)   # masked entries -> a spare column
    in_rank = torch.zeros(idx.shape[0], num_ranks + 1, dtype=torch.bool).scatter_(1, rank, True)[:, :num_ranks]
    per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
    return DispatchLayout(in_rank.sum(0, dtype=torch.int32), per_expert, in_rank)


# ------------------------------------------------------------------------------------------------ window sizes
@dataclass(frozen=True)
class WindowTensor:
    """One GM window a ``MoeGroup`` allocates on every die of the group."""
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    used_by: str              # "dispatch" or "combine"
    meaning: str
    sentinel: str


def moe_buffer_layout(*, max_bs: int, hidden: int, num_ranks: int, num_experts: int, topk: int,
                      quant: bool = True) -> list:
    """The windows of ``MoeGroup(pod, dies, max_bs=, hidden=, topk=, num_experts=, quant=)`` on one die, in
    allocation order (``WindowTensor`` each: name, shape, dtype, bytes, meaning, sentinel)."""
    for name, v in (("max_bs", max_bs), ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts),
                    ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name}={v!r} must be a positive int")
    if num_experts % num_ranks:
        raise ArgumentError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    experts_per_rank = num_experts // num_ranks
    row_bytes = hidden * (1 if quant else 2)
    record = -(-(row_bytes + TAIL_BYTES) // RECORD_ALIGN) * RECORD_ALIGN
    max_tokens = max_bs * min(topk, experts_per_rank)            # rows one source can send to one rank
    row = "int8 row + fp32 scale" if quant else "bf16 row"

    def window(name, shape, dtype, itemsize, used_by, meaning, sentinel):
        n = itemsize
        for d in shape:
            n *= d
        return WindowTensor(name, shape, dtype, n, used_by, meaning, sentinel)

    return [
        window("dispatch_win", (HALVES, num_ranks, max_tokens, record), "int8", 1, "dispatch",
               f"records pushed by each source rank, expert-major in the source's region: a {row}, then a "
               f"{TAIL_BYTES}-byte tail (int32 words: 0 scale bits, 8 source rank, 9 source token, 10 k slot), padded "
               f"to {RECORD_ALIGN} bytes; halves alternate between calls",
               "none: only the rows the status counts announce are read"),
        window("status", (HALVES, num_ranks, experts_per_rank, 8), "int32", 4, "dispatch",
               "one 32-byte record per (source rank, local expert): word 0 the dispatch call number (flag), word 1 "
               "the rows that source sent to that expert",
               "word 0 = 0: nothing published yet (call numbers start at 1)"),
        window("combine_win", (HALVES, max_bs, topk, hidden), "bf16", 2, "combine",
               "expert output rows returned to their source token's (token, k) slot", "none: read once counted"),
        window("arrivals", (HALVES, max_bs), "int32", 4, "combine",
               "rows that have arrived for each local token (atomic adds); the token is summed when it reaches its "
               "number of routed experts", "0: none yet (reset to 0 after each combine)"),
    ]


def dispatch_buffer_size_hint(*, max_bs: int, hidden: int, num_ranks: int, num_experts: int, topk: int,
                              quant: bool = True) -> int:
    """Bytes per die of the dispatch windows (dispatch_win + status), both halves."""
    return sum(t.nbytes for t in moe_buffer_layout(max_bs=max_bs, hidden=hidden, num_ranks=num_ranks,
                                                   num_experts=num_experts, topk=topk, quant=quant)
               if t.used_by == "dispatch")


def combine_buffer_size_hint(*, max_bs: int, hidden: int, num_ranks: int, num_experts: int, topk: int,
                             quant: bool = True) -> int:
    """Bytes per die of the combine windows (combine_win + arrivals), both halves."""
    return sum(t.nbytes for t in moe_buffer_layout(max_bs=max_bs, hidden=hidden, num_ranks=num_ranks,
                                                   num_experts=num_experts, topk=topk, quant=quant)
               if t.used_by == "combine")
