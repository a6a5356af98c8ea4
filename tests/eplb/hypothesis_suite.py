"""Hypothesis sweep over eplb's public entry points: bad shapes, dtypes, NaN/inf/negative loads, out-of-range and
non-integer ids. The only allowed outcomes are an EplbError naming the argument or a valid result.

Not collected on its own (no ``test_`` prefix): ``test_fuzz.py`` runs it in a subprocess with a timeout and
NUMBA_BOUNDSCHECK=1, so an out-of-bounds access inside numba code fails as an IndexError (or a crash fails the
parent test) instead of corrupting memory or killing the test run.
"""
import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

import eplb
from eplb import EplbError

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(call, names, check):
    """Run ``call``; an EplbError must name one of ``names``; a result must pass ``check``."""
    try:
        result = call()
    except EplbError as e:
        assert any(n in str(e) for n in names), f"EplbError names none of {names}: {e}"
        event(f"{call.__qualname__.split('.')[0]}: EplbError")
        return None
    check(result)
    event(f"{call.__qualname__.split('.')[0]}: valid result")
    return result


BAD_VALUES = [np.nan, np.inf, -1.0, -np.inf]


@st.composite
def loads(draw, shape):
    """A valid load of ``shape`` in some container, or (one time in three) one corrupted load."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    w = rng.lognormal(0, 1, shape) * 10
    fault = draw(st.sampled_from(["none"] * 12 + ["value", "shape", "empty", "dtype"]))
    if fault == "value":
        w.reshape(-1)[draw(st.integers(0, w.size - 1))] = draw(st.sampled_from(BAD_VALUES))
    elif fault == "shape":
        w = w.reshape(-1) if draw(st.booleans()) else w[None, None]
    elif fault == "empty":
        w = w[..., :0]
    elif fault == "dtype":
        return np.array(["a"] * w.size).reshape(w.shape) if draw(st.booleans()) else w.astype(bool)
    kind = draw(st.sampled_from(["numpy", "torch", "int", "list"]))
    if kind == "torch":
        return torch.tensor(w)
    if kind == "int":
        return np.nan_to_num(w, posinf=1e9, neginf=-1e9).astype(np.int64)
    return w.tolist() if kind == "list" else w


def ids(draw, shape, num_experts, low=-1):
    """Integer ids in low..num_experts - 1, or (one time in three) with an out-of-range or non-integral entry."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    a = rng.integers(low, max(num_experts, 1), size=shape)
    fault = draw(st.sampled_from(["none", "none", "none", "range", "float", "whole_float"]))
    if fault == "range" and a.size:
        a.reshape(-1)[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([-7, num_experts, 10**9, -2**40]))
    if fault == "float":
        return a + 0.5
    if fault == "whole_float":
        return a.astype(np.float64)
    return a


def maybe(draw, good, *bad):
    """``good`` five times in six, else one of ``bad``."""
    return good if draw(st.integers(0, 5)) < 5 or not bad else draw(st.sampled_from(bad))


def check_layout(phy2log, log2phy, logcnt, num_experts, num_replicas, num_gpus, width=None):
    num_layers = phy2log.shape[0]
    assert phy2log.shape == (num_layers, num_replicas) and phy2log.dtype == np.int64
    assert ((phy2log >= 0) & (phy2log < num_experts)).all()
    assert (logcnt >= 1).all() and (logcnt.sum(1) == num_replicas).all()
    assert log2phy.shape == (num_layers, num_experts, width or num_replicas - num_experts + 1)
    slots = num_replicas // num_gpus
    for layer in range(num_layers):
        for die in range(num_gpus):
            held = phy2log[layer, die * slots:(die + 1) * slots]
            assert len(set(held.tolist())) == len(held)
        for e in range(num_experts):
            c = logcnt[layer, e]
            assert sorted(log2phy[layer, e, :c].tolist()) == np.flatnonzero(phy2log[layer] == e).tolist()
            assert (log2phy[layer, e, c:] == -1).all()


def test_boundscheck_is_on():
    """numba indexes with bounds checks in this process: an out-of-range id raises IndexError."""
    from eplb.placement import _place_all
    assert numba.config.BOUNDSCHECK
    keep = np.full((1, 4), 10**6, np.int64)
    with pytest.raises(IndexError):
        _place_all(np.ones((1, 4)), np.ones((1, 4), np.int64), 4, 1, keep, True, 0, np.empty((1, 4), np.int64))


@SETTINGS
@given(data=st.data())
def test_rebalance_experts(data):
    draw = data.draw
    num_experts, num_layers, num_slices = draw(st.integers(1, 12)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    num_gpus = draw(st.integers(1, 8))
    slots = draw(st.integers(-(-num_experts // num_gpus), max(-(-num_experts // num_gpus), num_experts)))
    num_replicas = num_gpus * slots
    weight = draw(loads((num_slices, num_layers, num_experts) if num_slices > 1 else (num_layers, num_experts)))
    num_groups, num_nodes = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 1, 2]))
    if num_gpus % num_nodes:
        num_nodes = 1
    bad_num = [0, -3, 2.5, None, True, num_replicas + 1]
    num_replicas = maybe(draw, num_replicas, *bad_num, num_experts * num_gpus + num_gpus)
    num_gpus = maybe(draw, num_gpus, *bad_num)
    algo = maybe(draw, draw(st.sampled_from(["sliced", "static"])), "best")
    tolerance = maybe(draw, draw(st.sampled_from([0.08, None, 0.0])), -0.1, np.nan, "x")
    width = maybe(draw, draw(st.sampled_from([None, 40])), 1, 2.5, 0)
    previous = None
    if draw(st.booleans()) and isinstance(num_replicas, int) and 0 < num_replicas < 100:
        previous = ids(draw, (num_layers + maybe(draw, 0, 1), num_replicas + maybe(draw, 0, -1)), num_experts)

    def check(out):
        assert all(isinstance(o, torch.Tensor) == isinstance(weight, torch.Tensor) for o in out)
        check_layout(*(np.asarray(o) for o in out), num_experts, num_replicas, num_gpus, width)

    outcome(lambda: eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus, algo=algo,
                                           previous=previous, aggregate_tolerance=tolerance, log2phy_width=width),
            ["weight", "num_replicas", "num_groups", "num_nodes", "num_gpus", "algo", "previous",
             "aggregate_tolerance", "log2phy_width", "locality"], check)


@SETTINGS
@given(data=st.data())
def test_shrink(data):
    draw = data.draw
    num_experts, num_gpus, slots = draw(st.integers(1, 10)), draw(st.integers(1, 12)), draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    w = np.random.default_rng(draw(st.integers(0, 99))).lognormal(0, 1, (layers, num_experts))
    if num_gpus * slots >= num_experts and slots <= num_experts and draw(st.integers(0, 3)):
        phy2log = eplb.rebalance_experts(w, num_gpus * slots, 1, 1, num_gpus)[0]
    else:
        phy2log = ids(draw, (layers, num_gpus * slots), num_experts)
    weight = maybe(draw, w, w[:, :max(num_experts - 2, 1)], w[:1], -w, w.T)
    failed = draw(st.lists(st.integers(0, num_gpus - 1), max_size=3))
    failed = maybe(draw, failed, failed + [num_gpus], [-1], [0.5])
    gpus = maybe(draw, num_gpus, num_gpus + 1, 0, 2.0)

    def check(out):
        new, log2phy, logcnt = out
        die = np.arange(new.shape[1]) // slots
        dead = np.isin(die, failed)
        assert (new[:, dead] == -1).all() and (new[:, ~dead] >= 0).all()
        num = np.shape(weight)[-1]
        assert (logcnt >= 1).all() and logcnt.shape[-1] == num and log2phy.shape[-1] == new.shape[1] - num + 1

    outcome(lambda: eplb.shrink(weight, phy2log, failed, gpus),
            ["weight", "phy2log", "failed", "num_gpus", "slots", "experts", "num_replicas"], check)


@SETTINGS
@given(data=st.data())
def test_place_and_replicate(data):
    draw = data.draw
    layers, num_experts, num_dies = draw(st.integers(1, 3)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    w = rng.lognormal(0, 1, (draw(st.integers(1, 3)), layers, num_experts))
    slots = draw(st.integers(-(-num_experts // num_dies), num_experts))
    num_physical = maybe(draw, num_dies * slots, num_experts - 1, 0, 1.5)
    max_count = maybe(draw, num_dies, np.full(num_experts, num_dies), 1, np.ones(num_experts + 1, int), 0, [[2]])

    def check_counts(c):
        assert c.shape == (layers, num_experts) and (c >= 1).all() and (c.sum(1) == num_physical).all()
        assert (c <= np.broadcast_to(max_count, (num_experts,))).all()

    counts = outcome(lambda: eplb.replicate(w, num_physical, max_count), ["w", "num_replicas", "max_count"],
                     check_counts)
    if counts is None or draw(st.integers(0, 3)) == 0:
        counts = ids(draw, (layers, num_experts), 3, low=0) + 1
    load = maybe(draw, w.sum(0), w.sum(0)[:, :1], w, -w.sum(0))
    keep = None
    if draw(st.booleans()):
        keep = ids(draw, (layers, int(np.asarray(counts).sum(-1).max())), num_experts)

    def check_place(phy2log):
        assert phy2log.shape == (layers, int(counts[0].sum()))
        assert ((phy2log >= 0) & (phy2log < num_experts)).all()

    outcome(lambda: eplb.place(load, counts, num_dies, keep=keep),
            ["load", "counts", "num_dies", "keep", "replicas", "num_gpus"], check_place)


@SETTINGS
@given(data=st.data())
def test_maps_and_reports(data):
    layers, num_experts, num_slots = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8)), data.draw(
        st.integers(1, 16))
    phy2log = ids(data.draw, (layers, num_slots), num_experts)
    num = data.draw(st.sampled_from([num_experts, num_experts - 1, 0]))
    width = data.draw(st.sampled_from([None, 1, 32]))
    out = outcome(lambda: eplb.inverse_map(phy2log, num, width=width), ["phy2log", "num_experts", "width"],
                  lambda r: None)
    weight = data.draw(loads((layers, data.draw(st.sampled_from([num_experts, num_experts, 1])))))
    outcome(lambda: eplb.balance_report(weight, phy2log, data.draw(st.sampled_from([None, 1, 3, 0]))),
            ["weight", "phy2log", "num_gpus", "replica"], lambda r: None)
    if out is not None:
        log2phy, logcnt = out
        outcome(lambda: eplb.rotation_table(log2phy, logcnt, data.draw(st.integers(-1, 9))),
                ["log2phy", "logcnt", "num_tokens"], lambda t: None)
    table = ids(data.draw, (data.draw(st.integers(0, 4)), num_experts), num_slots, low=0)
    topk = ids(data.draw, (data.draw(st.integers(0, 5)), 2), num_experts)
    outcome(lambda: eplb.map_experts(table, topk, by=data.draw(st.sampled_from(["rank", "position", "x"]))),
            ["table", "topk_ids", "by"], lambda m: None)
    new = ids(data.draw, (layers, num_slots + data.draw(st.sampled_from([0, 0, 1]))), num_experts)
    outcome(lambda: eplb.plan_rounds(phy2log, new), ["old", "new", "layer"], lambda r: None)
    col = eplb.LoadCollector(layers, num_experts, num_dies=2)
    outcome(lambda: col.record(topk, layer=data.draw(st.integers(-1, layers)), die=data.draw(st.integers(-1, 2))),
            ["topk_ids", "layer", "die", "num_experts"], lambda r: None)
