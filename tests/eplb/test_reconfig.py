"""Live reconfiguration never routes a token to a slot whose weights are not loaded."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eplb
from eplb import EplbError, LiveReconfig, check_no_unloaded_routes, plan_rounds


def _layout(seed, num_layers=2, num_experts=12, num_replicas=18, num_gpus=6, previous=None):
    w = eplb.skewed_load(num_layers, num_experts, hot_ratio=5.0, seed=seed)
    return eplb.rebalance_experts(w, num_replicas, 1, 1, num_gpus, previous=previous)[0]


@settings(max_examples=30, deadline=None)
@given(a=st.integers(0, 1000), b=st.integers(0, 1000), keep=st.booleans(), slots=st.sampled_from([1, 3]),
       durations=st.lists(st.integers(1, 5), min_size=64, max_size=64))
def test_never_routes_to_an_unloaded_slot(a, b, keep, slots, durations):
    gpus = 18 // slots
    old = _layout(a, num_gpus=gpus)
    new = _layout(b, num_gpus=gpus, previous=old if keep else None)
    rc = LiveReconfig(old, new)
    n = len(rc.changed)
    d = np.resize(np.array(durations), 2 * max(n, 1))
    res = rc.run(d[:n], d[n:2 * n])
    check_no_unloaded_routes(res)
    assert (res.final == new).all()
    assert res.steps[0].phase == "serve" and (res.steps[0].mapping == old).all()
    if keep and slots == 1:
        assert len(rc.rounds) <= 1
    phases = [r.phase for r in res.steps]
    for r in range(len(rc.rounds)):                                   # each round: prefetch before load
        mine = [p for p, s in zip(phases, res.steps) if s.round == r]
        assert mine[0] == "prefetch" and "load" in mine and mine.index("load") > mine.index("prefetch")


def test_checker_catches_a_schedule_that_skips_disable():
    old = _layout(1)
    new = _layout(2, previous=old)
    res = LiveReconfig(old, new).run(2, 3)
    for rec in res.steps:                                             # a buggy engine: loads while still routed
        if rec.phase == "load":
            rec.mapping[...] = np.where(rec.mapping < 0, old, rec.mapping)
    with pytest.raises(EplbError, match="holds -1"):
        check_no_unloaded_routes(res)


def test_cycle_goes_through_a_spare_slot_or_raises():
    old = np.array([[0, 1, 2, 2]])
    new = np.array([[1, 0, 2, 2]])                                    # 0 and 1 swap, single replicas
    rounds = plan_rounds(old, new)
    assert len(rounds) > 1
    res = LiveReconfig(old, new).run(1, 1)
    check_no_unloaded_routes(res)
    assert (res.final == new).all()
    with pytest.raises(EplbError, match="no safe order"):
        plan_rounds(np.array([[0, 1]]), np.array([[1, 0]]))            # no spare slot at all


def test_bad_durations():
    old = _layout(1)
    new = _layout(2, previous=old)
    with pytest.raises(EplbError, match="prefetch_steps must be >= 1"):
        LiveReconfig(old, new).run(0, 1)


def test_model_reconfig_on_the_emulator():
    from eplb.emu import model_reconfig
    w = eplb.skewed_load(1, 16, hot_ratio=6.0, seed=3)
    old = eplb.rebalance_experts(w, 20, 1, 1, 20)[0]
    new = eplb.rebalance_experts(eplb.skewed_load(1, 16, hot_ratio=6.0, seed=5), 20, 1, 1, 20, previous=old)[0]
    r = model_reconfig(old, new, 20, expert_bytes=4 << 20, step_bytes=2 << 20, max_steps=40)
    assert r["changed_slots"] == int((old != new).sum()) > 0
    assert 0 <= r["disable_step"] < r["enable_step"]
    assert r["reconfig_us"] > 0 and min(r["prefetch_steps"]) >= 1
    assert r["replay"].steps and (r["replay"].final == new).all()     # replayed and checked inside
    assert r["step_us_during"] >= r["step_us_after"] * 0.999          # weight DMAs only ever slow decode down
