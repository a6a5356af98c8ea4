"""A pod whose run raised stays usable: the next launch runs as on a fresh pod (same numbers, same modeled time),
and nothing of the failed run (its cores, events, blocked waits, trace slices) leaks into it."""
from __future__ import annotations

import numpy as np
import pytest

from ascend_emu import (AddressError, ArgumentError, DeadlockError, HazardError, KernelError, NumericError, Pod,
                        cloudmatrix384, kernel)


@kernel(cores="aiv")
def double_rows(ctx, x, y):
    """Each AIV doubles its rows of x into y (a kernel that works, to run after a failure)."""
    rows = x.shape[0] // ctx.block_num
    t = ctx.ub.alloc((rows, x.shape[1]), "fp32")
    lo = ctx.block_idx * rows
    yield ctx.copy_gm_to_ub(t, x[lo:lo + rows])
    yield ctx.vec.muls(t, t, 2.0)
    yield ctx.copy_ub_to_gm(y[lo:lo + rows], t)


@kernel(cores="aiv")
def raises_python(ctx, x, y):
    yield from double_rows.fn(ctx, x, y)
    if ctx.block_idx == 1:
        raise ValueError("kernel bug")


@kernel(cores="aiv")
def waits_forever(ctx, x, y):
    flag = ctx.gm_at(x.die, 0, (1,), "int32")          # x's first word as an int: never 7
    yield ctx.copy_gm_to_ub(ctx.ub.alloc((4, 8), "fp32"), x[:4])
    yield ctx.wait_gm(flag, "eq", 7, timeout_us=None)


@kernel(cores="aiv")
def spins(ctx, x, y):
    flag = ctx.gm_at(x.die, 0, (1,), "int32")
    while True:                                          # polls with loads: a livelock, caught by the run bound
        v = yield ctx.gm_load(flag)
        if v[0] == 7:
            break


@kernel(cores="aiv")
def divides_by_zero(ctx, x, y):
    t = ctx.ub.alloc((8,), "int32")
    yield ctx.vec.duplicate(t, 0)
    yield ctx.vec.div(t, t, t)


@kernel(cores="mix")
def oversets_a_flag(ctx, x, y):
    if ctx.is_aic:
        for _ in range(16):
            yield ctx.cross_core_set(1)
    else:
        yield ctx.scalar(10_000)


@kernel(cores="aiv")
def not_a_generator(ctx, x, y):
    return None


FAILURES = [(raises_python, KernelError, {}), (waits_forever, DeadlockError, {}),
            (spins, DeadlockError, {}), (divides_by_zero, NumericError, {}),
            (oversets_a_flag, HazardError, {"aic": 1}), (not_a_generator, KernelError, {})]


def shape_of(trace, start_us):
    """The trace's slices with times relative to the run's start."""
    t0 = int(round(start_us * 1e6))
    return sorted((d, u, tr, n, a - t0, b - t0) for d, u, tr, n, a, b, _ in trace.slices)


def fresh_run():
    pod = Pod(cloudmatrix384(dies=1), max_modeled_us=200)
    x = pod.to_gm(0, np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    y = pod.alloc(0, (64, 8), "fp32")
    return pod, x, y


@pytest.mark.parametrize("bad, exc, cores", FAILURES, ids=[f[0].name for f in FAILURES])
def test_the_launch_after_a_failed_one_runs_as_on_a_fresh_pod(bad, exc, cores):
    pod, x, y = fresh_run()
    with pytest.raises(exc):
        pod.launch(bad, aiv=cores.get("aiv", 4), aic=cores.get("aic"), args=(x, y))
    failed_at = pod.now_us
    pod.invalidate_l2()             # the failed run warmed the L2: start cold, as the fresh pod does
    run = pod.launch(double_rows, aiv=4, args=(x, y))
    assert np.array_equal(y.numpy(), 2 * x.numpy())
    assert run.parked == [] and [la.name for la in run.launches] == ["double_rows"]
    assert run.start_us >= failed_at
    ref_pod, rx, ry = fresh_run()
    ref = ref_pod.launch(double_rows, aiv=4, args=(rx, ry))
    assert run.modeled_us == ref.modeled_us and run.instructions == ref.instructions
    assert run.bytes_moved == ref.bytes_moved
    assert shape_of(run.trace, run.start_us) == shape_of(ref.trace, ref.start_us)
    again = pod.launch(double_rows, aiv=4, args=(x, y))      # and the one after that (a warm L2 on both pods)
    assert again.modeled_us == ref_pod.launch(double_rows, aiv=4, args=(rx, ry)).modeled_us


def test_a_failed_run_ends_every_launch_it_held_and_frees_their_cores():
    pod, x, y = fresh_run()
    other = pod.alloc(0, (64, 8), "fp32")
    s1, s2 = pod.stream(0, aiv=[0, 1, 2, 3]), pod.stream(0, aiv=[4, 5, 6, 7])
    first = s1.launch(double_rows, (x, other))
    broken = s2.launch(raises_python, (x, y))
    queued = s2.launch(double_rows, (x, y))
    with pytest.raises(KernelError, match="kernel bug"):
        pod.synchronize()
    assert broken.error is not None and queued.error is not None and not queued.done
    assert first.done or first.error is not None
    with pytest.raises(ArgumentError, match="never finished"):
        s1.launch(double_rows, (x, y), after=[broken])
    run = pod.launch(double_rows, aiv=[4, 5, 6, 7], args=(x, y))   # the cores the failed launch held
    assert np.array_equal(y.numpy(), 2 * x.numpy())
    assert run.parked == []


def test_a_parked_persistent_launch_is_ended_by_a_later_failure():
    @kernel(cores="aiv")
    def server(ctx, stop):
        yield ctx.wait_gm(stop, "eq", 1)

    pod, x, y = fresh_run()
    stop = pod.alloc(0, (1,), "int32")
    parked = pod.stream(0, aiv=[8]).launch(server, (stop,), persistent=True)
    assert pod.synchronize().parked == ["server"]
    with pytest.raises(KernelError):
        pod.launch(raises_python, aiv=4, args=(x, y))
    assert parked.error is not None
    pod.host_write(stop, 1)
    run = pod.launch(double_rows, aiv=4, args=(x, y))
    assert run.parked == [] and [la.name for la in run.launches] == ["double_rows"]


def test_host_writes_and_faults_still_to_come_survive_a_failed_run():
    @kernel(cores="aiv")
    def wait_host(ctx, flag, out):
        v = yield ctx.wait_gm(flag, "eq", 5)
        yield ctx.gm_store(out, int(v[0]) + 1)

    pod, x, y = fresh_run()
    flag, out = pod.alloc(0, (1,), "int32"), pod.alloc(0, (1,), "int32")
    pod.host_write(flag, 5, at_us=150.0)                 # lands after the failure
    with pytest.raises(KernelError):
        pod.launch(raises_python, aiv=4, args=(x, y))
    assert pod.now_us < 150.0
    run = pod.launch(wait_host, aiv=1, args=(flag, out))
    assert out.numpy()[0] == 6 and run.end_us > 150.0


def test_gm_keeps_what_landed_before_the_error():
    @kernel(cores="aiv")
    def store_then_fail(ctx, flag):
        yield ctx.gm_store(flag, 3)
        yield ctx.pipe_barrier()
        raise RuntimeError("after the store landed")

    pod, x, y = fresh_run()
    flag = pod.alloc(0, (1,), "int32")
    with pytest.raises(KernelError):
        pod.launch(store_then_fail, aiv=1, args=(flag,))
    assert flag.numpy()[0] == 3


def test_the_run_bound_counts_from_each_runs_start():
    """max_modeled_us bounds each run: after a livelock stopped at the bound, later runs get their own."""
    pod, x, y = fresh_run()
    with pytest.raises(DeadlockError, match="bound of 200.0 us"):
        pod.launch(spins, aiv=1, args=(x, y))
    assert pod.now_us >= 200.0
    pod.launch(double_rows, aiv=4, args=(x, y))
    with pytest.raises(DeadlockError, match="bound of 200.0 us"):
        pod.launch(spins, aiv=1, args=(x, y))


def test_a_launch_with_bad_arguments_leaves_nothing_queued():
    pod, x, y = fresh_run()
    with pytest.raises(AddressError):
        pod.launch(double_rows, aiv=49, args=(x, y))
    run = pod.launch(double_rows, aiv=4, args=(x, y))
    assert [la.name for la in run.launches] == ["double_rows"]
