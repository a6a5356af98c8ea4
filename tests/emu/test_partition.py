"""Partitioning a pod's dies over workers (ascend_emu.partition): whole units, contiguous, balanced, every die once;
the look-ahead is the closest cross-worker fabric latency."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import cloudmatrix384
from ascend_emu.errors import ArgumentError
from ascend_emu.partition import lookahead_ps, partition

PROF = cloudmatrix384()


@settings(max_examples=60, deadline=None, database=None)
@given(st.integers(1, 96), st.integers(1, 48), st.sampled_from(["chip", "server"]))
def test_every_die_once_in_whole_contiguous_balanced_units(n_dies, workers, unit):
    key = PROF.chip_of if unit == "chip" else PROF.server_of
    units = len({key(d) for d in range(n_dies)})
    if workers > units:
        with pytest.raises(ArgumentError, match="workers="):
            partition(PROF, n_dies, workers, unit)
        return
    parts = partition(PROF, n_dies, workers, unit)
    got = [parts.dies_of(w) for w in range(workers)]
    assert sorted(d for dies in got for d in dies) == list(range(n_dies))
    assert all(dies for dies in got)                                   # nobody idle
    assert [d for dies in got for d in dies] == list(range(n_dies))     # contiguous, in worker order
    for d in range(n_dies):                                             # a unit never split
        assert parts.worker_of(d) == parts.worker_of(min(x for x in range(n_dies) if key(x) == key(d)))
    sizes = [len(dies) for dies in got]
    per_unit = PROF.dies_per_chip * (1 if unit == "chip" else PROF.chips_per_server)
    assert max(sizes) - min(sizes) <= 2 * per_unit                      # as even as whole units allow


def test_examples():
    parts = partition(PROF, 8, 3)                  # 4 chips of 2 dies over 3 workers
    assert [parts.dies_of(w) for w in range(3)] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert partition(PROF, [32, 33, 34, 35], 2).owner == {32: 0, 33: 0, 34: 1, 35: 1}


def test_lookahead_is_the_closest_cross_worker_fabric_latency():
    one = partition(PROF, 8, 1)
    assert lookahead_ps(PROF, one) == 0
    same_server = partition(PROF, 16, 2)           # chips of one server on both workers
    assert lookahead_ps(PROF, same_server) == int(PROF.fabric_latency_ns * 1000)
    by_server = partition(PROF, 32, 2, unit="server")
    assert lookahead_ps(PROF, by_server) == int((PROF.fabric_latency_ns + PROF.inter_node_latency_ns) * 1000)
    assert lookahead_ps(PROF, same_server, jitter=0.25) == int(PROF.fabric_latency_ns * 1000 * 0.75)


def test_bad_arguments():
    with pytest.raises(ArgumentError, match="unit="):
        partition(PROF, 8, 2, unit="die")
    with pytest.raises(ArgumentError, match="dies"):
        partition(PROF, [PROF.dies], 1)
    with pytest.raises(ArgumentError, match="worker="):
        partition(PROF, 8, 2).dies_of(2)
    with pytest.raises(ArgumentError, match="die 9"):
        partition(PROF, 8, 2).worker_of(9)
