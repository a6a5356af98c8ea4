"""torch_npu's operator API on an emulated pod: one rank's view, torch_npu's names, argument order, defaults and
output tuples, so a per-rank script ports as is.

    import kernels.npu as torch_npu

    def step(rank):                                   # the script, written for one rank (one process per rank)
        y, scale = torch_npu.npu_dynamic_quant(x[rank])
        weights, ids, _ = torch_npu.npu_moe_gating_top_k(logits[rank], 8, ...)
        expand_x, scales, assist, counts, ep_recv, tp_recv, _ = torch_npu.npu_moe_distribute_dispatch_v2(
            x[rank], ids, "ep", 4, rank, 64, quant_mode=2)
        ...
    outputs = ascend_emu.spmd(step, pod, world_size=4)

Inside ``ascend_emu.spmd`` every operator runs on the calling rank's die of that pod; the collectives (dispatch,
combine: ``kernels.npu_moe``) meet the other ranks of their EP group there and run once for the group. Outside spmd,
the single-die operators run on a fresh one-die pod. Each run is kept: ``runs(pod)`` lists (operator, RunResult).
Every difference from torch_npu that remains is in the README's "torch_npu parity" table; arguments outside the
modeled subset raise ``ArgumentError`` naming the argument, never a silent fallback.
"""
from __future__ import annotations

from ascend_emu.errors import ArgumentError, DTypeError, ShapeError

from .dynamic_quant import dynamic_quant
from .gating import moe_gating_top_k
from .grouped_matmul import grouped_matmul
from .mla import mla_prolog
from .npu_moe import (npu_moe_distribute_combine, npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch,
                      npu_moe_distribute_dispatch_v2)
from .npu_rank import placement, record, runs, tensor, unmodeled

# ------------------------------------------------------------------------------------------------ dynamic quant
def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """torch_npu.npu_dynamic_quant: per-token symmetric INT8. x [..., H] float16/bfloat16; smooth_scales [H] (or
    [G, H] with group_index [G] int32 cumulative row ends). Returns (y int8 x.shape, scale float32 x.shape[:-1])."""
    import torch
    halves = (torch.float16, torch.bfloat16)
    tensor(x, "x", dtypes=halves)
    if x.dim() < 2:
        raise ShapeError(f"x must have more than 1 dim, got shape {tuple(x.shape)}")
    if smooth_scales is not None:
        tensor(smooth_scales, "smooth_scales", dtypes=halves)
    if group_index is not None:
        tensor(group_index, "group_index", dtypes=(torch.int32, torch.int64), ndim=1)
    if dst_type not in (None, torch.int8):
        raise ArgumentError(f"dst_type={dst_type}: only torch.int8 is modeled (quint4x2 is not)")
    unmodeled(quant_mode=(quant_mode, "pertoken"), dst_type_max=(dst_type_max, 0.0))
    pod, dies = placement()
    res = dynamic_quant(x, smooth_scales=smooth_scales, group_index=group_index, pod=pod, dies=dies)
    record(pod, "npu_dynamic_quant", res.run)
    return res.y, res.scale


# ------------------------------------------------------------------------------------------------ gating
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """torch_npu.npu_moe_gating_top_k (norm_type 0 softmax by default, as torch_npu; DeepSeek-V3 passes 1).
    x [T, E] float16/bfloat16/float32; bias [E] of x's dtype. Returns (y [T, k] x.dtype, expert_idx [T, k] int32,
    norm_out [T, E] float32: the norm scores with out_flag, zeros otherwise (unspecified on the NPU))."""
    import torch
    tensor(x, "x", dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    if bias is not None:
        tensor(bias, "bias", ndim=1)
        if bias.dtype != x.dtype:
            raise DTypeError(f"bias dtype {bias.dtype} must equal x dtype {x.dtype}")
    unmodeled(input_ids=(input_ids, None), tid2eid=(tid2eid, None))
    pod, dies = placement()
    res = moe_gating_top_k(x, int(k), bias=bias, k_group=k_group, group_count=group_count,
                           group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
                           out_flag=bool(out_flag), routed_scaling_factor=routed_scaling_factor, eps=eps, pod=pod,
                           dies=dies)
    record(pod, "npu_moe_gating_top_k", res.run)
    out = res.out if out_flag else torch.zeros(x.shape, dtype=torch.float32)
    return res.y, res.expert_idx, out


# ------------------------------------------------------------------------------------------------ grouped matmul
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    """torch_npu.npu_grouped_matmul: lists of tensors in, a list of tensors out (``[y] = ...`` with split_item 2/3).

    group_type 0 (groups along M): x [x] one [M, K] tensor (or several, stacked along M); weight [w] one [E, K, N]
    tensor or E [K, N] tensors; group_list [E] (Tensor or list) cumulative (group_list_type 0), counts (1), or
    [E, 2] (group index, size) pairs (2); scale [[E, N]] float32/bfloat16 per channel; per_token_scale [[M]] float32.
    group_type None/-1 (no grouping): y_i = x_i @ weight_i for each pair. split_item 0/1: one output per group,
    2/3: one output. int8 x needs output_dtype (bfloat16, float16, or int32 for the raw accumulators)."""
    import torch
    unmodeled(bias=(bias, None), offset=(offset, None), antiquant_scale=(antiquant_scale, None),
              antiquant_offset=(antiquant_offset, None), activation_input=(activation_input, None),
              activation_quant_scale=(activation_quant_scale, None),
              activation_quant_offset=(activation_quant_offset, None), act_type=(act_type, 0),
              x_dtype=(x_dtype, None), weight_dtype=(weight_dtype, None), scale_dtype=(scale_dtype, None),
              per_token_scale_dtype=(per_token_scale_dtype, None))
    xs, ws = _tensor_list(x, "x"), _tensor_list(weight, "weight")
    if split_item not in (0, 1, 2, 3):
        raise ArgumentError(f"split_item={split_item}: use 0/1 (one output per group) or 2/3 (one output)")
    if output_dtype is None:
        if xs[0].dtype == torch.int8:
            raise ArgumentError("output_dtype=None gives int8 x an int8 (requantised) output on the NPU, which is not "
                                "modeled: pass torch.bfloat16, torch.float16 or torch.int32")
        output_dtype = xs[0].dtype
    pod, dies = placement()
    common = dict(output_dtype=output_dtype, pod=pod, dies=dies)
    if group_type in (None, -1):
        return _ungrouped(xs, ws, scale, per_token_scale, group_list, split_item, common)
    if group_type != 0:
        raise ArgumentError(f"group_type={group_type}: only 0 (groups along M) and -1/None (no grouping) are modeled")
    xm = xs[0] if len(xs) == 1 else torch.cat(xs)
    w, sizes = _grouped_weight(ws, xs, group_list, group_list_type)
    sc = None
    if scale is not None:
        sc = _tensor_list(scale, "scale")
        sc = (sc[0] if len(sc) == 1 else torch.stack(sc)).float()
        if sizes.order is not None:
            sc = sc[sizes.order]
    pts = None
    if per_token_scale is not None:
        pts = _tensor_list(per_token_scale, "per_token_scale")
        pts = pts[0] if len(pts) == 1 else torch.cat(pts)
    res = grouped_matmul(xm, w, group_list=sizes.counts, group_list_type=1, scale=sc, per_token_scale=pts, **common)
    record(pod, "npu_grouped_matmul", res.run)
    y = res.y
    if split_item in (2, 3):
        return [y]
    return list(torch.split(y[:int(sum(sizes.counts))], [int(c) for c in sizes.counts]))


class _Groups:
    """Rows per group (in the order the rows come) and, for group_list_type 2, the weight group of each."""

    def __init__(self, counts, order=None):
        self.counts, self.order = counts, order


def _tensor_list(value, name: str) -> list:
    import torch
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)) or not value:
        raise ArgumentError(f"{name} must be a non-empty list of tensors (torch_npu's TensorList), got "
                            f"{type(value).__name__}")
    for i, t in enumerate(value):
        tensor(t, f"{name}[{i}]")
    return list(value)


def _grouped_weight(ws, xs, group_list, group_list_type):
    """(weight [E, K, N], _Groups) for group_type 0."""
    import torch
    w = ws[0] if len(ws) == 1 and ws[0].dim() == 3 else None
    if w is None:
        if any(t.dim() != 2 for t in ws) or len({tuple(t.shape) for t in ws}) != 1:
            raise ShapeError(f"weight: one [E, K, N] tensor or E [K, N] tensors of one shape, got "
                             f"{[tuple(t.shape) for t in ws]}")
        w = torch.stack(ws)
    if group_list is None:
        if len(xs) == 1:
            raise ArgumentError("group_list is required with group_type=0 and one x")
        return w, _Groups([int(t.shape[0]) for t in xs])
    gl = torch.as_tensor(group_list).to(torch.int64)
    if group_list_type == 2:
        if gl.dim() != 2 or gl.shape[1] != 2:
            raise ShapeError(f"group_list_type=2 needs group_list [E, 2] (group index, size), got {tuple(gl.shape)}")
        order = gl[:, 0]
        if gl.numel() and (int(order.min()) < 0 or int(order.max()) >= w.shape[0]):
            raise ArgumentError(f"group_list group indices {order.tolist()} out of range 0..{w.shape[0] - 1}")
        return w[order], _Groups(gl[:, 1].tolist(), order)
    if group_list_type not in (0, 1) or gl.dim() != 1:
        raise ArgumentError(f"group_list_type={group_list_type} with group_list of shape {tuple(gl.shape)}: use 0 "
                            f"(cumulative) or 1 (counts) with [E], or 2 with [E, 2]")
    if gl.numel() != w.shape[0]:
        raise ShapeError(f"group_list has {gl.numel()} entries for {w.shape[0]} weight groups")
    vals = gl.tolist()
    if group_list_type == 0:
        if any(b < a for a, b in zip(vals, vals[1:])) or (vals and vals[0] < 0):
            raise ArgumentError(f"group_list_type=0 needs non-negative non-decreasing cumulative ends, got {vals}")
        vals = [b - a for a, b in zip([0] + vals[:-1], vals)]
    if any(v < 0 for v in vals):
        raise ArgumentError(f"group_list entries must be >= 0, got {gl.tolist()}")
    m = sum(int(t.shape[0]) for t in xs)
    if sum(vals) != m:
        raise ShapeError(f"group_list covers {sum(vals)} rows, x has M={m} (torch_npu requires them equal)")
    return w, _Groups(vals)


def _ungrouped(xs, ws, scale, per_token_scale, group_list, split_item, common):
    """group_type -1: y_i = x_i @ weight_i, one native run per pair (a one-group grouped matmul)."""
    if group_list is not None:
        raise ArgumentError("group_list must be None with group_type=None/-1 (no grouping)")
    if len(xs) != len(ws):
        raise ShapeError(f"group_type=-1 pairs x and weight: {len(xs)} x tensors, {len(ws)} weight tensors")
    if split_item not in (0, 1):
        raise ArgumentError(f"split_item={split_item} with group_type=-1: torch_npu supports 0/1 (one output each)")
    scales = [None] * len(xs) if scale is None else _tensor_list(scale, "scale")
    ptss = [None] * len(xs) if per_token_scale is None else _tensor_list(per_token_scale, "per_token_scale")
    if len(scales) != len(xs) or len(ptss) != len(xs):
        raise ShapeError("scale and per_token_scale need one tensor per x")
    out = []
    for i, (xi, wi, si, pi) in enumerate(zip(xs, ws, scales, ptss)):
        if xi.dim() != 2 or wi.dim() != 2:
            raise ShapeError(f"x[{i}] and weight[{i}] must be 2-D, got {tuple(xi.shape)} and {tuple(wi.shape)}")
        sc = None if si is None else si.float()[None]
        res = grouped_matmul(xi, wi[None], group_list=[int(xi.shape[0])], scale=sc, per_token_scale=pi, **common)
        record(common["pod"], "npu_grouped_matmul", res.run)
        out.append(res.y)
    return out


# ------------------------------------------------------------------------------------------------ MLA prolog
def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      actual_seq_len=None, k_nope_clip_alpha=None, rmsnorm_epsilon_cq=1e-05,
                      rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0,
                      kv_cache_quant_mode=0, query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0,
                      tile_size=128, qc_qr_scale=1.0, kc_scale=1.0, token_x_dtype=None, weight_dq_dtype=None,
                      weight_uq_qr_dtype=None, weight_dkv_kr_dtype=None, kv_cache_dtype=None):
    """torch_npu.npu_mla_prolog_v3: (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm);
    kv_cache and kr_cache are updated in place at ``cache_index``. The unused outputs are empty tensors, as on the
    NPU. Modeled: cache_mode PA_BSND / PA_NZ, weight_quant_mode 0/1/2, kv_cache_quant_mode 0 (1: int8 kv_cache with a
    per-tensor [1] or per-channel [1, Hckv] quant_scale_ckv, the query staying bfloat16), query_quant_mode 0."""
    import torch
    unmodeled(actual_seq_len=(actual_seq_len, None), k_nope_clip_alpha=(k_nope_clip_alpha, None),
              query_norm_flag=(query_norm_flag, False), query_quant_mode=(query_quant_mode, 0),
              ckvkr_repo_mode=(ckvkr_repo_mode, 0), quant_scale_repo_mode=(quant_scale_repo_mode, 0),
              qc_qr_scale=(qc_qr_scale, 1.0), kc_scale=(kc_scale, 1.0), quant_scale_ckr=(quant_scale_ckr, None),
              token_x_dtype=(token_x_dtype, None), weight_dq_dtype=(weight_dq_dtype, None),
              weight_uq_qr_dtype=(weight_uq_qr_dtype, None), weight_dkv_kr_dtype=(weight_dkv_kr_dtype, None),
              kv_cache_dtype=(kv_cache_dtype, None))
    if cache_mode not in ("PA_BSND", "PA_NZ"):
        raise ArgumentError(f"cache_mode={cache_mode!r}: PA_BSND and PA_NZ are modeled")
    if kv_cache_quant_mode not in (0, 1):
        raise ArgumentError(f"kv_cache_quant_mode={kv_cache_quant_mode}: 0 and 1 are modeled")
    if cache_index is None:
        raise ArgumentError(f"cache_index is required with cache_mode={cache_mode!r} (the paged slot of each token)")
    for name, v in (("token_x", token_x), ("kv_cache", kv_cache), ("kr_cache", kr_cache)):
        tensor(v, name)
    hcq, hckv = rmsnorm_gamma_cq.numel(), rmsnorm_gamma_ckv.numel()
    if quant_scale_ckv is not None:
        quant_scale_ckv = _per_channel(quant_scale_ckv, hckv, "quant_scale_ckv")
    if smooth_scales_cq is not None:
        smooth_scales_cq = _per_channel(smooth_scales_cq, hcq, "smooth_scales_cq")
    pod, dies = placement()
    die = 0 if dies is None else dies[0]
    res = mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                     rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index=cache_index,
                     dequant_scale_x=dequant_scale_x, dequant_scale_w_dq=dequant_scale_w_dq,
                     dequant_scale_w_uq_qr=dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr,
                     quant_scale_ckv=quant_scale_ckv, smooth_scales_cq=smooth_scales_cq,
                     rmsnorm_epsilon_cq=rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv,
                     cache_mode=cache_mode, weight_quant_mode=weight_quant_mode,
                     kv_cache_quant_mode=kv_cache_quant_mode, pod=pod, die=die)
    record(pod, "npu_mla_prolog_v3", res.run)
    empty = torch.empty(0, dtype=torch.float32)
    return res.query, res.query_rope, empty, torch.empty(0, dtype=weight_uq_qr.dtype), empty.clone()


def _per_channel(value, n: int, name: str):
    """A [1] (per-tensor) or [1, n] / [n] (per-channel) scale as [n] float32."""
    v = tensor(value, name).reshape(-1).float()
    if v.numel() == 1:
        return v.expand(n).contiguous()
    if v.numel() != n:
        raise ShapeError(f"{name} must be [1] or [1, {n}], got {tuple(value.shape)}")
    return v


__all__ = ["npu_dynamic_quant", "npu_moe_gating_top_k", "npu_grouped_matmul", "npu_mla_prolog_v3",
           "npu_moe_distribute_dispatch", "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine",
           "npu_moe_distribute_combine_v2", "runs"]
