"""torch_npu's MoE dispatch / combine (v1 and v2) as ``ascend_emu.spmd`` collectives over the fused kernels of
``kernels.fused_moe``. Each rank calls the operator with its own tensors and torch_npu's arguments; the step runs
once every rank of the EP group (``group_ep``, ``ep_world_size`` ranks, ``ep_rank_id`` each) has arrived, on the
ranks' dies, and each rank gets torch_npu's output tuple back.

The EP group's windows (a ``MoeGroup``) live with the pod, one per (group name, dies, shape); combine finds the
dispatch it belongs to through what that dispatch returned (``assist_info_for_combine`` carries the dispatch's call
number; v1's ``expand_idx`` is checked against the group's latest dispatch), so a combine fed another dispatch's
outputs raises instead of mixing windows.
"""
from __future__ import annotations

import weakref

import numpy as np

from ascend_emu.errors import ArgumentError, ShapeError
from ascend_emu.spmd import Collective

from .fused_moe import MoeGroup, collect_dispatch, launch_combine, launch_dispatch
from .npu_rank import record, tensor, unmodeled
from .ranks import to_torch

ASSIST_WORDS = 128            # assist_info_for_combine: A rows of 128 int32 words (torch_npu's A * 128)
A_SOURCE, A_TOKEN, A_K, A_CALL = 0, 1, 2, 3      # words of one row: source rank, token, k slot, dispatch call
HISTORY = 2                   # dispatches a combine may refer to: the windows alternate two halves
MAX_BS, MAX_TOPK = 512, 8     # A3 BS limit; top-k as far as the fused kernels model it

_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # pod -> {group name: _EpState}


class _EpState:
    """Per pod and EP group name: the MoeGroups by shape and the recent dispatches, by call number."""

    def __init__(self):
        self.groups: dict = {}
        self.dispatches: dict = {}            # call number -> (MoeGroup, pending handle, per-rank expert_ids, masks)
        self.calls = 0


def _state(pod, group_ep: str) -> _EpState:
    return _GROUPS.setdefault(pod, {}).setdefault(group_ep, _EpState())


# ------------------------------------------------------------------------------------------------ argument checks
def _check_ep(name, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_world_size, tp_rank_id,
              expert_shard_type, shared_expert_num, shared_expert_rank_num, comm_alg="", zero_expert_num=0,
              copy_expert_num=0, const_expert_num=0):
    if not isinstance(group_ep, str) or not 1 <= len(group_ep) < 128:
        raise ArgumentError(f"{name}: group_ep={group_ep!r} must be a string of 1..127 characters")
    for arg, v in (("ep_world_size", ep_world_size), ("ep_rank_id", ep_rank_id),
                   ("moe_expert_num", moe_expert_num)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ArgumentError(f"{name}: {arg}={v!r} must be an int")
    if not 0 <= ep_rank_id < ep_world_size:
        raise ArgumentError(f"{name}: ep_rank_id={ep_rank_id} out of range 0..{ep_world_size - 1}")
    if moe_expert_num < 1 or moe_expert_num % ep_world_size:
        raise ArgumentError(f"{name}: moe_expert_num={moe_expert_num} must be a positive multiple of "
                            f"ep_world_size={ep_world_size} (no shared-expert ranks)")
    if tp_world_size not in (0, 1) or tp_rank_id != 0:
        raise ArgumentError(f"{name}: tp_world_size={tp_world_size}, tp_rank_id={tp_rank_id}: the TP domain is not "
                            f"modeled (use 0/1 and 0)")
    if shared_expert_rank_num != 0 or shared_expert_num not in (0, 1):
        raise ArgumentError(f"{name}: shared_expert_rank_num={shared_expert_rank_num}, shared_expert_num="
                            f"{shared_expert_num}: shared-expert ranks are not modeled (use 0 and 0/1; add the shared "
                            f"expert through combine_v2's shared_expert_x)")
    if comm_alg not in ("", "fullmesh_v1"):
        raise ArgumentError(f"{name}: comm_alg={comm_alg!r}: the modeled path is the fullmesh one (\"\" or "
                            f"\"fullmesh_v1\")")
    unmodeled(expert_shard_type=(expert_shard_type, 0), zero_expert_num=(zero_expert_num, 0),
              copy_expert_num=(copy_expert_num, 0), const_expert_num=(const_expert_num, 0))


def _active_ids(name, expert_ids, x_active_mask, bs: int, moe_expert_num: int) -> np.ndarray:
    """expert_ids [BS, K] int32 checked (ids in [0, moe_expert_num), no repeat in a row) with the entries
    x_active_mask switches off set to -1 (the fused kernels' masked entry)."""
    import torch
    tensor(expert_ids, "expert_ids", dtypes=(torch.int32,), ndim=2)
    if expert_ids.shape[0] != bs:
        raise ShapeError(f"{name}: expert_ids has {expert_ids.shape[0]} rows for BS={bs} tokens")
    k = int(expert_ids.shape[1])
    if not 1 <= k <= MAX_TOPK:
        raise ArgumentError(f"{name}: K={k} experts per token out of range 1..{MAX_TOPK}")
    ids = expert_ids.numpy().astype(np.int64)
    active = np.ones(ids.shape, dtype=bool)
    if x_active_mask is not None:
        tensor(x_active_mask, "x_active_mask", dtypes=(torch.bool,), ndim=(1, 2))
        m = x_active_mask.numpy()
        if m.shape[0] != bs or (m.ndim == 2 and m.shape != ids.shape):
            raise ShapeError(f"{name}: x_active_mask must be [BS={bs}] or [BS, K={k}], got {m.shape}")
        if m.ndim == 1:
            if (np.diff(m.astype(np.int8)) > 0).any():
                raise ArgumentError(f"{name}: x_active_mask [BS] must put every True before the first False")
            m = np.repeat(m[:, None], k, 1)
        active = m
    bad = active & ((ids < 0) | (ids >= moe_expert_num))
    if bad.any():
        t, j = np.argwhere(bad)[0]
        raise ArgumentError(f"{name}: expert_ids[{t}, {j}]={ids[t, j]} out of range 0..{moe_expert_num - 1} (mask a "
                            f"token with x_active_mask)")
    srt = np.sort(np.where(active, ids, -1 - np.arange(k)[None]), 1)
    if (np.diff(srt, axis=1) == 0).any():
        raise ArgumentError(f"{name}: a row of expert_ids names one expert twice (torch_npu requires the K ids of a "
                            f"token to differ)")
    return np.where(active, ids, -1)


# ------------------------------------------------------------------------------------------------ dispatch
def _dispatch(version: int, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales,
              x_active_mask, expert_scales, group_tp, tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
              shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type, extra):
    import torch
    name = "npu_moe_distribute_dispatch" + ("_v2" if version == 2 else "")
    _check_ep(name, group_ep, ep_world_size, ep_rank_id, moe_expert_num, tp_world_size=tp_world_size,
              tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
              shared_expert_rank_num=shared_expert_rank_num, **extra.pop("ep", {}))
    unmodeled(scales=(scales, None), expert_scales=(expert_scales, None), **extra)
    tensor(x, "x", dtypes=(torch.bfloat16,), ndim=2)
    bs, h = (int(d) for d in x.shape)
    if not 1 <= bs <= MAX_BS:
        raise ShapeError(f"{name}: BS={bs} tokens out of range 1..{MAX_BS}")
    if quant_mode not in (0, 2):
        raise ArgumentError(f"{name}: quant_mode={quant_mode}: 0 (none) and 2 (dynamic per-token int8) are modeled")
    if expert_token_nums_type not in (0, 1):
        raise ArgumentError(f"{name}: expert_token_nums_type={expert_token_nums_type}: use 0 (cumulative) or 1")
    if isinstance(global_bs, bool) or not isinstance(global_bs, int) or global_bs < 0:
        raise ArgumentError(f"{name}: global_bs={global_bs!r} must be an int >= 0")
    ids = _active_ids(name, expert_ids, x_active_mask, bs, moe_expert_num)
    payload = {"x": x, "ids": ids, "bs": bs, "h": h, "k": ids.shape[1], "quant": quant_mode == 2,
               "moe_expert_num": moe_expert_num, "global_bs": global_bs, "token_nums_type": expert_token_nums_type,
               "group": group_ep}
    return _DISPATCH[version](payload, group=group_ep, group_rank=ep_rank_id, group_size=ep_world_size)


def _run_dispatch(version: int, arrivals: list) -> list:
    name = "npu_moe_distribute_dispatch" + ("_v2" if version == 2 else "")
    first = arrivals[0][1]
    for key in ("h", "k", "quant", "moe_expert_num", "global_bs", "token_nums_type"):
        values = [p[key] for _, p in arrivals]
        if len(set(values)) != 1:
            raise ArgumentError(f"{name}: every rank of the EP group must pass the same {_ARG[key]}, got {values}")
    ranks = len(arrivals)
    bss = [p["bs"] for _, p in arrivals]
    if first["global_bs"]:
        if first["global_bs"] % ranks or max(bss) > first["global_bs"] // ranks:
            raise ArgumentError(f"{name}: global_bs={first['global_bs']} must be max_bs x ep_world_size with every "
                                f"rank's BS <= max_bs (BS: {bss})")
        max_bs = first["global_bs"] // ranks
    elif len(set(bss)) != 1:
        raise ArgumentError(f"{name}: ranks send different BS {bss}: pass global_bs = max_bs x ep_world_size")
    else:
        max_bs = bss[0]
    pod = arrivals[0][0].pod
    dies = tuple(ctx.die for ctx, _ in arrivals)
    state = _state(pod, first["group"])
    shape = (dies, max_bs, first["h"], first["k"], first["moe_expert_num"], first["quant"])
    group = state.groups.get(shape)
    if group is None:
        group = state.groups[shape] = MoeGroup(pod, list(dies), max_bs=max_bs, hidden=first["h"], topk=first["k"],
                                               num_experts=first["moe_expert_num"], quant=first["quant"])
    pending = launch_dispatch([p["x"] for _, p in arrivals], [p["ids"] for _, p in arrivals], group,
                              expert_token_nums_type=first["token_nums_type"])
    run = pod.synchronize()
    record(pod, name, run)
    res = collect_dispatch(pending, run)
    state.calls += 1
    call = state.calls
    state.dispatches[call] = (group, pending, [p["ids"] for _, p in arrivals], version)
    for old in [c for c in state.dispatches if c <= call - HISTORY]:
        del state.dispatches[old]
    return [_dispatch_outputs(version, res, r, group, call, p) for r, (_, p) in enumerate(arrivals)]


_ARG = {"h": "hidden size (x.shape[1])", "k": "K (expert_ids.shape[1])", "quant": "quant_mode",
        "moe_expert_num": "moe_expert_num", "global_bs": "global_bs", "token_nums_type": "expert_token_nums_type"}


def _dispatch_outputs(version, res, r, group, call, payload) -> tuple:
    """torch_npu's 7 outputs for rank r, padded to A = max_bs x ranks x min(local experts, K) received rows."""
    import torch
    a = group.recv_rows
    n = len(res.assist_info_for_combine[r])
    rows = to_torch(res.expand_x[r])
    expand_x = torch.zeros((a, group.hidden), dtype=rows.dtype)
    expand_x[:n] = rows
    dynamic_scales = torch.zeros(a, dtype=torch.float32)
    if group.quant:
        dynamic_scales[:n] = to_torch(res.dynamic_scales[r])
    expert_token_nums = torch.from_numpy(res.expert_token_nums[r].astype(np.int64))
    ep_recv_counts = torch.from_numpy(res.ep_recv_counts[r].astype(np.int32))
    tp_recv_counts = torch.zeros(0, dtype=torch.int32)          # no TP domain (tp_world_size 0)
    expand_scales = torch.zeros(0, dtype=torch.float32)          # A3: no expand_scales
    if version == 1:
        idx = torch.from_numpy(res.expand_idx[r].reshape(-1).astype(np.int32))
    else:
        bs, k = payload["ids"].shape
        info = np.zeros((max(a, -(-bs * k // ASSIST_WORDS)), ASSIST_WORDS), dtype=np.int32)
        info[:, A_SOURCE:A_K + 1] = -1
        info[:n, A_SOURCE:A_K + 1] = res.assist_info_for_combine[r]
        info[:, A_CALL] = call
        idx = torch.from_numpy(info.reshape(-1))
    return expand_x, dynamic_scales, idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales


_DISPATCH = {v: Collective("npu_moe_distribute_dispatch" + ("_v2" if v == 2 else ""),
                           lambda arrivals, v=v: _run_dispatch(v, arrivals)) for v in (1, 2)}


def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                                x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                global_bs=0, expert_token_nums_type=1):
    """torch_npu.npu_moe_distribute_dispatch for this rank (call it from every rank under ``ascend_emu.spmd``).
    x [BS, H] bfloat16, expert_ids [BS, K] int32. Returns (expand_x [A, H] int8 (quant_mode 2) / bfloat16,
    dynamic_scales [A] float32, expand_idx [BS*K] int32, expert_token_nums [local experts] int64, ep_recv_counts
    [ep_world_size * local experts] int32, tp_recv_counts [0] int32, expand_scales [0] float32); rows past the
    received count (sum of expert_token_nums) are zeros."""
    return _dispatch(1, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, scales=scales,
                     x_active_mask=x_active_mask, expert_scales=expert_scales, group_tp=group_tp,
                     tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                     shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                     quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type,
                     extra={})


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None,
                                   scales_dtype=None):
    """torch_npu.npu_moe_distribute_dispatch_v2: as v1, with assist_info_for_combine [A * 128] int32 in place of
    expand_idx (pass it to npu_moe_distribute_combine_v2 unchanged)."""
    return _dispatch(2, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, scales=scales,
                     x_active_mask=x_active_mask, expert_scales=expert_scales, group_tp=group_tp,
                     tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                     shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                     quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type,
                     extra={"ep": {"comm_alg": comm_alg, "zero_expert_num": zero_expert_num,
                                   "copy_expert_num": copy_expert_num, "const_expert_num": const_expert_num},
                            "elastic_info": (elastic_info, None), "performance_info": (performance_info, None),
                            "y_dtype": (y_dtype, None), "x_dtype": (x_dtype, None),
                            "scales_dtype": (scales_dtype, None)})


# ------------------------------------------------------------------------------------------------ combine
def _combine(version: int, expand_x, expert_ids, handle, ep_send_counts, expert_scales, group_ep, ep_world_size,
             ep_rank_id, moe_expert_num, *, x_active_mask, shared_expert_x, tp_world_size, tp_rank_id,
             expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_quant_mode, extra):
    import torch
    name = "npu_moe_distribute_combine" + ("_v2" if version == 2 else "")
    _check_ep(name, group_ep, ep_world_size, ep_rank_id, moe_expert_num, tp_world_size=tp_world_size,
              tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
              shared_expert_rank_num=shared_expert_rank_num, **extra.pop("ep", {}))
    unmodeled(comm_quant_mode=(comm_quant_mode, 0), **extra)
    tensor(expand_x, "expand_x", dtypes=(torch.bfloat16,), ndim=2)
    tensor(handle, "assist_info_for_combine" if version == 2 else "expand_idx", dtypes=(torch.int32,), ndim=1)
    tensor(ep_send_counts, "ep_send_counts", dtypes=(torch.int32,), ndim=1)
    tensor(expert_scales, "expert_scales", dtypes=(torch.float32,), ndim=2)
    bs = int(expert_ids.shape[0]) if hasattr(expert_ids, "shape") else 0
    ids = _active_ids(name, expert_ids, x_active_mask, bs, moe_expert_num)
    if tuple(expert_scales.shape) != ids.shape:
        raise ShapeError(f"{name}: expert_scales must be [BS, K] = {ids.shape}, got {tuple(expert_scales.shape)}")
    if shared_expert_x is not None:
        tensor(shared_expert_x, "shared_expert_x", dtypes=(expand_x.dtype,), ndim=(2, 3))
        shared_expert_x = shared_expert_x.reshape(-1, shared_expert_x.shape[-1])
        if tuple(shared_expert_x.shape) != (bs, expand_x.shape[1]):
            raise ShapeError(f"{name}: shared_expert_x must be [BS={bs}, H={expand_x.shape[1]}] (or [a, b, H] with "
                             f"a * b = BS), got {tuple(shared_expert_x.shape)}")
    payload = {"expand_x": expand_x, "ids": ids, "handle": handle.numpy(), "counts": ep_send_counts.numpy(),
               "scales": expert_scales.numpy(), "shared": shared_expert_x, "group": group_ep}
    return _COMBINE[version](payload, group=group_ep, group_rank=ep_rank_id, group_size=ep_world_size)


def _run_combine(version: int, arrivals: list) -> list:
    name = "npu_moe_distribute_combine" + ("_v2" if version == 2 else "")
    pod = arrivals[0][0].pod
    state = _state(pod, arrivals[0][1]["group"])
    call = _dispatch_call(name, version, state, arrivals)
    group, pending, dispatched_ids, dispatch_version = state.dispatches[call]
    if dispatch_version != version:
        raise ArgumentError(f"{name} follows npu_moe_distribute_dispatch{'_v2' if dispatch_version == 2 else ''}: "
                            f"pair v1 with v1 and v2 with v2")
    res_counts = [out.ep_recv_counts_gm.numpy() for out in pending["outs"]]
    for r, (_, p) in enumerate(arrivals):
        if p["ids"].shape != dispatched_ids[r].shape or (p["ids"] != dispatched_ids[r]).any():
            raise ArgumentError(f"{name}: rank {r}'s expert_ids (and x_active_mask) differ from the ones its dispatch "
                                f"sent: pass the same tensors to combine")
        if p["counts"].shape != res_counts[r].shape or (p["counts"] != res_counts[r]).any():
            raise ArgumentError(f"{name}: rank {r}'s ep_send_counts is not its dispatch's ep_recv_counts")
        rows = pending["outs"][r].rows
        if p["expand_x"].shape[0] < rows or p["expand_x"].shape[1] != group.hidden:
            raise ShapeError(f"{name}: rank {r}'s expand_x must be [>= {rows}, H={group.hidden}] (the rows its "
                             f"dispatch received), got {tuple(p['expand_x'].shape)}")
    shared = [p["shared"] for _, p in arrivals]
    outs = launch_combine([p["expand_x"][:pending["outs"][r].rows] for r, (_, p) in enumerate(arrivals)], pending,
                          [p["scales"] for _, p in arrivals], group,
                          shared_expert_x=None if all(s is None for s in shared) else
                          [s if s is not None else _zeros_like_tokens(p) for s, (_, p) in zip(shared, arrivals)])
    run = pod.synchronize()
    record(pod, name, run)
    del state.dispatches[call]
    return [to_torch(o.numpy()) for o in outs]


def _zeros_like_tokens(payload):
    import torch
    return torch.zeros((payload["ids"].shape[0], payload["expand_x"].shape[1]), dtype=payload["expand_x"].dtype)


def _dispatch_call(name, version, state, arrivals) -> int:
    """The dispatch call a combine belongs to: v2 reads it from assist_info_for_combine, v1 takes the latest and
    checks expand_idx against it."""
    if version == 2:
        calls = set()
        for _, p in arrivals:
            info = p["handle"]
            if info.size % ASSIST_WORDS or not info.size:
                raise ShapeError(f"{name}: assist_info_for_combine must be the [A * 128] tensor dispatch_v2 returned, "
                                 f"got {info.size} words")
            calls |= set(np.unique(info.reshape(-1, ASSIST_WORDS)[:, A_CALL]).tolist())
        if len(calls) != 1 or next(iter(calls)) not in state.dispatches:
            raise ArgumentError(f"{name}: assist_info_for_combine comes from dispatch call(s) {sorted(calls)}, not one "
                                f"of the {sorted(state.dispatches)} still pending on group {arrivals[0][1]['group']!r}")
        return next(iter(calls))
    if not state.dispatches:
        raise ArgumentError(f"{name}: no pending dispatch on group {arrivals[0][1]['group']!r}")
    call = max(state.dispatches)
    pending = state.dispatches[call][1]
    for r, (_, p) in enumerate(arrivals):
        want = pending["plans"][r].slot.reshape(-1).astype(np.int32)
        if p["handle"].shape != want.shape or (p["handle"] != want).any():
            raise ArgumentError(f"{name}: rank {r}'s expand_idx is not the one the latest dispatch returned")
    return call


_COMBINE = {v: Collective("npu_moe_distribute_combine" + ("_v2" if v == 2 else ""),
                          lambda arrivals, v=v: _run_combine(v, arrivals)) for v in (1, 2)}


def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                               activation_scale=None, weight_scale=None, group_list=None, expand_scales=None,
                               shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                               shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, out_dtype=0,
                               comm_quant_mode=0, group_list_type=0):
    """torch_npu.npu_moe_distribute_combine for this rank: expand_x [A, H] bfloat16 (the expert outputs, in the
    dispatch's received-row order), the dispatch's expert_ids, expand_idx and ep_recv_counts (as ep_send_counts),
    expert_scales [BS, K] float32. Returns x [BS, H] bfloat16: sum_k expert_scales[t, k] * row (fp32 math)."""
    return _combine(1, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size,
                    ep_rank_id, moe_expert_num, x_active_mask=x_active_mask, shared_expert_x=None,
                    tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                    shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                    global_bs=global_bs, comm_quant_mode=comm_quant_mode,
                    extra={"tp_send_counts": (tp_send_counts, None), "activation_scale": (activation_scale, None),
                           "weight_scale": (weight_scale, None), "group_list": (group_list, None),
                           "expand_scales": (expand_scales, None), "shared_expert_x": (shared_expert_x, None),
                           "out_dtype": (out_dtype, 0), "group_list_type": (group_list_type, 0)})


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                  const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                                  tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    """torch_npu.npu_moe_distribute_combine_v2: as v1 with dispatch_v2's assist_info_for_combine, plus
    shared_expert_x [BS, H] (or [a, b, H]) added to each token's sum. Returns x [BS, H] bfloat16."""
    return _combine(2, expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                    ep_world_size, ep_rank_id, moe_expert_num, x_active_mask=x_active_mask,
                    shared_expert_x=shared_expert_x, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
                    expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                    shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs,
                    comm_quant_mode=comm_quant_mode,
                    extra={"ep": {"comm_alg": comm_alg, "zero_expert_num": zero_expert_num,
                                  "copy_expert_num": copy_expert_num, "const_expert_num": const_expert_num},
                           "tp_send_counts": (tp_send_counts, None), "expand_scales": (expand_scales, None),
                           "elastic_info": (elastic_info, None), "ori_x": (ori_x, None),
                           "const_expert_alpha_1": (const_expert_alpha_1, None),
                           "const_expert_alpha_2": (const_expert_alpha_2, None),
                           "const_expert_v": (const_expert_v, None), "performance_info": (performance_info, None)})
