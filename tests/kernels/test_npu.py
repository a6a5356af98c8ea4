"""kernels.npu: per-rank scripts written the torch_npu way (one rank's view, torch_npu signatures, unpacking the
documented output tuples), run through ascend_emu.spmd, give exactly what the native per-rank API gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ascend_emu
import kernels
import kernels.npu as torch_npu
from ascend_emu import ArgumentError, DeadlockError, DTypeError, Pod, cloudmatrix384
from kernels import MoeGroup, Ranks
from tests.kernels.test_mla_prolog import make_model

R = 4


def pod_of(n=R):
    return Pod(cloudmatrix384(dies=n), trace=False)


def same(a, b):
    """Bitwise equality of two tensors (bf16 compared through its bits)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ single-rank ops
def test_dynamic_quant_script_equals_native():
    g = gen(0)
    xs = [torch.randn(5 + r, 64, generator=g).bfloat16() for r in range(R)]
    smooth = (torch.rand(64, generator=g) + 0.5).bfloat16()

    def script(rank):
        y, scale = torch_npu.npu_dynamic_quant(xs[rank], smooth_scales=smooth)
        return y, scale

    got = ascend_emu.spmd(script, pod_of(), R)
    ref = kernels.dynamic_quant(Ranks(xs), smooth_scales=smooth)
    for r, (y, scale) in enumerate(got):
        assert same(y, ref.y[r]) and same(scale, ref.scale[r])
    y, scale = torch_npu.npu_dynamic_quant(xs[0], smooth_scales=smooth)     # outside spmd: its own pod
    assert same(y, ref.y[0]) and same(scale, ref.scale[0])


def test_gating_script_equals_native_and_defaults_follow_torch_npu():
    g = gen(1)
    logits = [torch.randn(7, 64, generator=g) for _ in range(R)]
    bias = torch.randn(64, generator=g) * 0.1

    def script(rank):
        y, expert_idx, norm_out = torch_npu.npu_moe_gating_top_k(
            logits[rank], 6, bias=bias, k_group=4, group_count=8, group_select_mode=1, renorm=0, norm_type=1,
            out_flag=True, routed_scaling_factor=2.5, eps=1e-20)
        softmax = torch_npu.npu_moe_gating_top_k(logits[rank], 2)            # torch_npu's default: softmax
        return y, expert_idx, norm_out, softmax

    pod = pod_of()
    got = ascend_emu.spmd(script, pod, R)
    ref = kernels.moe_gating_top_k(Ranks(logits), 6, bias=bias, k_group=4, group_count=8, group_select_mode=1,
                                   norm_type=1, out_flag=True, routed_scaling_factor=2.5)
    soft = kernels.moe_gating_top_k(Ranks(logits), 2, norm_type=0)
    for r, (y, idx, out, (sy, sidx, sout)) in enumerate(got):
        assert same(y, ref.y[r]) and same(idx, ref.expert_idx[r]) and same(out, ref.out[r])
        assert same(sy, soft.y[r]) and same(sidx, soft.expert_idx[r])
        assert sout.shape == (7, 64) and sout.dtype == torch.float32          # out_flag=False: allocated, unset
    assert [name for name, _ in torch_npu.runs(pod)] == ["npu_moe_gating_top_k"] * 2 * R


def int8_operands(g, m, k, n, e):
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (e, k, n), dtype=torch.int8, generator=g)
    return x, w, torch.rand(e, n, generator=g) * 1e-3, torch.rand(m, generator=g) * 1e-2


def test_grouped_matmul_script_equals_native():
    g = gen(2)
    ops = [int8_operands(g, 24 + 8 * r, 64, 64, 3) for r in range(R)]
    counts = [torch.tensor([8, 0, 16 + 8 * r]) for r in range(R)]

    def script(rank):
        x, w, s, pts = ops[rank]
        y = torch_npu.npu_grouped_matmul([x], [w], scale=[s], per_token_scale=[pts], group_list=counts[rank],
                                         split_item=3, group_type=0, group_list_type=1,
                                         output_dtype=torch.bfloat16)[0]
        per_group = torch_npu.npu_grouped_matmul([x], [w[i] for i in range(3)], scale=[s[i] for i in range(3)],
                                                 per_token_scale=[pts], group_list=counts[rank].cumsum(0),
                                                 split_item=0, group_type=0, output_dtype=torch.bfloat16)
        pairs = torch.stack([torch.tensor([2, 1, 0]), counts[rank].flip(0)], 1)          # (group, size) rows
        reordered = torch_npu.npu_grouped_matmul([x], [w], group_list=pairs, split_item=2, group_type=0,
                                                 group_list_type=2, output_dtype=torch.int32)[0]
        return y, per_group, reordered

    got = ascend_emu.spmd(script, pod_of(), R)
    ref = kernels.grouped_matmul(Ranks(o[0] for o in ops), Ranks(o[1] for o in ops), group_list=Ranks(counts),
                                 group_list_type=1, scale=Ranks(o[2] for o in ops),
                                 per_token_scale=Ranks(o[3] for o in ops), output_dtype=torch.bfloat16)
    for r, (y, per_group, reordered) in enumerate(got):
        assert same(y, ref.y[r])
        assert all(same(a, b) for a, b in zip(per_group, torch.split(ref.y[r], counts[r].tolist())))
        x, w = ops[r][:2]
        want = kernels.grouped_matmul(x, w[[2, 1, 0]], group_list=counts[r].flip(0), group_list_type=1,
                                      output_dtype=torch.int32).y
        assert same(reordered, want)


def test_grouped_matmul_ungrouped_pairs():
    g = gen(3)
    xs = [torch.randn(m, 64, generator=g).bfloat16() for m in (3, 9)]
    ws = [torch.randn(64, n, generator=g).bfloat16() for n in (32, 96)]
    ys = torch_npu.npu_grouped_matmul(xs, ws)                       # torch_npu's defaults: split_item 0, no groups
    for x, w, y in zip(xs, ws, ys):
        assert same(y, kernels.grouped_matmul(x, w[None], group_list=[len(x)]).y)


def test_mla_prolog_v3_script_equals_native():
    t, he, hcq, hckv, n, d, dr, bs = 4, 256, 128, 64, 2, 32, 16, 16
    models = [make_model(10 + r, t, he, hcq, hckv, n, d, dr) for r in range(2)]
    caches = [(torch.zeros(2, bs, 1, hckv).bfloat16(), torch.zeros(2, bs, 1, dr).bfloat16()) for _ in range(2)]
    index = torch.tensor([3, 17, 5, 30], dtype=torch.int64)

    def args(m, kv, kr):
        return (m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                m["kv_norm"], m["sin"], m["cos"], kv, kr)

    def script(rank):
        kv, kr = caches[rank]
        query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm = torch_npu.npu_mla_prolog_v3(
            *args(models[rank], kv, kr), cache_index=index, rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6,
            cache_mode="PA_BSND")
        return query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm

    got = ascend_emu.spmd(script, pod_of(2), 2)
    for r, (q, qr, s1, qn, s2) in enumerate(got):
        kv, kr = torch.zeros_like(caches[r][0]), torch.zeros_like(caches[r][1])
        ref = kernels.mla_prolog(*args(models[r], kv, kr), cache_index=index, rmsnorm_epsilon_cq=1e-6,
                                 rmsnorm_epsilon_ckv=1e-6)
        assert same(q, ref.query) and same(qr, ref.query_rope)
        assert same(caches[r][0], kv) and same(caches[r][1], kr)              # caches updated in place
        assert s1.shape == qn.shape == s2.shape == (0,)
    with pytest.raises(ArgumentError, match="cache_index is required"):
        torch_npu.npu_mla_prolog_v3(*args(models[0], *caches[0]))
    with pytest.raises(ArgumentError, match="qc_qr_scale=0.5 is not modeled"):
        torch_npu.npu_mla_prolog_v3(*args(models[0], *caches[0]), cache_index=index, qc_qr_scale=0.5)


# ------------------------------------------------------------------------------------------------ dispatch / combine
BS, H, K, E = 6, 64, 3, 16


def moe_inputs(seed, masked=False):
    g = gen(seed)
    xs = [(torch.randn(BS, H, generator=g)).bfloat16() for _ in range(R)]
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(BS)]).to(torch.int32) for _ in range(R)]
    weights = [torch.rand(BS, K, generator=g) for _ in range(R)]
    masks = [torch.arange(BS) < BS - r for r in range(R)] if masked else [None] * R
    shared = [torch.randn(BS, H, generator=g).bfloat16() for _ in range(R)]
    return xs, ids, weights, masks, shared


def expert(expand_x, scales):
    """The experts between dispatch and combine: dequantise, scale by 2 (exact), back to bf16."""
    return (expand_x.float() * scales[:, None] * 2).bfloat16() if expand_x.dtype == torch.int8 else \
        (expand_x.float() * 2).bfloat16()


@pytest.mark.parametrize("version, quant_mode, masked", [(2, 2, False), (2, 0, True), (1, 2, False)])
def test_dispatch_combine_scripts_equal_native(version, quant_mode, masked):
    xs, ids, weights, masks, shared = moe_inputs(version * 10 + quant_mode, masked)
    dispatch = torch_npu.npu_moe_distribute_dispatch_v2 if version == 2 else torch_npu.npu_moe_distribute_dispatch
    combine = torch_npu.npu_moe_distribute_combine_v2 if version == 2 else torch_npu.npu_moe_distribute_combine

    def script(rank):
        expand_x, dynamic_scales, handle, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = \
            dispatch(xs[rank], ids[rank], "ep", R, rank, E, x_active_mask=masks[rank], quant_mode=quant_mode,
                     global_bs=BS * R)
        y = expert(expand_x, dynamic_scales)
        kw = {"shared_expert_x": shared[rank]} if version == 2 else {}
        out = combine(y, ids[rank], handle, ep_recv_counts, weights[rank], "ep", R, rank, E,
                      x_active_mask=masks[rank], global_bs=BS * R, **kw)
        return expand_x, dynamic_scales, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales, out

    got = ascend_emu.spmd(script, pod_of(), R)
    # the native per-rank API on the same inputs (masked entries as -1)
    pod = pod_of()
    group = MoeGroup(pod, range(R), max_bs=BS, hidden=H, topk=K, num_experts=E, quant=quant_mode == 2)
    native_ids = [np.where(np.repeat(m.numpy()[:, None], K, 1), i.numpy(), -1) if m is not None else i.numpy()
                  for i, m in zip(ids, masks)]
    d = kernels.moe_distribute_dispatch(xs, native_ids, group)
    ys = [expert(kernels.ranks.to_torch(d.expand_x[r]), torch.from_numpy(d.dynamic_scales[r]) if quant_mode else None)
          for r in range(R)]
    outs, _ = kernels.moe_distribute_combine(ys, d, [w.numpy() for w in weights], group,
                                             shared_expert_x=shared if version == 2 else None)
    a = R * BS * min(K, E // R)
    for r, (expand_x, scales, etn, recv, tp_recv, expand_scales, out) in enumerate(got):
        rows = len(d.assist_info_for_combine[r])
        assert expand_x.shape == (a, H) and scales.shape == (a,) and int(etn.sum()) == rows
        assert same(expand_x[:rows], kernels.ranks.to_torch(d.expand_x[r])) and not expand_x[rows:].any()
        if quant_mode:
            assert same(scales[:rows], torch.from_numpy(d.dynamic_scales[r]))
        assert same(etn, torch.from_numpy(d.expert_token_nums[r]))
        assert same(recv, torch.from_numpy(d.ep_recv_counts[r]))
        assert tp_recv.shape == (0,) and expand_scales.shape == (0,)
        assert same(out, kernels.ranks.to_torch(outs[r]))


def test_collective_misuse_is_a_clear_error():
    xs, ids, weights, _, _ = moe_inputs(5)

    def dispatch(rank, version=2):
        fn = torch_npu.npu_moe_distribute_dispatch_v2 if version == 2 else torch_npu.npu_moe_distribute_dispatch
        return fn(xs[rank], ids[rank], "ep", R, rank, E, quant_mode=2)

    with pytest.raises(ArgumentError, match="runs across ranks: call it from a per-rank function"):
        dispatch(0)
    with pytest.raises(DeadlockError, match=r"spmd rank 0 waits in npu_moe_distribute_dispatch_v2 .* group ranks \[3\]"):
        ascend_emu.spmd(lambda rank: dispatch(rank) if rank != 3 else None, pod_of(), R)
    with pytest.raises(ArgumentError, match="reached npu_moe_distribute_dispatch .* where ranks .* reached "
                                            "npu_moe_distribute_dispatch_v2"):
        ascend_emu.spmd(lambda rank: dispatch(rank, 1 if rank == 2 else 2), pod_of(), R)
    with pytest.raises(ArgumentError, match="expert_ids\\[0, 0\\]=99 out of range 0..15"):
        torch_npu.npu_moe_distribute_dispatch_v2(xs[0], torch.full((BS, K), 99, dtype=torch.int32), "ep", R, 0, E)

    def stale(rank):          # combine fed the outputs of an earlier dispatch after two newer ones
        first = dispatch(rank)
        dispatch(rank)
        dispatch(rank)
        y = expert(first[0], first[1])
        return torch_npu.npu_moe_distribute_combine_v2(y, ids[rank], first[2], first[4], weights[rank], "ep", R,
                                                       rank, E)

    with pytest.raises(ArgumentError, match="assist_info_for_combine comes from dispatch call"):
        ascend_emu.spmd(stale, pod_of(), R)


def test_torch_npu_lists_never_mean_ranks():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ArgumentError, match="x must be a torch.Tensor"):
        torch_npu.npu_dynamic_quant([x, x])
    with pytest.raises(ArgumentError, match="x must be a non-empty list of tensors"):
        torch_npu.npu_grouped_matmul(x, [torch.randn(64, 32).bfloat16()])
    with pytest.raises(DTypeError, match="x dtype torch.float32 not supported"):
        torch_npu.npu_dynamic_quant(x.float())
    with pytest.raises(ArgumentError, match="output_dtype=None gives int8 x an int8"):
        torch_npu.npu_grouped_matmul([x.to(torch.int8)], [torch.zeros(1, 64, 32, dtype=torch.int8)],
                                     group_list=torch.tensor([4]), split_item=3, group_type=0)
