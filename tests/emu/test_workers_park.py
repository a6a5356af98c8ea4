"""A launch left parked on a forked worker across ``synchronize`` (ascend_emu/workers.py, journal.py): the workers
that hold it outlive the run, repeat the host's calls made between runs and continue it; the results are the one
process's on 1, 2 and 3 workers over both transports. The workers end when nothing stays parked, at ``Pod.close``,
when the pod is collected and when a run raises; a kept worker that died is named at the next run."""
from __future__ import annotations

import functools
import gc
import os
import signal
import time

import numpy as np
import psutil
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.errors import ArgumentError, EmulatorError, WorkerError
from tests.emu.test_workers import _outcome

DIES = 6                                    # 3 chips: up to 3 workers
SERVERS = (0, 2, 4)                         # one per chip, so each worker holds one
ROWS, COLS, ROUNDS = 8, 64, 3
SPLITS = [(w, t) for w in (2, 3) for t in ("shm", "gloo")]


@kernel(cores="aiv")
def _server(ctx, x, req, out, done, rounds):
    """Serve ``rounds`` requests: wait for ``req`` >= r + 1, add r + 1 to ``x`` (this die's), write the rows to
    ``out`` (another chip's) and count the round on ``done`` (a third chip's)."""
    rows = x.shape[0] // ctx.block_num
    lo = ctx.block_idx * rows
    ub = ctx.ub.alloc((rows, x.shape[1]), "fp32")
    for r in range(rounds):
        yield ctx.wait_gm(req, "ge", r + 1)
        yield ctx.copy_gm_to_ub(ub, x[lo:lo + rows])
        yield ctx.vec.adds(ub, ub, float(r + 1))
        yield ctx.copy_ub_to_gm(out[r][lo:lo + rows], ub)
        yield ctx.atomic_add(done, 1)


@kernel(cores="aiv")
def _feeder(ctx, src, x, req, value):
    """A launch of a later run that feeds a server on another chip: copies ``src`` into its ``x`` and raises its
    ``req`` to ``value``."""
    ub = ctx.ub.alloc(src.shape, "fp32")
    yield ctx.copy_gm_to_ub(ub, src)
    yield ctx.copy_ub_to_gm(x, ub)
    yield ctx.gm_store(req, value, after="all")


def _inputs(d: int, r: int) -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) * (d + 1) + 100 * r)


def _parked_runs(workers: int, transport: str = "auto") -> tuple:
    """Three runs; the servers stay parked after the first two. Between runs: host writes, a direct GM write, GM
    allocated and launches of feeders on other chips."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    x = {d: pod.to_gm(d, _inputs(d, 0)) for d in SERVERS}
    req = {d: pod.alloc(d, (1,), "int32") for d in SERVERS}
    out = {d: pod.alloc((d + 2) % DIES, (ROUNDS, ROWS, COLS), "fp32") for d in SERVERS}
    done = {d: pod.alloc((d + 4) % DIES, (1,), "int32") for d in SERVERS}
    for d in SERVERS:
        pod.stream(d, aiv=2).launch(_server, (x[d], req[d], out[d], done[d], ROUNDS), persistent=True,
                                    name=f"server{d}")
        pod.host_write(req[d], 1)
    runs = [pod.synchronize()]
    assert runs[0].parked == [f"server{d}" for d in SERVERS]
    # run 2: direct GM writes, fresh GM and feeder launches on the next chip raise the requests
    for d in SERVERS:
        x[d].write(_inputs(d, 1))
    src = {d: pod.to_gm((d + 3) % DIES, _inputs(d, 1) + 0.5) for d in SERVERS}
    for d in SERVERS:
        pod.stream((d + 3) % DIES, aiv=1).launch(_feeder, (src[d], x[d], req[d], 2), name=f"feed{d}")
    runs.append(pod.synchronize())
    # run 3: host writes at a later time only
    for d in SERVERS:
        pod.host_write(x[d], _inputs(d, 2))
        pod.host_write(req[d], 3, at_us=pod.now_us + 5.0)
    runs.append(pod.synchronize())
    assert runs[1].parked == [f"server{d}" for d in SERVERS] and runs[2].parked == []
    tensors = list(out.values()) + list(done.values())
    return tuple(_outcome(pod, run, tensors) for run in runs)


@pytest.fixture(scope="module")
def parked_one():
    return _parked_runs(1)


def test_the_parked_servers_compute_what_they_were_fed(parked_one):
    got = parked_one[-1][-1]
    for i, d in enumerate(SERVERS):
        out = np.frombuffer(got[i], np.float32).reshape(ROUNDS, ROWS, COLS)
        np.testing.assert_array_equal(out[0], _inputs(d, 0) + 1)
        np.testing.assert_array_equal(out[1], _inputs(d, 1) + 0.5 + 2)      # the feeder's copy, not the write
        np.testing.assert_array_equal(out[2], _inputs(d, 2) + 3)
        assert np.frombuffer(got[len(SERVERS) + i], np.int32)[0] == 2 * ROUNDS


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a_launch_parked_on_forked_workers_across_runs_matches_one_process(parked_one, workers, transport):
    """Before: the second run raised "stayed parked after the previous run". Now every run's GM, modeled times,
    instruction counts and trace digest are the one process's, and no worker outlives the last run."""
    assert _parked_runs(workers, transport) == parked_one
    assert _children() == []


def test_parked_launches_across_runs_with_jitter_and_the_sanitizer_match_one_process(parked_one, monkeypatch):
    """The host's jitter draws (a launch's overhead) and the sanitizer's state carry over on the kept workers."""
    import tests.emu.test_workers_park as cases
    real = cases.Pod
    monkeypatch.setattr(cases, "Pod", lambda *a, **kw: real(*a, sanitize="collect", jitter_seed=5, **kw))
    one = _parked_runs(1)
    assert one[1][0] != parked_one[1][0]            # the seed moves the second run's timing
    assert _parked_runs(3, "shm") == one


_TORCHRUN_SCRIPT = """
import hashlib, os
from tests.emu.test_workers_park import _parked_runs
print(os.environ["RANK"], hashlib.sha256(repr(_parked_runs(int(os.environ["WORLD_SIZE"]))).encode()).hexdigest(),
      flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_same_script_in_a_torchrun_job_gives_the_same_runs(parked_one, ranks):
    """The forked workers' results are also those of a torchrun job of as many ranks (each rank keeps its parked
    kernels, Partition.carry)."""
    import hashlib

    from tests.emu.test_workers import torchrun_job
    want = hashlib.sha256(repr(parked_one).encode()).hexdigest()
    assert torchrun_job(_TORCHRUN_SCRIPT, ranks) == [[str(r), want] for r in range(ranks)]


def _release(req, value, la) -> None:
    """A host function (``Launch.on_done``): raise a server's request once the launch ends."""
    la.pod.host_write(req, value)


def _host_function_runs(workers: int, on_done=None) -> tuple:
    """Two runs: the feeders queued between them get a host function that releases the servers' last round."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers)
    x = {d: pod.to_gm(d, _inputs(d, 0)) for d in SERVERS}
    req = {d: pod.alloc(d, (1,), "int32") for d in SERVERS}
    out = {d: pod.alloc((d + 2) % DIES, (ROUNDS, ROWS, COLS), "fp32") for d in SERVERS}
    done = {d: pod.alloc((d + 4) % DIES, (1,), "int32") for d in SERVERS}
    for d in SERVERS:
        pod.stream(d, aiv=2).launch(_server, (x[d], req[d], out[d], done[d], ROUNDS), persistent=True)
        pod.host_write(req[d], 1)
    first = pod.synchronize()
    for d in SERVERS:
        la = pod.stream((d + 3) % DIES, aiv=1).launch(_feeder, (pod.to_gm((d + 3) % DIES, _inputs(d, 1)), x[d],
                                                                req[d], 2))
        la.on_done.append(on_done or functools.partial(_release, req[d], 3))
    run = pod.synchronize()
    assert run.parked == []
    return _outcome(pod, first, []) + _outcome(pod, run, list(out.values()) + list(done.values()))


def test_host_functions_given_to_launches_between_runs_run_on_the_kept_workers():
    one = _host_function_runs(1)
    assert [np.frombuffer(c, np.int32)[0] for c in one[-1][len(SERVERS):]] == [2 * ROUNDS] * len(SERVERS)
    assert _host_function_runs(2) == one and _children() == []


def test_a_host_function_the_workers_cannot_run_is_named_at_the_next_run():
    with pytest.raises(ArgumentError, match=r"launch.on_done: .*"):
        _host_function_runs(2, on_done=lambda la: None)
    assert _children() == []


# ------------------------------------------------------------------------------------ the workers' lifetime
def _children() -> list:
    """This process's forked workers (multiprocessing's resource tracker, which shared memory starts, is not one)."""
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())]


def _parked_pod(workers: int = 3, transport: str = "auto") -> tuple:
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    x = {d: pod.to_gm(d, _inputs(d, 0)) for d in SERVERS}
    req = {d: pod.alloc(d, (1,), "int32") for d in SERVERS}
    out = {d: pod.alloc(d, (ROUNDS, ROWS, COLS), "fp32") for d in SERVERS}
    done = {d: pod.alloc(d, (1,), "int32") for d in SERVERS}
    for d in SERVERS:
        pod.stream(d, aiv=2).launch(_server, (x[d], req[d], out[d], done[d], ROUNDS), persistent=True)
    pod.synchronize()
    assert len(_children()) == workers - 1
    return pod, req


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_kept_worker_killed_between_runs_is_named_at_the_next_run(transport):
    pod, req = _parked_pod(3, transport)
    os.kill(pod._live.children[2][0], signal.SIGKILL)
    pod.host_write(req[4], 1)
    began = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker 2 \(dies 4..5\) died .*\(killed by signal 9\)"):
        pod.synchronize()
    assert time.monotonic() - began < 10.0 and _children() == []
    # the pod stays usable: the parked launches ended with the error, a new one runs on fresh workers
    pod.stream(0, aiv=1).launch(_feeder, (pod.alloc(0, (4, 8), "fp32"), pod.alloc(2, (4, 8), "fp32"),
                                          req[2], 7))
    pod.synchronize()
    assert int(req[2].numpy()[0]) == 7 and _children() == []


def test_the_workers_end_at_close_and_when_the_pod_is_collected():
    pod, _ = _parked_pod()
    pod.close()
    assert _children() == []
    pod, _ = _parked_pod(2)
    del pod
    gc.collect()
    assert _children() == []


@kernel(cores="aiv")
def _bad(ctx, t):
    yield ctx.copy_gm_to_ub(ctx.ub.alloc((4,), "fp32"), t[0:9])     # a shape mismatch: the run raises


def test_a_run_that_raises_ends_the_kept_workers():
    pod, _ = _parked_pod()
    pod.stream(1, aiv=1).launch(_bad, (pod.alloc(1, (16,), "fp32"),))
    with pytest.raises(EmulatorError):
        pod.synchronize()
    assert _children() == []


def test_a_call_the_workers_cannot_repeat_is_refused_before_it_changes_the_pod():
    """A lambda kernel cannot be sent to the kept workers: ArgumentError names the call, nothing is queued, and
    the parked launches continue."""
    pod, req = _parked_pod(2)
    queued = len(pod._launches)
    with pytest.raises(ArgumentError, match=r"stream.launch: .*module-level @kernel"):
        pod.stream(1).launch(kernel(cores="aiv")(lambda ctx: iter(())), ())
    assert len(pod._launches) == queued
    for d in SERVERS:
        pod.host_write(req[d], ROUNDS)
    run = pod.synchronize()
    assert run.parked == [] and _children() == []
