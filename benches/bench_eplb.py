"""eplb: rebalance time at paper scale (58 layers x 256 experts) and the per-token cost of collection and mapping.

Run: python -m pytest benches/bench_eplb.py --benchmark-only -q -p no:cacheprovider
Aim: a rebalance at 288 and 320 dies under 50 ms. extra_info carries the resulting max/mean and the lower bound.
"""
from __future__ import annotations

import numpy as np
import pytest

import eplb

LAYERS, EXPERTS = 58, 256


@pytest.fixture(scope="module")
def skewed():
    return eplb.skewed_load(LAYERS, EXPERTS, kind="lognormal", seed=0)


@pytest.fixture(scope="module")
def drifting():
    return eplb.drifting_load(8, LAYERS, EXPERTS, drift=0.4, seed=0)


@pytest.mark.benchmark(group="rebalance 58x256")
@pytest.mark.parametrize("dies, slots", [(288, 1), (320, 1), (64, 5)])
def test_rebalance_static(benchmark, skewed, dies, slots):
    eplb.rebalance_experts(skewed, dies * slots, 8, 1, dies)           # compile / load the Numba cache
    phy2log, _, _ = benchmark(eplb.rebalance_experts, skewed, dies * slots, 8, 1, dies)
    benchmark.extra_info["max_over_mean"] = eplb.balance_report(skewed, phy2log, dies).overall
    benchmark.extra_info["lower_bound"] = float(eplb.lower_bound(skewed, dies * slots, dies).mean())


@pytest.mark.benchmark(group="rebalance 8 slices x 58x256")
@pytest.mark.parametrize("dies", [288, 320])
def test_rebalance_sliced(benchmark, drifting, dies):
    eplb.rebalance_experts(drifting, dies, 8, 1, dies)
    phy2log, _, _ = benchmark(eplb.rebalance_experts, drifting, dies, 8, 1, dies)
    benchmark.extra_info["max_over_mean_sliced"] = eplb.balance_report(drifting, phy2log, dies).overall_sliced


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    tokens, k = 4096, 8
    ids = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :k]
    return ids


@pytest.mark.benchmark(group="per token: 4096 tokens x top-8")
@pytest.mark.parametrize("by", ["rank", "position"])
def test_mapping(benchmark, skewed, batch, by):
    _, log2phy, logcnt = eplb.rebalance_experts(skewed[:1], 320, 8, 1, 320)
    table = eplb.rotation_table(log2phy[0], logcnt[0], len(batch))
    benchmark(eplb.map_experts, table, batch, by=by)
    benchmark.extra_info["us_per_token"] = benchmark.stats.stats.mean * 1e6 / len(batch)


@pytest.mark.benchmark(group="per token: 4096 tokens x top-8")
def test_collect(benchmark, batch):
    col = eplb.LoadCollector(LAYERS, EXPERTS)
    benchmark(col.record, batch, 0)
    benchmark.extra_info["us_per_token"] = benchmark.stats.stats.mean * 1e6 / len(batch)
