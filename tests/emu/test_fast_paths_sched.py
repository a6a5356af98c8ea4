"""Fast paths of the scheduler's per-instruction work at scale (issue 19): each must leave every modeled number as it
was. A traced run's records and server logs stay off the cyclic GC's lists (compiled build), so the collection after
a run does not walk one object per instruction."""
import gc

import numpy as np

import ascend_emu
from ascend_emu import Pod, cloudmatrix384, kernel

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
