"""Drifting loads keep both objectives; log2phy has vLLM's fixed width; static results stay as they were."""
import hashlib

import numpy as np
import pytest

import eplb
from eplb import EplbError, rebalance_experts

SLICES, LAYERS, EXPERTS, DIES, REDUNDANT = 16, 16, 256, 288, 32


def _ratios(w, algo, **kw):
    phy2log = rebalance_experts(w, DIES, 8, 1, DIES, algo=algo, **kw)[0]
    rep = eplb.balance_report(w, phy2log, DIES)
    return rep.overall_sliced, rep.overall


@pytest.mark.parametrize("seed", range(5))
def test_hopping_hot_experts_keep_both_objectives(seed):
    """16 slices, the hot experts move every slice, hottest 30x the mean, 288 dies x 1 slot, R = 32."""
    w = eplb.hopping_load(SLICES, LAYERS, EXPERTS, hot_ratio=30.0, seed=seed)
    ratio = w.max(-1) / w.mean(-1)
    assert np.allclose(ratio, 30.0, rtol=0.05)                          # every slice as hot as asked
    hot = w.argmax(-1)
    assert (hot[1:] != hot[:-1]).mean() > 0.9                            # and the hottest expert moves
    static_slice, static_agg = _ratios(w, "static")
    sliced_slice, sliced_agg = _ratios(w, "sliced")
    assert sliced_slice < 0.97 * static_slice                            # per slice: visibly below static
    assert sliced_agg <= 1.10 * static_agg                               # aggregate: within 10 % of static
    # without the aggregate floor the per-slice objective alone gives up the aggregate (the issue's ~50 %)
    _, unconstrained_agg = _ratios(w, "sliced", aggregate_tolerance=None)
    assert unconstrained_agg > 1.25 * static_agg


@pytest.mark.parametrize("tolerance", [0.0, 0.03, 0.08])
def test_aggregate_floor_bounds_the_summed_load_exactly(tolerance):
    """One slot per die: the hottest die of the summed load is the hottest replica, so the floor is a guarantee."""
    w = eplb.drifting_load(8, 4, 64, drift=2.0, seed=3)
    static = rebalance_experts(w, 80, 1, 1, 80, algo="static")[2]
    counts = rebalance_experts(w, 80, 1, 1, 80, aggregate_tolerance=tolerance)[2]
    total = w.sum(0)
    best, got = (total / static).max(-1), (total / counts).max(-1)
    assert (got <= (1 + tolerance) * best * (1 + 1e-12)).all()
    if tolerance == 0.0:
        assert np.allclose(got, best)


def test_log2phy_width_defaults_to_vllm():
    w = eplb.skewed_load(3, 16, hot_ratio=8.0, seed=1)
    _, log2phy, logcnt = rebalance_experts(w, 24, 1, 1, 8)
    assert log2phy.shape == (3, 16, 24 - 16 + 1) and logcnt.max() < log2phy.shape[-1]
    _, wide, _ = rebalance_experts(w, 24, 1, 1, 8, log2phy_width=12)
    assert wide.shape == (3, 16, 12)
    assert (wide[..., :9] == log2phy).all() and (wide[..., 9:] == -1).all()
    with pytest.raises(EplbError, match="log2phy_width=4 is below num_redundant_experts"):
        rebalance_experts(w, 24, 1, 1, 8, log2phy_width=4)
    table = eplb.rotation_table(log2phy[0], logcnt[0], 10)              # the mapping takes any width
    assert (table == eplb.rotation_table(wide[0], logcnt[0], 10)).all()


def test_static_results_unchanged():
    """Digest of static layouts (and one-slice sliced ones) from before the drifting-load work."""
    h = hashlib.sha256()
    for seed in range(3):
        for num_replicas, num_gpus, groups, nodes in [(288, 288, 8, 1), (320, 64, 8, 1), (96, 8, 8, 2)]:
            w = eplb.drifting_load(4, 6, 64 if num_replicas == 96 else 256, drift=1.0, seed=seed)
            phy2log, _, logcnt = rebalance_experts(w, num_replicas, groups, nodes, num_gpus, algo="static")
            h.update(phy2log.tobytes())
            h.update(logcnt.tobytes())
            phy2log, _, logcnt = rebalance_experts(w[0], num_replicas, groups, nodes, num_gpus)
            h.update(phy2log.tobytes())
            h.update(logcnt.tobytes())
    assert h.hexdigest() == "b473206498771afaad8970177416d992a8806a259edffa737b84d8f56d678333"
