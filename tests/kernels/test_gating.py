"""kernels.moe_gating_top_k / moe_gating_top_k_softmax on the emulator against the torch references.

Accuracy regimes:
- selection (groups, experts, their order, the lowest-index tie-break) is exact: given the kernel's own fp32 scores
  (out_flag=True), ``gating_select_reference`` must return the same expert_idx, bitwise;
- the scores differ from torch.sigmoid / torch.softmax only by the exp implementation: within 8 fp32 ulp
  (rtol 2^-20);
- weights (gather, sum of k, divide, scale): rtol 2^-20 in fp32 (a few roundings of 2^-24 each on either side);
  bf16 outputs: within one bf16 ulp (rtol 2^-7);
- end to end on random logits the indices equal the reference's wherever the reference's decision margin exceeds
  1e-5 (no near-tie that 8 ulp could flip); on inputs with exact ties they must be equal everywhere.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu.errors import ArgumentError, CapacityError, ShapeError
from kernels.gating import (gating_select_reference, moe_gating_top_k, moe_gating_top_k_reference,
                            moe_gating_top_k_softmax, moe_gating_top_k_softmax_reference)

HYP = settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
RTOL = 2.0 ** -20
V3 = dict(k=8, k_group=4, group_count=8, group_select_mode=1, routed_scaling_factor=2.5)


def close(a, b, rtol=RTOL):
    a, b = a.float(), b.float()
    bad = (a - b).abs() > rtol * b.abs() + 1e-30
    assert not bad.any(), f"{int(bad.sum())} differ; worst {(a - b).abs().max():.3g}"


def margins(x, bias, k, k_group, group_count, group_select_mode):
    """Per row: the smallest gap in the reference's decisions (expert ranks 1..k+1, group ranks 1..k_group+1)."""
    s = torch.sigmoid(x.float()) + (bias.float() if bias is not None else 0)
    t, e = s.shape
    gaps = []
    if group_count > 1:
        g = s.view(t, group_count, -1)
        top2 = g.sort(-1, descending=True).values[..., :2]
        gs = top2.sum(-1) if group_select_mode == 1 else top2[..., 0]
        srt = gs.sort(-1, descending=True).values
        gaps.append((srt[:, :k_group] - srt[:, 1:k_group + 1]).abs().min(-1).values)
        order = gs.sort(dim=-1, descending=True, stable=True).indices
        keep = torch.zeros(t, group_count, dtype=torch.bool).scatter_(1, order[:, :k_group], True)
        s = g.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    srt = s.sort(-1, descending=True).values[:, :k + 1]
    gaps.append((srt[:, :-1] - srt[:, 1:]).nan_to_num(posinf=1.0).abs().min(-1).values)
    return torch.stack(gaps).min(0).values


def test_deepseek_v3_routing_end_to_end():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g) * 2
    bias = torch.randn(64, generator=g) * 0.05
    res = moe_gating_top_k(x, bias=bias, out_flag=True, cores=4, trace=False, **V3)
    y, idx, out = moe_gating_top_k_reference(x, bias=bias, **V3)
    close(res.out, out)
    ok = margins(x, bias, 8, 4, 8, 1) > 1e-5
    assert ok.float().mean() > 0.9
    assert torch.equal(res.expert_idx[ok], idx[ok])
    close(res.y[ok], y[ok])
    assert res.expert_idx.dtype == torch.int32 and res.y.dtype == torch.float32
    close(res.y.sum(-1), torch.full((48,), 2.5))             # renormalised, then scaled
    # every chosen expert lies in one of the k_group = 4 kept groups
    assert all(len(set((row // 8).tolist())) <= 4 for row in res.expert_idx)


@given(t=st.integers(1, 40), e_g=st.sampled_from([(16, 4), (32, 8), (64, 8), (48, 1)]), mode=st.sampled_from([0, 1]),
       use_bias=st.booleans(), seed=st.integers(0, 2 ** 31 - 1), data=st.data())
@HYP
def test_selection_exact_on_kernel_scores(t, e_g, mode, use_bias, seed, data):
    e, gc = e_g
    kg = data.draw(st.integers(1, gc))
    k = data.draw(st.integers(1, min(8, e // gc * kg)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1 if use_bias else None
    kw = dict(k_group=kg, group_count=gc, group_select_mode=mode, routed_scaling_factor=1.5)
    res = moe_gating_top_k(x, k, bias=bias, out_flag=True, cores=3, trace=False, **kw)
    w, idx = gating_select_reference(res.out, k, bias=bias, **kw)
    assert torch.equal(res.expert_idx, idx)
    close(res.y, w)


def test_ties_lowest_index_wins():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (40, 64), generator=g).float()      # massive exact ties among scores and groups
    bias = torch.randint(0, 3, (64,), generator=g).float() * 0.25
    res = moe_gating_top_k(x, bias=bias, cores=2, trace=False, **V3)
    y, idx, _ = moe_gating_top_k_reference(x, bias=bias, **V3)
    assert torch.equal(res.expert_idx, idx)
    close(res.y, y)
    zero = moe_gating_top_k(torch.zeros(3, 64), 6, k_group=2, group_count=8, group_select_mode=1, trace=False)
    assert zero.expert_idx.tolist() == [list(range(6))] * 3     # all tie: groups 0, 1 and experts 0..5


def test_softmax_norm_no_renorm_and_bf16_logits():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 32, generator=g).to(torch.bfloat16)
    kw = dict(k_group=2, group_count=4, group_select_mode=0, norm_type=0)
    res = moe_gating_top_k(x, 4, cores=4, trace=False, **kw)
    y, idx, _ = moe_gating_top_k_reference(x, 4, **kw)
    assert res.y.dtype == torch.bfloat16
    assert torch.equal(res.expert_idx, idx)
    close(res.y, y, rtol=2.0 ** -7)
    assert (res.y.float().sum(-1) < 1).all()                  # softmax weights are not renormalised


def test_top_k_softmax_with_finished_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, 16, generator=g)
    fin = torch.zeros(20, dtype=torch.bool)
    fin[[3, 7]] = True
    y, idx, row_idx = moe_gating_top_k_softmax(x, fin, k=3, cores=2, trace=False)
    ry, ridx, rrow = moe_gating_top_k_softmax_reference(x, fin, k=3)
    assert torch.equal(idx, ridx) and torch.equal(row_idx, rrow)
    assert idx[3].tolist() == [16, 16, 16]
    assert row_idx[2].tolist() == [2, 22, 42]
    close(y, ry)


def test_per_rank_stacked_and_list():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 10, 32, generator=g)
    res = moe_gating_top_k(x, 4, k_group=2, group_count=4, group_select_mode=1, out_flag=True, trace=False)
    assert res.expert_idx.shape == (2, 10, 4) and res.y.shape == (2, 10, 4)
    for r in range(2):
        w, idx = gating_select_reference(res.out[r], 4, k_group=2, group_count=4, group_select_mode=1)
        assert torch.equal(res.expert_idx[r], idx)
    lst = moe_gating_top_k([x[0], x[1, :3]], 4, k_group=2, group_count=4, group_select_mode=1, trace=False)
    assert torch.equal(lst.expert_idx[0], res.expert_idx[0]) and torch.equal(lst.expert_idx[1], res.expert_idx[1, :3])
    assert [la.dies for la in lst.run.launches] == [[0], [1]]


def test_timing_only_real_scale():
    x = torch.empty(128, 256, device="meta")
    res = moe_gating_top_k(x, bias=torch.empty(256, device="meta"), numeric=False, trace=False, **V3)
    assert res.y is None and res.expert_idx is None
    assert 0 < res.run.kernel_us < 100


def test_errors_name_the_argument():
    x = torch.randn(4, 64)
    with pytest.raises(ArgumentError, match="k=40"):
        moe_gating_top_k(x, 40, k_group=4, group_count=8)
    with pytest.raises(ShapeError, match="group_count=5"):
        moe_gating_top_k(x, 2, k_group=1, group_count=5)
    with pytest.raises(ArgumentError, match="renorm=1"):
        moe_gating_top_k(x, 2, renorm=1)
    with pytest.raises(ShapeError, match="bias must be"):
        moe_gating_top_k(x, 2, bias=torch.zeros(63))


# ---------------------------------------------------------------------------------------------- non-finite inputs
NAN = float("nan")


@pytest.mark.parametrize("case, match", [
    ("x_nan", r"x holds NaN at token 1, expert 5"),
    ("bias_nan", r"bias holds NaN at expert 7"),
    ("softmax_posinf", r"x token 2 holds \+inf or only -inf: its softmax \(norm_type=0\) is NaN"),
    ("softmax_all_neginf", r"x token 0 holds \+inf or only -inf"),
    ("group_inf_minus_inf", r"bias: group 1 has one \+inf and otherwise -inf"),
])
def test_inputs_whose_scores_would_be_nan_raise_naming_the_argument(case, match):
    """Before: a NaN logit gave expert id 2147483647 (group-limited: one expert four times, plausible weights)."""
    x, bias, kw = torch.randn(4, 64), torch.zeros(64), dict(V3)
    if case == "x_nan":
        x[1, 5] = NAN
    elif case == "bias_nan":
        bias[7] = NAN
    elif case == "softmax_posinf":
        x[2, 3], bias, kw = float("inf"), None, dict(k=4, norm_type=0)
    elif case == "softmax_all_neginf":
        x[0], bias, kw = float("-inf"), None, dict(k=4, norm_type=0)
    else:
        bias[8:16] = float("-inf")
        bias[9] = float("inf")
    with pytest.raises(ArgumentError, match=match):
        moe_gating_top_k(x, bias=bias, trace=False, **kw)


@given(n_x=st.integers(0, 60), n_neg=st.integers(0, 32), n_pos=st.integers(0, 4),
       layout=st.sampled_from([dict(k=6, k_group=2, group_count=4, group_select_mode=1),
                               dict(k=6, k_group=3, group_count=8, group_select_mode=0), dict(k=8)]),
       seed=st.integers(0, 2 ** 31 - 1))
@HYP
def test_infinite_logits_and_biases_select_exactly_like_the_reference(n_x, n_neg, n_pos, layout, seed):
    """+-inf are ordinary values of the order: many -inf (dropped groups, -inf biases) still give k distinct experts
    in the reference's order (before: a retired winner, also -inf, was taken again)."""
    g = torch.Generator().manual_seed(seed)
    x, bias = torch.randn(6, 32, generator=g), torch.randn(32, generator=g) * 0.1
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:n_x]] = float("inf") * (torch.rand(n_x, generator=g) - 0.5).sign()
    order = torch.randperm(32, generator=g)
    bias[order[:n_neg]] = float("-inf")
    bias[order[32 - n_pos:]] = float("inf")
    _check_like_the_reference(x, bias, layout)


def _check_like_the_reference(x, bias, layout):
    try:
        res = moe_gating_top_k(x, bias=bias, cores=2, trace=False, **layout)
    except ArgumentError as err:                     # only the documented NaN case may refuse
        assert "inf - inf = NaN" in str(err)
        return
    y, idx, _ = moe_gating_top_k_reference(x, bias=bias, **layout)
    assert torch.equal(res.expert_idx, idx)
    assert all(len(set(row.tolist())) == layout["k"] for row in res.expert_idx)
    close(res.y, y)


@pytest.mark.parametrize("layout", [V3, dict(k=8)], ids=["v3", "flat"])
def test_the_reproducer_60_neg_inf_biases_gives_distinct_experts(layout):
    bias = torch.zeros(64)
    bias[:60] = float("-inf")
    _check_like_the_reference(torch.randn(4, 64, generator=torch.Generator().manual_seed(1)), bias, layout)


def test_expert_counts_are_planned_against_the_ub():
    """Tokens per tile shrink until the tiles fit: 512 experts run; 2048 raise at plan time naming the count."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(40, 512, generator=g)
    res = moe_gating_top_k(x, 8, k_group=4, group_count=8, group_select_mode=1, cores=2, trace=False)
    _, idx, _ = moe_gating_top_k_reference(x, 8, k_group=4, group_count=8, group_select_mode=1)
    assert torch.equal(res.expert_idx, idx)
    with pytest.raises(CapacityError, match=r"x.shape\[-1\]=2048 experts"):
        moe_gating_top_k(torch.randn(4, 2048), 8, trace=False)


@pytest.mark.parametrize("kw, match", [(dict(k=2.5), "k=2.5"), (dict(k=4, cores=1.5), "cores=1.5"),
                                       (dict(k=4, k_group=1.0, group_count=8), "k_group=1.0")])
def test_non_integer_counts_are_rejected(kw, match):
    with pytest.raises(ArgumentError, match=match):
        moe_gating_top_k(torch.randn(4, 64), trace=False, **kw)
