"""One pod over 1, 2 and 3 worker processes (ascend_emu/workers.py): wall time, windows, messages, and the share of
each worker's wall time spent waiting at window ends, on a timing-only workload of six dies (``quantize_rows`` on
every die, no bulk traffic between dies) plus a cross-chip flag / counter protocol (messages every window).

Run: python -m pytest benches/bench_workers.py --benchmark-only
extra_info carries, per worker count, the worker stats of the last run (``Pod.worker_stats``).
"""
import time

import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.demo import quantize_rows

DIES = 6


@kernel(cores="aiv")
def _ping(ctx, counter, flag, watch, rounds):
    for r in range(rounds):
        yield ctx.atomic_add(counter, 1)
        if ctx.block_idx == 0:
            yield ctx.gm_store(flag, r + 1, after="all")
        yield ctx.wait_gm(watch, "ge", r + 1)


def _run(workers: int, rows_per_core: int = 256, rounds: int = 50):
    pod = Pod(cloudmatrix384(dies=DIES), trace=False, workers=workers)
    counters = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    flags = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    for d in range(DIES):
        rows = 48 * rows_per_core
        x = pod.alloc(d, (rows, 1024), "bf16", phantom=True)
        y = pod.alloc(d, (rows, 1024), "int8", phantom=True)
        s = pod.alloc(d, (rows,), "fp32", phantom=True)
        pod.stream(d, aiv=list(range(40))).launch(quantize_rows, (x, y, s, rows // 40, 8), numeric=False)
        to = (d + 2) % DIES
        pod.stream(d, aiv=list(range(40, 48))).launch(_ping, (counters[to], flags[to], flags[d], rounds))
    t = time.perf_counter()
    run = pod.synchronize()
    return run, time.perf_counter() - t, pod.worker_stats


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_wall_time(benchmark, workers):
    results = []
    benchmark.pedantic(lambda: results.append(_run(workers)), rounds=3, iterations=1)
    run, wall, stats = results[-1]
    benchmark.extra_info.update(instructions=run.instructions, modeled_us=run.modeled_us, wall_s=wall,
                                workers=[dict(s, wait_share=s["wait_s"] / max(s["run_s"], 1e-9)) for s in stats])


if __name__ == "__main__":
    base = None
    for w in (1, 2, 3):
        run, wall, stats = _run(w)
        base = base or wall
        print(f"workers={w}: {wall:.2f} s ({base / wall:.2f}x), {run.instructions} instructions, "
              f"modeled {run.modeled_us:.3f} us")
        for s in stats:
            print(f"  dies {s['dies']}: {s['windows']} windows, {s['messages']} messages, waiting "
                  f"{s['wait_s'] / max(s['run_s'], 1e-9):.0%} of {s['run_s']:.2f} s")
