"""Load collection: host counter and the Collect emulator kernel count exactly what gating produced."""
import numpy as np
import pytest

from eplb import EplbError, LoadCollector


def test_record_counts_per_die_layer_slice():
    rng = np.random.default_rng(0)
    col = LoadCollector(num_layers=3, num_experts=10, num_dies=2, window=3)
    ref = np.zeros((4, 2, 3, 10), dtype=np.int64)
    for s in range(4):
        for die in range(2):
            ids = rng.integers(-1, 10, (3, 20, 4))
            col.record(ids, die=die)                                  # all layers at once
            one = rng.integers(0, 10, (7, 2))
            col.record(one, layer=1, die=die)
            for layer in range(3):
                ref[s, die, layer] += np.bincount(ids[layer][ids[layer] >= 0], minlength=10)
            ref[s, die, 1] += np.bincount(one.reshape(-1), minlength=10)
        if s < 3:
            col.advance()
    assert (col.loads() == ref[1:].sum(1)).all()                      # window of 3: slices 1..3, oldest first
    assert (col.loads(dies=[1]) == ref[1:, 1]).all()
    assert (col.total() == ref[1:].sum((0, 1))).all()
    merged = LoadCollector.merge([col, col])
    assert (merged.loads() == 2 * col.loads()).all()


def test_record_errors():
    col = LoadCollector(2, 8)
    with pytest.raises(EplbError, match="expert 8 >= num_experts=8"):
        col.record(np.array([[8]]), layer=0)
    with pytest.raises(EplbError, match="layer=2"):
        col.record(np.array([[1]]), layer=2)
    with pytest.raises(EplbError, match="die=1"):
        col.record(np.array([[1]]), layer=0, die=1)
    with pytest.raises(EplbError, match="window=0"):
        LoadCollector(2, 8, window=0)


def test_collect_kernel_matches_bincount():
    from eplb.emu import run_collect
    rng = np.random.default_rng(1)
    ids = rng.integers(-1, 64, (3, 40, 8))
    r = run_collect(ids, 64, cores=4)
    assert (r["counts"] == np.bincount(ids[ids >= 0], minlength=64)).all()
    assert r["modeled_us"] > 0
    col = LoadCollector(1, 64)
    col.add_counts(r["counts"][None])
    assert col.total()[0].sum() == (ids >= 0).sum()
