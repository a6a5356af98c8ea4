"""Rotation mapping: tokens split across replicas within one token of even; the gather is exact."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eplb
from eplb import EplbError, map_experts, rotation_table


def _layout(num_experts, num_replicas, num_gpus, seed):
    w = np.random.default_rng(seed).lognormal(0, 1.5, (1, num_experts))
    _, log2phy, logcnt = eplb.rebalance_experts(w, num_replicas, 1, 1, num_gpus)
    return log2phy[0], logcnt[0]


def test_table_rows_rotate_over_replicas():
    log2phy, logcnt = _layout(16, 32, 8, 0)
    table = rotation_table(log2phy, logcnt, 40, offset=3)
    assert table.shape == (40, 16) and table.dtype == np.int32
    for e in range(16):
        c = logcnt[e]
        assert [table[j, e] for j in range(40)] == [log2phy[e, (j + 3) % c] for j in range(40)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), tokens=st.integers(1, 96), k=st.integers(1, 6), offset=st.integers(0, 7))
def test_rank_rotation_is_within_one_token_of_even(seed, tokens, k, offset):
    num_experts = 12
    log2phy, logcnt = _layout(num_experts, 24, 6, seed)
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, 0.3))
    ids = np.stack([rng.choice(num_experts, k, replace=False, p=p) for _ in range(tokens)])
    phys = map_experts(rotation_table(log2phy, logcnt, tokens, offset=offset), ids)
    for e in range(num_experts):
        got = phys[ids == e]
        reps = log2phy[e, :logcnt[e]]
        assert np.isin(got, reps).all()                               # always a replica of the right expert
        n = np.array([(got == r).sum() for r in reps])
        assert n.max() - n.min() <= 1 and n.sum() == (ids == e).sum()


def test_position_rotation_is_even_on_contiguous_tokens_not_in_general():
    log2phy, logcnt = _layout(8, 16, 4, 1)
    e = int(np.argmax(logcnt))
    c = logcnt[e]
    table = rotation_table(log2phy, logcnt, 64)
    ids = np.full((50, 1), e)
    phys = map_experts(table, ids, by="position")
    n = np.array([(phys == r).sum() for r in log2phy[e, :c]])
    assert n.max() - n.min() <= 1
    ids_strided = np.full((64, 1), -1)
    ids_strided[::c] = e                                              # every c-th token: one replica
    phys = map_experts(table, ids_strided, by="position")
    assert len(set(phys[ids_strided >= 0].tolist())) == 1
    rank = map_experts(table, ids_strided, by="rank")                 # the arrival counter fixes it
    assert len(set(rank[ids_strided >= 0].tolist())) == c


def test_padding_and_errors():
    log2phy, logcnt = _layout(8, 16, 4, 2)
    table = rotation_table(log2phy, logcnt, 4)
    out = map_experts(table, np.array([[0, -1], [1, 2]]))
    assert out[0, 1] == -1 and out[0, 0] == log2phy[0, 0]
    with pytest.raises(EplbError, match="expert 8 >= 8"):
        map_experts(table, np.array([[8]]))
    with pytest.raises(EplbError, match="4 rows"):
        map_experts(table, np.zeros((5, 1), dtype=int), by="position")
    with pytest.raises(EplbError, match="by='x'"):
        map_experts(table, np.zeros((1, 1), dtype=int), by="x")
    bad = logcnt.copy()
    bad[3] = 0
    with pytest.raises(EplbError, match="expert 3 has logcnt 0"):
        rotation_table(log2phy, bad, 4)


def test_layered_table():
    w = eplb.skewed_load(3, 16, hot_ratio=6.0, seed=4)
    _, log2phy, logcnt = eplb.rebalance_experts(w, 24, 1, 1, 8)
    t = rotation_table(log2phy, logcnt, 10)
    assert t.shape == (3, 10, 16)
    assert (t[2] == rotation_table(log2phy[2], logcnt[2], 10)).all()
