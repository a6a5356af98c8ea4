"""rebalance_experts speaks DeepSeek EPLB's format: shapes, dtypes, -1 padding, consistency, errors."""
import numpy as np
import pytest
import torch

import eplb
from eplb import EplbError, rebalance_experts


@pytest.fixture(scope="module")
def w():
    return eplb.skewed_load(6, 64, seed=2)


def _check_format(phy2log, log2phy, logcnt, num_layers, num_experts, num_replicas, num_gpus):
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == np.int64
    assert logcnt.shape == (num_layers, num_experts) and logcnt.dtype == np.int64
    # vLLM's fixed width: num_redundant_experts + 1, whatever the load
    assert log2phy.shape == (num_layers, num_experts, num_replicas - num_experts + 1) and log2phy.dtype == np.int64
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_replicas).all()
    slots = num_replicas // num_gpus
    for layer in range(num_layers):
        for e in range(num_experts):
            row = log2phy[layer, e]
            c = logcnt[layer, e]
            assert (row[c:] == -1).all() and (row[:c] >= 0).all()
            assert list(row[:c]) == sorted(np.flatnonzero(phy2log[layer] == e))
            dies = row[:c] // slots
            assert len(set(dies.tolist())) == c, "two replicas of one expert on a die"


@pytest.mark.parametrize("num_replicas, num_gpus", [(64, 64), (72, 72), (80, 16), (96, 8)])
def test_format(w, num_replicas, num_gpus):
    out = rebalance_experts(w, num_replicas, 8, 1, num_gpus)
    _check_format(*out, 6, 64, num_replicas, num_gpus)


def test_time_sliced_input_and_algos():
    w = eplb.drifting_load(4, 3, 32, drift=0.5, seed=1)
    for algo in eplb.ALGOS:
        out = rebalance_experts(w, 48, 4, 1, 16, algo=algo)
        _check_format(*out, 3, 32, 48, 16)
    static = rebalance_experts(w, 48, 4, 1, 16, algo="static")[0]
    assert (static == rebalance_experts(w.sum(0), 48, 4, 1, 16)[0]).all()


def test_torch_in_torch_out(w):
    got = rebalance_experts(torch.tensor(w, dtype=torch.float32), 80, 8, 1, 16)
    ref = rebalance_experts(w.astype(np.float32), 80, 8, 1, 16)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in got)
    assert all((g.numpy() == r).all() for g, r in zip(got, ref))


def test_deterministic(w):
    a = rebalance_experts(w, 80, 8, 1, 16)
    b = rebalance_experts(w.copy(), 80, 8, 1, 16)
    assert all((x == y).all() for x, y in zip(a, b))


def test_static_counts_match_deepseek_greedy(w):
    """One slice: counts equal the 'split the current maximum' greedy (DeepSeek's replicate_experts)."""
    _, _, logcnt = rebalance_experts(w, 96, 8, 1, 96)
    for layer in range(w.shape[0]):
        c = np.ones(64, dtype=np.int64)
        for _ in range(32):
            c[np.argmax(w[layer] / c)] += 1
        assert (logcnt[layer] == c).all()


def test_node_locality_keeps_groups_and_replicas_in_a_node(w):
    num_nodes, num_gpus, num_groups, num_replicas = 2, 8, 8, 96
    phy2log, _, logcnt = rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus)
    slots_node = num_replicas // num_nodes
    group = phy2log // (64 // num_groups)
    node = np.arange(num_replicas) // slots_node
    for layer in range(w.shape[0]):
        node_of_group = {}
        for g, n in zip(group[layer], node):
            assert node_of_group.setdefault(int(g), int(n)) == n, "a group spans two nodes"
        counts = np.bincount(list(node_of_group.values()), minlength=num_nodes)
        assert (counts == num_groups // num_nodes).all()
    global_ = rebalance_experts(w, num_replicas, num_groups, num_nodes, num_gpus, locality="none")[0]
    assert not (global_ == phy2log).all()


@pytest.mark.parametrize("num_replicas, num_gpus", [(80, 16), (80, 80)])
def test_previous_keeps_replicas_in_place(w, num_replicas, num_gpus):
    old = rebalance_experts(w, num_replicas, 8, 1, num_gpus)[0]
    w2 = eplb.skewed_load(6, 64, seed=9)
    new = rebalance_experts(w2, num_replicas, 8, 1, num_gpus, previous=old)[0]
    fresh = rebalance_experts(w2, num_replicas, 8, 1, num_gpus)[0]
    rounds = eplb.plan_rounds(old, new)
    rep_new = eplb.balance_report(w2, new, num_gpus).per_layer
    rep_fresh = eplb.balance_report(w2, fresh, num_gpus).per_layer
    assert (rep_new <= rep_fresh * 1.02 + 1e-12).all()                 # keeping never costs > 2 % balance
    if num_gpus == num_replicas:                # one slot per die: every expert keeps an old slot -> one round
        assert (new == old).mean() > (fresh == old).mean() + 0.2
        assert len(rounds) == 1 and np.allclose(rep_new, rep_fresh)
        assert all(((old[layer] == e) & (new[layer] == e)).any() for layer in range(6) for e in range(64))


@pytest.mark.parametrize("kwargs, msg", [
    (dict(num_replicas=48), "below the 64 logical experts"),
    (dict(num_replicas=81), "multiple of num_gpus"),
    (dict(num_gpus=15, num_replicas=90), "multiple of num_nodes"),
    (dict(algo="best"), "algo='best'"),
    (dict(num_replicas=64 * 17, num_gpus=16), "at most one replica of an expert per die"),
])
def test_errors_name_argument_and_limit(w, kwargs, msg):
    args = dict(num_replicas=80, num_groups=8, num_nodes=2, num_gpus=16)
    args.update(kwargs)
    algo = args.pop("algo", "sliced")
    with pytest.raises(EplbError, match=msg):
        rebalance_experts(w, **args, algo=algo)


def test_bad_weights():
    with pytest.raises(EplbError, match="negative"):
        rebalance_experts(-np.ones((2, 8)), 8, 1, 1, 8)
    with pytest.raises(EplbError, match="NaN"):
        rebalance_experts(np.full((2, 8), np.nan), 8, 1, 1, 8)
    with pytest.raises(EplbError, match="shape"):
        rebalance_experts(np.ones(8), 8, 1, 1, 8)
    assert issubclass(EplbError, ValueError)


def test_zero_load_layer_is_fine():
    w = np.zeros((2, 16))
    phy2log, _, logcnt = rebalance_experts(w, 24, 1, 1, 8)
    assert (logcnt.sum(1) == 24).all()
    assert eplb.balance_report(w, phy2log, 8).overall == 1.0
