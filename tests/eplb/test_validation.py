"""Every eplb input is checked at the API boundary, before numba code runs (issue 17 item 19)."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb import EplbError

ROOT = Path(__file__).resolve().parents[2]


def run_isolated(code: str, *, env_extra=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a segfault or a hang fails the calling test, not the test run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_previous_with_an_out_of_range_id_is_an_error_not_a_segfault():
    proc = run_isolated("""
        import eplb
        w = eplb.skewed_load(2, 16, hot_ratio=4.0, seed=1)
        old = eplb.rebalance_experts(w, 24, 1, 1, 8)[0].copy()
        old[0, 3] = 10**9
        try:
            eplb.rebalance_experts(w, 24, 1, 1, 8, previous=old)
        except eplb.EplbError as e:
            print("EplbError:", e)
    """)
    assert proc.returncode == 0, f"crashed with {proc.returncode}: {proc.stderr[-2000:]}"
    assert "EplbError: previous[0, 3] holds expert id 1000000000; ids must lie in -1..15" in proc.stdout


def test_shrink_with_loads_for_fewer_experts_than_the_layout():
    w = eplb.skewed_load(2, 16, hot_ratio=4.0, seed=1)
    old = eplb.rebalance_experts(w, 24, 1, 1, 8)[0]
    with pytest.raises(EplbError, match=r"phy2log\[0, \d+\] holds expert id \d+; ids must lie in -1..7 \(8 logical"):
        eplb.shrink(w[:, :8], old, [1], 8)
    with pytest.raises(EplbError, match="phy2log has 2 layers, expected 1"):
        eplb.shrink(w[:1], old, [1], 8)


def test_loads_shorter_than_the_counts():
    w = eplb.skewed_load(2, 16, hot_ratio=4.0, seed=1)
    counts = np.full((2, 16), 2, dtype=np.int64)
    with pytest.raises(EplbError, match=r"counts has shape \(2, 16\), load has \(2, 4\)"):
        eplb.place(w[:, :4], counts, 8)
    with pytest.raises(EplbError, match="keep has 31 slots, expected 32"):
        eplb.place(w, counts, 8, keep=np.zeros((2, 31), dtype=np.int64))


@pytest.mark.parametrize("call, message", [
    (lambda w: eplb.rebalance_experts(w, 24.0, 1, 1, 8), "num_replicas=24.0 must be an int"),
    (lambda w: eplb.rebalance_experts(w, 24, 1, 1, 8, previous=np.full((2, 24), 0.5)), "previous must hold whole"),
    (lambda w: eplb.rebalance_experts(w, 24, 1, 1, 8, aggregate_tolerance=float("nan")), "aggregate_tolerance=nan"),
    (lambda w: eplb.rebalance_experts(w.astype(bool), 24, 1, 1, 8), "weight must hold numbers"),
    (lambda w: eplb.rebalance_experts(w[:, :0], 24, 1, 1, 8), "weight has an empty dimension"),
    (lambda w: eplb.replicate(w[None], 24, [8] * 15), r"max_count must be one int or \[experts=16\]"),
    (lambda w: eplb.inverse_map(np.full((2, 4), -2), 16), r"phy2log\[0, 0\] holds expert id -2"),
    (lambda w: eplb.rotation_table(np.zeros((16, 0), int), np.ones(16, int), 4), "log2phy has an empty dimension"),
    (lambda w: eplb.map_experts(np.zeros((4, 16), int), np.array([[1.5, 2]])), "topk_ids must hold whole numbers"),
    (lambda w: eplb.LoadCollector(2, 16).record(np.zeros((4, 2)), layer=2), "layer=2 must be <= 1"),
    (lambda w: eplb.LoadCollector(2, 16).add_counts(-np.ones((2, 16))), "counts holds -1, below"),
    (lambda w: eplb.plan_rounds(np.zeros((1, 4), int), np.full((1, 4), 1)), "new has no replica of expert 0"),
    (lambda w: eplb.LiveReconfig(np.zeros((1, 4), int), np.r_[[[1, 0, 0, 0]]]).run(0.5, 1), "prefetch_steps must"),
])
def test_errors_name_the_argument(call, message):
    w = eplb.skewed_load(2, 16, hot_ratio=4.0, seed=1)
    with pytest.raises(EplbError, match=message):
        call(w)


def test_plan_rounds_with_sparse_ids_does_not_size_arrays_by_the_id():
    old = np.array([[10**12, 5, 5, 7]])
    new = np.array([[5, 10**12, 7, 7]])
    rounds = eplb.plan_rounds(old, new)
    cur = old.reshape(-1).copy()
    for slots, experts in rounds:
        cur[slots] = experts
    assert (cur == new.reshape(-1)).all()


def test_hypothesis_suite_under_numba_boundscheck(tmp_path):
    """The sweep in ``hypothesis_suite.py`` in a subprocess with NUMBA_BOUNDSCHECK=1 and a timeout. numba's cache
    does not key on the bounds-check flag (a cached unchecked build would be loaded), so the subprocess compiles
    into its own cache directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         str(ROOT / "tests" / "eplb" / "hypothesis_suite.py")],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path)))
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{tail}"
    assert re.search(r"^5 passed", proc.stdout, re.M), tail
