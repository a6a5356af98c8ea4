"""Partitions balanced by work (ascend_emu.partition ``weights=``, ``layout=``, ascend_emu.work): whole units, no
worker more than one unit's work over its share, the even split when every die weighs the same; the work estimate
follows the kernels' own estimates and a repeated run's measured events; and any split gives one process's run."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu import workers as workers_module
from ascend_emu.errors import ArgumentError
from ascend_emu.partition import partition
from ascend_emu.work import estimated_work, work_estimate
from tests.emu.test_workers import DIES, _outcome, _protocol, _protocol_run

PROF = cloudmatrix384()


@settings(max_examples=120, deadline=None, database=None)
@given(st.lists(st.floats(0, 1000), min_size=2, max_size=96), st.integers(1, 16),
       st.sampled_from(["chip", "server"]), st.sampled_from(["contiguous", "interleaved"]))
def test_a_weighted_split_is_whole_and_within_one_unit_of_the_share(weights, workers, unit, layout):
    """Contiguous: runs in order, no worker more than one unit's work over its share. Interleaved: the first units
    on different workers, no worker more than one unit's work over another."""
    n = len(weights)
    key = PROF.chip_of if unit == "chip" else PROF.server_of
    units = sorted({key(d) for d in range(n)})
    if workers > len(units):
        return
    parts = partition(PROF, n, workers, unit, weights=weights, layout=layout)
    got = [parts.dies_of(w) for w in range(workers)]
    assert all(got) and sorted(d for dies in got for d in dies) == list(range(n))      # every die once
    first = {u: parts.worker_of(min(x for x in range(n) if key(x) == u)) for u in units}
    assert all(parts.worker_of(d) == first[key(d)] for d in range(n))   # a unit never split
    unit_work = [sum(weights[d] for d in range(n) if key(d) == u) for u in units]
    total = sum(weights)
    loads = [sum(weights[d] for d in dies) for dies in got]
    if layout == "contiguous":
        assert [d for dies in got for d in dies] == list(range(n))     # in order
        assert total == 0 or max(loads) <= total / workers + max(unit_work) + 1e-6 * total
    else:
        assert len({first[u] for u in units[:workers]}) == workers
        assert max(loads) - min(loads) <= max(unit_work) + 1e-6 * total


def test_an_interleaved_split_shares_each_role_of_neighbouring_dies():
    """Two roles in two runs of chips (4 heavy, then 12 light): each worker gets half of each, where the
    contiguous split gives one worker every heavy chip (and the phases they work in) and the other the rest."""
    weights = [30.0] * 8 + [10.0] * 24
    inter = partition(PROF, 32, 2, weights=weights, layout="interleaved")
    for roles in (range(0, 8), range(8, 32)):
        assert [sum(inter.worker_of(d) == w for d in roles) for w in (0, 1)] == [len(roles) // 2] * 2
    contiguous = partition(PROF, 32, 2, weights=weights)
    assert {contiguous.worker_of(d) for d in range(8)} == {0}


def test_a_layout_other_than_the_two_is_refused():
    with pytest.raises(ArgumentError, match="layout='striped'"):
        partition(PROF, 8, 2, layout="striped")


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(1, 96), st.integers(1, 16), st.floats(0.5, 100))
def test_equal_weights_split_as_the_dies_do(n, workers, w):
    if workers > len({PROF.chip_of(d) for d in range(n)}):
        return
    assert partition(PROF, n, workers, weights=[w] * n) == partition(PROF, n, workers)
    assert partition(PROF, n, workers, weights=[0.0] * n) == partition(PROF, n, workers)   # no work: by dies


def test_work_moves_the_cut():
    # 8 chips; the first two carry 3/4 of the work: worker 0 takes them only
    weights = [30.0] * 4 + [1.0] * 12
    assert partition(PROF, 16, 2, weights=weights).dies_of(0) == [0, 1, 2, 3]
    assert partition(PROF, 16, 2).dies_of(0) == list(range(8))
    assert partition(PROF, [4, 5, 6, 7], 2, weights={4: 0.0, 5: 0.0, 6: 5.0, 7: 5.0}).dies_of(1) == [6, 7]


def test_bad_weights():
    with pytest.raises(ArgumentError, match=r"weights\[3\]=-1.0"):
        partition(PROF, 8, 2, weights=[1, 1, 1, -1, 1, 1, 1, 1])
    with pytest.raises(ArgumentError, match=r"weights\[0\]=nan"):
        partition(PROF, 8, 2, weights=[math.nan] + [1] * 7)
    with pytest.raises(ArgumentError, match="no work given for die 5"):
        partition(PROF, 8, 2, weights={d: 1.0 for d in range(5)})
    with pytest.raises(ArgumentError, match="work="):
        kernel(cores="aiv", work=3)(lambda ctx: iter(()))


# ------------------------------------------------------------------------------------ the work estimate
@kernel(cores="aiv", work=lambda die, cores, n: cores * n * (die + 1))
def _hinted(ctx, n):
    for _ in range(n):
        yield ctx.vec.duplicate(ctx.ub.alloc((64,), "fp32"), 1.0)


@kernel(cores="aiv")
def _plain(ctx, n):
    for _ in range(n):
        yield ctx.vec.duplicate(ctx.ub.alloc((64,), "fp32"), 1.0)


def _queued(pod, n=3):
    return [pod.stream(0, aiv=2).launch(_hinted, (n,)), pod.stream(dies=[2, 3], aiv=4).launch(_plain, (n,))]


def test_the_estimate_takes_the_kernels_own_and_counts_other_launches_by_their_cores():
    pod = Pod(cloudmatrix384(dies=4))
    launches = _queued(pod)
    # _hinted on die 0: 2 cores x 3 x 1 = 6, i.e. 3 per core; _plain counts 4 cores x 3 on dies 2 and 3
    assert estimated_work(4, launches) == [6.0, 0.0, 12.0, 12.0]
    assert estimated_work(4, launches[1:]) == [0.0, 0.0, 4.0, 4.0]        # no kernel says: one per core


def test_a_repeated_run_is_split_by_the_events_its_dies_caused_last_time():
    pod = Pod(cloudmatrix384(dies=4))
    launches = _queued(pod)
    first = work_estimate(pod, launches)
    assert first == estimated_work(4, launches)                          # nothing measured yet
    before = list(pod.engine._counts[:4])
    pod.synchronize()
    caused = [float(a - b) for a, b in zip(pod.engine._counts[:4], before)]
    assert caused[1] == 0 and min(caused[0], caused[2], caused[3]) > 0
    assert work_estimate(pod, _queued(pod)) == caused                    # the same launches again: measured
    pod.synchronize()
    other = [pod.stream(1, aiv=1).launch(_plain, (2,))]
    assert work_estimate(pod, other) == [0.0, 1.0, 0.0, 0.0]            # other launches: estimated


def test_the_a2e_estimate_ranks_its_roles_as_their_measured_events():
    """A2E + E2A on 16 attention and 32 expert dies: the estimate per role (attention die, trampoline, partner)
    is within a factor 1.6 of the events each caused, so the split is close to the measured one."""
    from xccl.cli import run_exchange
    captured = {}
    real = Pod.synchronize

    def synchronize(pod):
        captured["estimate"] = estimated_work(pod.profile.dies, [la for la in pod._launches if not la.done])
        return real(pod)
    Pod.synchronize = synchronize
    try:
        grp, _, _, _ = run_exchange(16, 32, 96, 7168, 8, 1, 0, 1, "mtu", 48)
    finally:
        Pod.synchronize = real
    events = np.array(grp.pod.engine._counts[:48], float)
    estimate = np.array(captured["estimate"][:48])
    trampolines = {grp.expert_dies[members[0]] for members in grp.groups}
    roles = {"attention": range(16), "trampoline": sorted(trampolines),
             "partner": [d for d in range(16, 48) if d not in trampolines]}
    ratio = {name: events[list(dies)].mean() / estimate[list(dies)].mean() for name, dies in roles.items()}
    assert max(ratio.values()) / min(ratio.values()) < 2.5
    assert estimate[roles["trampoline"]].mean() > estimate[roles["attention"]].mean() > \
        3 * estimate[roles["partner"]].mean()
    split = [partition(grp.pod.profile, 48, 2, weights=w) for w in (estimate, events)]
    assert abs(len(split[0].dies_of(0)) - len(split[1].dies_of(0))) <= 4


# ------------------------------------------------------------------------------------ any split, one result
@pytest.fixture(scope="module")
def protocol_one():
    return _protocol_run(1)


@settings(max_examples=5, deadline=None, database=None)
@given(st.lists(st.floats(0, 100), min_size=DIES, max_size=DIES), st.sampled_from([2, 3]))
def test_any_weights_give_the_one_process_run(protocol_one, weights, workers):
    real = workers_module.work_estimate
    workers_module.work_estimate = lambda pod, launches: weights
    try:
        assert _protocol_run(workers) == protocol_one
    finally:
        workers_module.work_estimate = real


def test_the_protocol_on_a_lopsided_pod_matches_one_process():
    """Launches on the first chip only: worker 0 gets that chip alone, the others the idle ones; same results."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=DIES), workers=workers)
        src = [pod.to_gm(d, np.full((16, 64), float(d), np.float32)) for d in range(2)]
        dst = [pod.alloc(d, (16, 64), "fp32") for d in range(2)]
        counter = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
        flag = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
        for d in range(2):
            pod.stream(d, aiv=2).launch(_protocol, (src[d], dst[d], counter[4 + d], flag[1 - d], flag[d],
                                                    counter[2 + d], 1))
        return _outcome(pod, pod.synchronize(), dst + counter + flag), pod.worker_stats
    one, _ = go(1)
    got, stats = go(3)
    assert got == one
    assert stats[0]["dies"] == [0, 1]
