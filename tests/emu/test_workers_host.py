"""What a partitioned run (ascend_emu/workers.py) does at the host's level gives what one process gives: barriers over
dies of several workers, host functions (``Launch.on_done``) that read GM other workers wrote and queue launches,
persistent launches (the expert service with a server killed), and a timing-only decode layer built by
``serving.step``; on 1, 2 and 3 workers over both transports."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from tests.emu.test_workers import DIES, SPLITS, _outcome

ALL = [(1, "auto")] + SPLITS
PROF = cloudmatrix384(dies=DIES)


# ------------------------------------------------------------------------------------ barriers across workers
@kernel(cores="aiv")
def _staggered(ctx, times, group):
    """Arrive at the barrier at different times (later on later dies); record when each core arrived and left."""
    yield ctx.scalar(400 * (ctx.block_idx + 3 * ctx.rank + 1))
    before = ctx.now_us
    yield ctx.barrier(group)
    yield ctx.gm_store(times[ctx.rank][ctx.block_idx], np.array([before, ctx.now_us], np.float64))


def _barrier_run(workers: int, transport: str, dies: list, group: str, prof) -> tuple:
    pod = Pod(prof, workers=workers, transport=transport)
    times = [pod.alloc(d, (2, 2), "fp64") for d in dies]
    st = pod.stream(dies=dies, aiv=2)
    for _ in range(2):                      # two launches in a row: the barrier word is used again
        st.launch(_staggered, (times, group))
    run = pod.synchronize()
    return _outcome(pod, run, times), [t.numpy() for t in times]


@pytest.mark.parametrize("workers,transport", SPLITS)
@pytest.mark.parametrize("group", ["all", "aiv"])
def test_a_barrier_over_dies_of_several_workers_matches_one_process(workers, transport, group):
    """Arrivals travel to the barrier word's die and the release back as messages (before: refused with 'not yet
    partitionable'); every core leaves at the last arrival plus the modeled barrier time, as in one process."""
    dies = [0, 2, 4]                        # one chip per worker with three
    one, times = _barrier_run(1, "auto", dies, group, PROF)
    assert _barrier_run(workers, transport, dies, group, PROF)[0] == one
    t = np.stack(times)                     # [die, core, (arrived, left)] us
    barrier_us = PROF.barrier_ns / 1e3 + 2 * PROF.fabric_latency_ns / 1e3
    assert t[..., 1] == pytest.approx(np.full(t.shape[:2], t[..., 0].max() + barrier_us), abs=1e-6)


@settings(max_examples=5, deadline=None)
@given(dies=st.lists(st.integers(0, DIES - 1), min_size=2, max_size=DIES, unique=True),
       group=st.sampled_from(["all", "aiv", "die"]), workers=st.sampled_from([2, 3]))
def test_barriers_over_any_dies_match_one_process(dies, group, workers):
    """Any set of dies (in any order: the leader of a chip is the launch's first die on it), any group."""
    one, times = _barrier_run(1, "auto", dies, group, PROF)
    assert _barrier_run(workers, "shm", dies, group, PROF)[0] == one
    if group != "die":
        t = np.stack(times)
        barrier_us = PROF.barrier_ns / 1e3 + 2 * PROF.fabric_latency_ns / 1e3      # over several dies
        assert t[..., 1] == pytest.approx(np.full(t.shape[:2], t[..., 0].max() + barrier_us), abs=1e-6)


def test_a_barrier_between_servers_matches_one_process():
    """Workers on different servers look ahead by the fabric plus the inter-node latency (1.8 us), more than one
    fabric trip (1.2 us) but less than the round trip the chips' notices take: the barrier's messages land after
    the window they were sent in, and the barrier's time is the one process's."""
    prof = cloudmatrix384(dies=32)          # two servers of 16 dies: the workers share none
    assert prof.server_of(0) != prof.server_of(16)
    dies = [0, 1, 16, 18]                   # three chips, two of them on worker 1
    one, times = _barrier_run(1, "auto", dies, "all", prof)
    assert _barrier_run(2, "shm", dies, "all", prof)[0] == one
    t = np.stack(times)
    assert t[..., 1] == pytest.approx(np.full(t.shape[:2], t[..., 0].max() + 3.2), abs=1e-6)


def test_a_barrier_when_the_look_ahead_outlasts_its_round_trip_shortens_the_windows():
    """A profile whose inter-node latency exceeds the fabric's (and with long launch overheads) looks ahead by
    more than the chips' notices take between servers: windows shrink to that round trip while a launch over
    several workers runs, so the notices never land inside the window they were sent in."""
    import dataclasses
    prof = dataclasses.replace(cloudmatrix384(dies=32), inter_node_latency_ns=3000.0, launch_graph_us=20.0)
    dies = [0, 16]
    assert _barrier_run(2, "shm", dies, "all", prof)[0] == _barrier_run(1, "auto", dies, "all", prof)[0]


# ------------------------------------------------------------------------------------ host functions
@kernel(cores="aiv")
def _scale(ctx, src, dst, factor):
    """dst = src * factor (one row block per core)."""
    rows = src.shape[0] // ctx.block_num
    lo = ctx.block_idx * rows
    ub = ctx.ub.alloc((rows, src.shape[1]), "fp32")
    yield ctx.copy_gm_to_ub(ub, src[lo:lo + rows])
    yield ctx.vec.muls(ub, ub, factor)
    yield ctx.copy_ub_to_gm(dst[lo:lo + rows], ub)


def _host_run(workers: int, transport: str) -> tuple:
    """A kernel on die 5 (the last worker's) scales its rows; its host function reads them back, puts their sum
    into new GM on die 0 (worker 0's) and queues a kernel there; that launch's host function queues one on die 3
    reading die 0's result, and writes a flag from the host."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    src = pod.to_gm(5, np.arange(16 * 64, dtype=np.float32).reshape(16, 64))
    mid = pod.alloc(5, (16, 64), "fp32")
    out = pod.alloc(3, (16, 64), "fp32")
    flag = pod.alloc(4, (1,), "int32")
    made, seen = [], []

    def second(la):
        seen.append(made[0].numpy().copy())
        pod.stream(3, aiv=2).launch(_scale, (made[0], out, 0.5))
        pod.host_write(flag, 7)

    def first(la):
        rows = mid.numpy()                  # written on another worker's die
        seen.append(rows.copy())
        made.append(pod.to_gm(0, rows + rows.sum(), name="made"))
        nxt = pod.stream(0, aiv=4).launch(_scale, (made[0], made[0], 2.0))
        nxt.on_done.append(second)

    la = pod.stream(5, aiv=4).launch(_scale, (src, mid, 3.0))
    la.on_done.append(first)
    run = pod.synchronize()
    return _outcome(pod, run, [mid, made[0], out, flag]), seen, pod.worker_stats


@pytest.fixture(scope="module")
def host_one():
    return _host_run(1, "auto")


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a_host_function_reads_gm_another_worker_wrote_and_queues_launches(host_one, workers, transport):
    """Host functions in a partitioned run (before: refused): each is a synchronisation point where every worker
    takes the GM the others' dies wrote, then runs it, so the launches, allocations and host writes it makes
    replicate; every number is the one process's."""
    one, seen_one, _ = host_one
    got, seen, stats = _host_run(workers, transport)
    assert got == one
    for a, b in zip(seen, seen_one):        # what the host functions read in worker 0: the one process's values
        assert np.array_equal(a, b)
    src = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    assert np.array_equal(seen_one[0], src * 3)
    made = (src * 3 + (src * 3).sum()) * 2
    assert np.array_equal(seen_one[1], made)
    assert np.frombuffer(one[-1][2], np.float32).reshape(16, 64) == pytest.approx(made * 0.5)
    assert np.frombuffer(one[-1][3], np.int32)[0] == 7
    assert [s["syncs"] for s in stats] == [2] * workers


# ------------------------------------------------------------------------------------ persistent launches
def _service_run(workers: int, transport: str) -> tuple:
    """The expert service (xccl.service, persistent servers, clients, monitor and heartbeats) with a server
    killed mid-run."""
    from tests.xccl.test_service import CLIENTS, SERVERS, _inputs
    from xccl.service import ExpertService
    w, x, ids, gate = _inputs()
    pod = Pod(cloudmatrix384(dies=8), max_modeled_us=2000.0, workers=workers, transport=transport)
    svc = ExpertService(pod, CLIENTS, SERVERS, num_experts=w.shape[0], hidden=w.shape[1], top_k=ids.shape[-1],
                        max_tokens=ids.shape[2], weights=w)
    res = svc.run(ids.numpy(), x, gate, kill=[(SERVERS[1], 60.0)])
    r = res.run
    return (r.modeled_us, r.instructions, r.trace.digest(), sorted(r.pipe_busy.items()), r.parked,
            res.out.tobytes(), res.completion_us.tobytes(), res.resends.tobytes(), res.row_server.tobytes(),
            sorted(res.dead.items()), [(la.name, la.start_us, la.end_us) for la in r.launches])


@pytest.fixture(scope="module")
def service_one():
    return _service_run(1, "auto")


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_the_expert_service_with_a_server_killed_matches_one_process(service_one, workers, transport):
    """Persistent launches in a partitioned run (before: refused): servers, clients, the monitor and heartbeats
    over 2 and 3 workers, a server killed at 60 us; outputs, completions, resends, detections, times and trace are
    the one process's."""
    assert _service_run(workers, transport) == service_one
    assert service_one[9] and service_one[9][0][0] == 4 and not service_one[4]     # detected, nothing parked


def _pipeline_run(workers: int, transport: str, monkeypatch) -> tuple:
    """serving.expert_pipeline: persistent receive / GEMM / send kernels on 4 expert dies, persistent multi-die
    attention kernels (two domains, two microbatches) on 4 attention dies, numeric."""
    import tests.serving.test_expert_pipeline as cases
    monkeypatch.setattr(cases, "Pod", lambda prof, **kw: Pod(prof, workers=workers, transport=transport))
    res, _ = cases._run(2, 2, E=4)
    run = res.run
    return ([[o.tobytes() for o in layer] for layer in res.out], run.modeled_us, run.instructions,
            run.trace.digest(), sorted(run.pipe_busy.items()), run.parked)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_the_persistent_expert_pipeline_matches_one_process(workers, transport, monkeypatch):
    one = _pipeline_run(1, "auto", monkeypatch)
    assert _pipeline_run(workers, transport, monkeypatch) == one and not one[-1]


@kernel(cores="aiv")
def _park(ctx, stop, count):
    """Serve until the host raises ``stop``: a persistent kernel that parks between runs."""
    yield ctx.wait_gm(stop, "ge", 1)
    yield ctx.atomic_add(count, 1)


def _parked_on_both(workers: int) -> tuple:
    pod = Pod(cloudmatrix384(dies=4), workers=workers)
    stops = [pod.alloc(d, (1,), "int32") for d in (0, 2)]
    counts = [pod.alloc(d, (1,), "int32") for d in (0, 2)]
    for d, stop, count in zip((0, 2), stops, counts):
        pod.stream(d, aiv=1).launch(_park, (stop, count), persistent=True, name=f"park{d}")
    run = pod.synchronize()
    assert run.parked == ["park0", "park2"]
    pod.host_write(stops[0], 1)
    pod.host_write(stops[1], 1)
    return _outcome(pod, run, counts) + _outcome(pod, pod.synchronize(), counts)


def test_a_kernel_parked_on_a_forked_worker_continues_at_the_next_run():
    """A launch left parked on a forked worker's dies continues in the next run, as in one process (before: the
    next run raised "stayed parked after the previous run"; tests/emu/test_workers_park.py covers it in depth);
    parked on worker 0's dies (the parent's) only, it continues too."""
    one = _parked_on_both(1)
    assert _parked_on_both(2) == one and [np.frombuffer(c, np.int32)[0] for c in one[-1]] == [1, 1]
    one = _parked_run(1, die=0)
    assert _parked_run(2, die=0) == one and np.frombuffer(one[-1][0], np.int32)[0] == 2


@kernel(cores="aiv")
def _park_on_first(ctx, stop, count):
    """The launch's first die parks until the host raises ``stop``; the others finish at once."""
    if ctx.rank == 0:
        yield ctx.wait_gm(stop, "ge", 1)
    yield ctx.atomic_add(count, 1)


def _half_parked_run(workers: int, dies: int = 4) -> tuple:
    pod = Pod(cloudmatrix384(dies=dies), workers=workers)
    stop, count = pod.alloc(0, (1,), "int32"), pod.alloc(0, (1,), "int32")
    pod.stream(dies=[0, 2], aiv=2).launch(_park_on_first, (stop, count), persistent=True)
    first = pod.synchronize()
    assert first.parked == ["_park_on_first"]
    pod.host_write(stop, 1)
    run = pod.synchronize()
    return _outcome(pod, first, []) + _outcome(pod, run, [count])


def test_a_launch_parked_only_on_worker_0s_dies_continues_though_its_other_cores_ran_elsewhere():
    """Die 2's cores (worker 1) finish in the first run, die 0's (the parent's) park: nothing of the launch is
    left on worker 1, so the next run continues it as one process does."""
    one = _half_parked_run(1)
    assert _half_parked_run(2) == one and np.frombuffer(one[-1][0], np.int32)[0] == 4


def test_a_launch_parked_in_one_run_continues_on_the_same_split_of_the_dies(monkeypatch):
    """The split follows the work estimate of each run, except while a launch of an earlier run is parked: a torchrun
    rank holds its parked cores, so the next run keeps the split whatever the estimate now says."""
    import ascend_emu.workers as workers_module
    one = _half_parked_run(1, dies=6)
    splits = []
    real = workers_module.partition

    def recorded(*a, **kw):
        parts = real(*a, **kw)
        if "weights" in kw:                 # a run's split (not the check of the worker count)
            splits.append(parts)
        return parts

    monkeypatch.setattr(workers_module, "partition", recorded)
    estimates = iter([[1.0] * 6, [50.0, 50.0, 1.0, 1.0, 1.0, 1.0]])        # the second would move chip 1
    monkeypatch.setattr(workers_module, "work_estimate", lambda pod, launches: next(estimates))
    assert _half_parked_run(2, dies=6) == one
    assert len(splits) == 1 and splits[0].dies_of(0) == [0, 1, 4, 5]


def _parked_run(workers: int, die: int, stop_die: int | None = None) -> tuple:
    """A persistent launch on ``die`` parks in a first run, polling a stop flag on ``stop_die`` (default its
    own), and finishes in a second, after a host write; it counts itself on die 2 (another chip than die 0)."""
    pod = Pod(cloudmatrix384(dies=4), workers=workers)
    stop = pod.alloc(die if stop_die is None else stop_die, (1,), "int32")
    count = pod.alloc(2, (1,), "int32")
    pod.stream(die, aiv=2).launch(_park, (stop, count), persistent=True)
    first = pod.synchronize()
    assert first.parked == ["_park"]
    pod.host_write(stop, 1)
    run = pod.synchronize()
    return _outcome(pod, first, []) + _outcome(pod, run, [count, stop])


_PARKED_SCRIPT = """
import hashlib, os
from tests.emu.test_workers_host import _parked_run
print(os.environ["RANK"], hashlib.sha256(repr(_parked_run(2, die=3, stop_die=0)).encode()).hexdigest(), flush=True)
"""


def test_every_rank_of_a_torchrun_job_keeps_its_parked_kernels_for_the_next_run():
    """In a torchrun job nothing is forked: the rank that runs a parked kernel keeps it, and the next
    synchronize continues it; here it waits in a poll of the other rank's die, whose answer comes in the next
    run (the replies a rank waits for are carried over)."""
    import hashlib
    from tests.emu.test_workers import torchrun_job
    want = hashlib.sha256(repr(_parked_run(1, die=3, stop_die=0)).encode()).hexdigest()
    assert torchrun_job(_PARKED_SCRIPT) == [["0", want], ["1", want]]


# ------------------------------------------------------------------------------------ a timing-only decode layer
def _layer_run(workers: int, transport: str, monkeypatch) -> tuple:
    """One MoE decode layer of the mini config (serving.timing.layer_timing over serving.step's StepPod)."""
    import serving.step as step
    from serving.config import MINI
    from serving.timing import layer_timing
    monkeypatch.setattr(step, "Pod", lambda *a, **kw: Pod(*a, workers=workers, transport=transport, **kw))
    res = layer_timing(MINI, "moe", dies=8, batch_per_die=8, seq_len=128, microbatches=1, trace=True)
    run = res.run
    return (run.modeled_us, run.kernel_us, run.instructions, run.bytes_moved, run.trace.digest(),
            sorted(run.pipe_busy.items()), sorted(run.servers.items()), repr(res), res.schedule, res.received_rows)


@pytest.fixture(scope="module")
def layer_one():
    mp = pytest.MonkeyPatch()
    try:
        return _layer_run(1, "auto", mp)
    finally:
        mp.undo()


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a_timing_only_decode_layer_matches_one_process(layer_one, workers, transport, monkeypatch):
    assert _layer_run(workers, transport, monkeypatch) == layer_one


# ------------------------------------------------------------------------------------ after a run that raises
@kernel(cores="aiv")
def _raise_on_zero(ctx):
    yield ctx.scalar(10)
    if ctx.die == 0:
        raise ValueError("boom")


def test_a_gloo_run_that_raises_in_the_parent_leaves_the_next_gloo_run_possible():
    """The parent's gloo group is destroyed when its run raises (before: it stayed up, and the next forked gloo
    run in the process was refused as 'already belongs to a torch.distributed group')."""
    pod = Pod(cloudmatrix384(dies=4), workers=2, transport="gloo")
    with pytest.raises(Exception, match="boom"):
        pod.launch(_raise_on_zero, dies=[0, 2], aiv=1)
    assert _barrier_run(2, "gloo", [0, 2], "all", cloudmatrix384(dies=4))[0] == \
        _barrier_run(1, "auto", [0, 2], "all", cloudmatrix384(dies=4))[0]


def _host_write_wakes(workers: int) -> tuple:
    pod = Pod(cloudmatrix384(dies=4), workers=workers)
    stop, count = pod.alloc(0, (1,), "int32"), pod.alloc(2, (1,), "int32")
    pod.stream(3, aiv=2).launch(_park, (stop, count))
    pod.host_write(stop, 1, at_us=30.0)
    run = pod.synchronize()
    return _outcome(pod, run, [count])


def test_a_host_write_wakes_a_poll_of_another_workers_core_on_its_word():
    """Die 3's cores (worker 1) poll a word of die 0 (worker 0, where the poll waits); the host writes it
    mid-run. Only worker 0 sees the poll satisfied: it sends the answer though a host event caused it (before:
    every host event's messages were left to the replica on the owner, so the answer was lost and the run ended
    in a deadlock)."""
    one = _host_write_wakes(1)
    assert _host_write_wakes(2) == one and np.frombuffer(one[-1][0], np.int32)[0] == 2


def _runner_run(workers: int, monkeypatch) -> tuple:
    """A numeric prefill and decode step of the mini model over 4 dies (serving.runner.EmulatedRunner): the host
    glue between its kernels (RMSNorm, residuals, routing, argmax) runs in launches' host functions."""
    import serving.step as step
    from serving.config import MINI
    from serving.model import init_weights
    from serving.runner import EmulatedRunner
    from tests.serving.test_step import decode_batches
    monkeypatch.setattr(step, "Pod", lambda *a, **kw: Pod(*a, workers=workers, **kw))
    runner = EmulatedRunner(init_weights(MINI, seed=0), groups=4, microbatches=1)
    prefill, decode = decode_batches(4)
    first = runner.execute(prefill)
    out = runner.execute(decode(first.tokens))
    return first.tokens, first.modeled_us, first.timeline, out.tokens, out.modeled_us, out.timeline, out.breakdown


@pytest.mark.slow
def test_a_numeric_serving_step_with_host_glue_matches_one_process(monkeypatch):
    """serving.step resumes each part in a launch's host function: on two workers the tokens, times and
    timeline are the one process's."""
    one = _runner_run(1, monkeypatch)
    assert _runner_run(2, monkeypatch) == one


@kernel(cores="aiv")
def _wake_and_fill(ctx, words, out):
    yield ctx.wait_gm(words[ctx.block_idx], "ge", 1)
    ub = ctx.ub.alloc((64, 64), "fp32")
    yield ctx.vec.duplicate(ub, float(ctx.block_idx + 1))
    yield ctx.copy_ub_to_gm(out, ub)


def _two_writes(workers: int) -> tuple:
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers)
    words = [pod.alloc(0, (1,), "int32"), pod.alloc(2, (1,), "int32")]
    out = pod.alloc(4, (64, 64), "fp32")
    pod.stream(4, aiv=2).launch(_wake_and_fill, (words, out))
    pod.host_write(words[0], 1, at_us=30.0)
    pod.host_write(words[1], 1, at_us=30.0)
    return _outcome(pod, pod.synchronize(), [out])


def test_host_writes_waking_polls_on_two_workers_keep_the_order_of_one_process():
    """Two host writes at one time, to words of two workers (dies 0 and 2), each wake a poll of die 4 (a third
    worker): the answers come from two workers, each counting its host actions from the same block
    (``Engine._host_block``; before: both answers took the same count and the third worker's event queue could
    not order them, a TypeError comparing instructions)."""
    assert _two_writes(3) == _two_writes(1)
