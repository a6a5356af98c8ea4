"""get_dispatch_layout has DeepEP's semantics (-1 masked); the buffer hints equal what a MoeGroup allocates."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kernels
from ascend_emu import ArgumentError, DTypeError, Pod, ShapeError, cloudmatrix384
from kernels import MoeGroup, get_dispatch_layout


def deepep_layout(topk_idx, num_experts, num_ranks):
    """DeepEP's definition, token by token: a token counts once for each rank holding any of its experts."""
    per_rank = np.zeros(num_ranks, np.int64)
    per_expert = np.zeros(num_experts, np.int64)
    in_rank = np.zeros((len(topk_idx), num_ranks), bool)
    epr = num_experts // num_ranks
    for t, row in enumerate(topk_idx):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // epr] = True
        per_rank += in_rank[t]
    return per_rank, per_expert, in_rank


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 40), topk=st.integers(1, 8),
       ranks=st.sampled_from([1, 2, 4, 8]), epr=st.integers(1, 6), masked=st.floats(0, 0.6),
       dtype=st.sampled_from([torch.int64, torch.int32]))
def test_equals_deepep_semantics_on_random_routings(seed, tokens, topk, ranks, epr, masked, dtype):
    num_experts = ranks * epr
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num_experts, (tokens, topk))                 # repeats allowed: each selection counts
    idx[rng.random(idx.shape) < masked] = -1
    got = get_dispatch_layout(torch.as_tensor(idx, dtype=dtype), num_experts, ranks)
    per_rank, per_expert, in_rank = deepep_layout(idx, num_experts, ranks)
    assert got.num_tokens_per_rank.dtype == torch.int32 and got.num_tokens_per_expert.dtype == torch.int32
    assert got.is_token_in_rank.dtype == torch.bool and got.is_token_in_rank.shape == (tokens, ranks)
    assert (got.num_tokens_per_rank.numpy() == per_rank).all()
    assert (got.num_tokens_per_expert.numpy() == per_expert).all()
    assert (got.is_token_in_rank.numpy() == in_rank).all()


def test_layout_matches_what_the_fused_dispatch_receives():
    ranks, bs, hidden, topk, num_experts = 4, 9, 64, 3, 16
    rng = np.random.default_rng(3)
    ids = [np.stack([rng.permutation(num_experts)[:topk] for _ in range(bs)]) for _ in range(ranks)]
    for i in ids:
        i[rng.random(i.shape) < 0.2] = -1
    xs = [torch.randn(bs, hidden).bfloat16() for _ in range(ranks)]
    pod = Pod(cloudmatrix384(dies=ranks), trace=False)
    group = MoeGroup(pod, range(ranks), max_bs=bs, hidden=hidden, topk=topk, num_experts=num_experts)
    res = kernels.moe_distribute_dispatch(xs, ids, group)
    layouts = [get_dispatch_layout(torch.as_tensor(i), num_experts, ranks) for i in ids]
    per_expert = sum(lay.num_tokens_per_expert for lay in layouts).numpy()
    epr = num_experts // ranks
    for d in range(ranks):
        assert (res.expert_token_nums[d] == per_expert[d * epr:(d + 1) * epr]).all()
    for r, lay in enumerate(layouts):                          # is_token_in_rank: the ranks a token's rows go to
        dest = res.handle["plans"][r].dest
        want = np.zeros((bs, ranks), bool)
        for t, k in zip(*np.nonzero(dest >= 0)):
            want[t, dest[t, k]] = True
        assert (lay.is_token_in_rank.numpy() == want).all()


@pytest.mark.parametrize("ranks, bs, hidden, topk, num_experts, quant",
                         [(4, 9, 64, 3, 16, True), (2, 5, 96, 2, 8, False), (8, 128, 7168, 8, 256, True)])
def test_buffer_hints_equal_the_group_allocations(ranks, bs, hidden, topk, num_experts, quant):
    pod = Pod(cloudmatrix384(dies=ranks), trace=False)
    group = MoeGroup(pod, range(ranks), max_bs=bs, hidden=hidden, topk=topk, num_experts=num_experts, quant=quant,
                     phantom=True)
    kw = dict(max_bs=bs, hidden=hidden, num_ranks=ranks, num_experts=num_experts, topk=topk, quant=quant)
    layout = {t.name: t for t in kernels.moe_buffer_layout(**kw)}
    allocated = {"dispatch_win": group.dispatch_win[0], "status": group.status[0],
                 "combine_win": group.combine_win[0], "arrivals": group.counters[0]}
    for name, gm in allocated.items():
        t = layout[name]
        assert t.shape == tuple(gm.shape) and t.nbytes == gm.nbytes
        assert t.dtype == str(gm.dtype).replace("bfloat16", "bf16")
    assert kernels.dispatch_buffer_size_hint(**kw) == group.window_bytes() + group.status[0].nbytes
    assert kernels.combine_buffer_size_hint(**kw) == group.combine_win[0].nbytes + group.counters[0].nbytes
    assert all(t.meaning and t.sentinel for t in layout.values())


def test_bad_arguments():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ArgumentError, match="num_experts=10 must be a multiple of num_ranks=4"):
        get_dispatch_layout(idx, 10, 4)
    with pytest.raises(ArgumentError, match="ids must lie in -1..7"):
        get_dispatch_layout(idx - 2, 8, 4)
    with pytest.raises(DTypeError, match="topk_idx dtype torch.float32"):
        get_dispatch_layout(idx.float(), 8, 4)
    with pytest.raises(ShapeError, match="topk_idx must be"):
        get_dispatch_layout(idx[0], 8, 4)
    with pytest.raises(ArgumentError, match="max_bs=0 must be a positive int"):
        kernels.moe_buffer_layout(max_bs=0, hidden=64, num_ranks=2, num_experts=4, topk=2)
