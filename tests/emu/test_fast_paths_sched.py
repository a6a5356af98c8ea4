"""Fast paths of the scheduler's per-instruction work at scale (issue 19): each must leave every modeled number as it
was. A traced run's records and server logs stay off the cyclic GC's lists (compiled build), so the collection after
a run does not walk one object per instruction; a finished pod is freed by reference counting (no reference cycles
between the pod, its streams, launches, cores and engine), its GM with it."""
import gc
import weakref

import numpy as np
import pytest

import ascend_emu
from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.errors import ArgumentError

R, H = 8, 512


@kernel(cores="aiv")
def _scale_rows(ctx, x_gm, y_gm, iters):
    """Each core doubles its (R, H) block ``iters`` times, double-buffered: 3 instructions a step."""
    tiles = ctx.ub.alloc((2, R, H), "fp32")
    for i in range(iters):
        yield ctx.copy_gm_to_ub(tiles[i % 2], x_gm[ctx.block_idx])
        yield ctx.vec.muls(tiles[i % 2], tiles[i % 2], 2.0)
        yield ctx.copy_ub_to_gm(y_gm[ctx.block_idx], tiles[i % 2])


def _run(iters: int, cores: int = 8, numeric: bool = False):
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    x = pod.alloc(0, (cores, R, H), "fp32", phantom=not numeric)
    y = pod.alloc(0, (cores, R, H), "fp32", phantom=not numeric)
    if numeric:
        x.write(np.arange(cores * R * H, dtype=np.float32).reshape(cores, R, H))
    run = pod.launch(_scale_rows, aiv=cores, args=(x, y, iters), numeric=numeric)
    return pod, run, y


def test_a_traced_runs_records_and_logs_are_not_tracked_by_the_cyclic_gc():
    pod, run, _ = _run(40)
    records = run.trace.records
    logs = [e for log in run.trace.counters.values() for e in log]      # the servers' logs, moved to the trace
    assert len(records) == 8 * 40 * 3       # kernel ends take no time: no slice
    assert len(logs) == 2 * 8 * 40 + 8      # each transfer passes the die's L2, each core's first read the HBM
    tracked = sum(gc.is_tracked(r) for r in records)
    if ascend_emu.ENGINE_BUILD == "compiled":
        assert tracked == 0 and not any(gc.is_tracked(e) for e in logs)
    else:       # as Python, plain tuples: a record holds its site's args dict, so the GC keeps it on its lists
        assert tracked == len(records)
    # what they hold is what the trace reads: every transfer's and compute slice's args name the kernel's line
    slices = run.trace.slices
    pipes = {s[2] for s in slices}
    assert {"MTE2", "MTE3", "VECTOR"} <= pipes
    assert all(s[6]["kernel"] == "_scale_rows" for s in slices if s[2] in ("MTE2", "MTE3", "VECTOR"))
    assert sorted(s[6]["bytes"] for s in slices if s[2] == "MTE2") == [R * H * 4] * (8 * 40)


def test_the_collection_after_a_traced_run_walks_few_objects():
    """With the GC off for the run (``Pod.synchronize``), what it made and kept waits for the first collection after
    it: the run's records and logs are not among them (compiled build)."""
    _run(2)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        pod, run, _ = _run(100, cores=16)
        young = len(gc.get_objects(0))
    finally:
        if was:
            gc.enable()
    made = run.instructions + sum(len(log) for log in run.trace.counters.values())
    assert run.instructions == 16 * 100 * 3 + 16
    if ascend_emu.ENGINE_BUILD == "compiled":
        assert young < made // 10
    else:
        assert young > made


def _freed_by_reference_counting(make) -> list:
    """Run ``make()`` (which makes a pod, runs on it and returns it) and drop the pod with the cyclic GC off: the
    objects only a collection would free (the pod's, when they are in reference cycles)."""
    make()                          # first-call paths (imports, memos) out of the count
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        pod = make()
        alive = [weakref.ref(pod), weakref.ref(pod.gm)]
        del pod
        assert [r() for r in alive] == [None, None]     # freed when the last reference went
        gc.collect()
        return [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def test_a_finished_pod_is_freed_by_reference_counting():
    def make():
        pod, run, y = _run(5, numeric=True)
        assert run.instructions == 8 * 5 * 3 + 8
        np.testing.assert_array_equal(y.arr, 2 * np.arange(8 * R * H, dtype=np.float32).reshape(8, R, H))
        return pod
    assert _freed_by_reference_counting(make) == []


def test_a_pod_with_streams_jitter_and_a_mix_kernel_is_freed_by_reference_counting():
    from ascend_emu.demo import run_gemm

    def make():
        pod = Pod(cloudmatrix384(dies=2), jitter_seed=5)
        x = pod.to_gm(0, np.ones((4, R, H), np.float32))
        y = pod.alloc(1, (4, R, H), "fp32")             # written from die 0: a staged transfer
        s = pod.stream(0, aiv=4)
        la = s.launch(_scale_rows, (x, y, 3))
        run = pod.synchronize()
        assert la.done and run.instructions == 4 * 3 * 3 + 4 and la.cores[0].launch is None
        np.testing.assert_array_equal(y.arr, np.full((4, R, H), 2, np.float32))
        return pod
    assert _freed_by_reference_counting(make) == []
    r = run_gemm(128, 256, 256, aic=2)                 # a MIX launch (AIC <-> AIV partners)
    assert r["run"].instructions > 0


def test_a_pod_run_on_two_workers_is_freed_by_reference_counting():
    def make():
        pod = Pod(cloudmatrix384(dies=4), workers=2)        # two chips: one per worker
        x = pod.to_gm(0, np.ones((4, R, H), np.float32))
        y = pod.alloc(2, (4, R, H), "fp32")             # written from chip 0 into chip 1: crosses the workers
        pod.stream(0, aiv=4).launch(_scale_rows, (x, y, 2))
        run = pod.synchronize()
        assert run.instructions == 4 * 2 * 3 + 4
        np.testing.assert_array_equal(y.numpy(), np.full((4, R, H), 2, np.float32))
        return pod
    assert _freed_by_reference_counting(make) == []


def test_a_stream_of_a_freed_pod_says_so():
    pod = Pod(cloudmatrix384(dies=1))
    s = pod.stream(0, aiv=1)
    del pod
    with pytest.raises(ArgumentError, match="the pod of this stream was freed"):
        s.launch(_scale_rows, ())
