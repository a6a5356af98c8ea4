"""One pod over 1, 2 and 3 worker processes (ascend_emu/workers.py): wall time, windows, messages, and the share of
each worker's wall time spent waiting at window ends, on a timing-only workload of six dies (``quantize_rows`` on
every die, no bulk traffic between dies) plus a cross-chip flag / counter protocol (messages every window).

``--a2e ATTN EXPERTS`` runs the A2E + E2A exchange of ``ascend-emu model a2e`` instead (``--a2e 160 288``: paper
scale) on one and two workers and reports, per worker, CPU time, the CPU of packing / unpacking messages and of
waiting, the wait share, the critical path (setup + the busiest worker's CPU less its waiting CPU, vs the one
process's CPU: on a shared machine wall time measures the other processes too), and a projection of the speed-up
at 16 and 64 workers from the measured costs (``projection``; its model is in the README, "One pod over several
processes").

Run: python -m pytest benches/bench_workers.py --benchmark-only      (the six-die workload, 1/2/3 workers)
     python benches/bench_workers.py [--a2e 160 288]
extra_info carries, per worker count, the worker stats of the last run (``Pod.worker_stats``).
"""
import argparse
import time

import numpy as np
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


# ------------------------------------------------------------------------------------ A2E at scale, and the projection
def _a2e(attn: int, experts: int, workers: int) -> dict:
    """One A2E + E2A of ``ascend-emu model a2e`` (96 tokens per attention die, hidden 7168, top-8, trampolines):
    CPU of the setup (pod, plan, launches) and of the run, instructions, modeled time, worker stats."""
    from ascend_emu.workers import default_workers
    from xccl.cli import run_exchange
    real = Pod.synchronize
    mark = {}

    def synchronize(pod):
        mark["setup_cpu_s"] = time.process_time() - mark["began"]
        began = time.process_time()
        try:
            return real(pod)
        finally:
            mark["run_cpu_s"] = time.process_time() - began     # this process: worker 0's run and the merge
    Pod.synchronize = synchronize
    try:
        with default_workers(workers) as runs:
            mark["began"] = time.process_time()
            _, _, run, wall = run_exchange(attn, experts, 96, 7168, 8, 1, 0, 1, "mtu", 48)
    finally:
        Pod.synchronize = real
    return dict(mark, wall_s=wall, instructions=run.instructions, modeled_us=run.modeled_us,
                stats=runs[0] if runs else [])


def window_exchange_s(workers: int = 2, windows: int = 2000) -> float:
    """Wall time of one empty window exchange between ``workers`` processes over shared memory (the fixed cost
    of a window: every worker writes and reads a frame per peer and waits for the slowest)."""
    from ascend_emu.transport import run_workers
    per = run_workers(workers, _exchanges, args=(windows,), transport="shm")
    return float(np.median(per))


def _exchanges(transport, windows: int) -> float:
    for _ in range(50):                                   # warm the rings
        transport.exchange({}, 0)
    began = time.perf_counter()
    for w in range(windows):
        transport.exchange({}, w)
    return (time.perf_counter() - began) / windows


def projection(one: dict, two: dict, exchange_s: float, workers=(16, 64)) -> dict:
    """Speed-up at ``workers`` workers from the costs measured on one and two (see the README for the model):
    ``T(W) = setup + I c_instr (1 + imbalance) / W + M(W) c_msg / W + K c_win (W - 1)`` with ``M(W) = M(2) (1 - 1/W)
    / (1/2)`` (cross-worker messages grow as uniform traffic would: an upper bound for A2E, whose two-worker cut
    already crosses most of its traffic) and K, the windows, as on two workers (the look-ahead stays the fabric
    latency between chips of one server). Assumes a core per worker."""
    stats = two["stats"]
    instr = one["instructions"]
    c_instr = one["run_cpu_s"] / instr
    messages = sum(s["messages"] for s in stats)
    c_msg = sum(s["encode_s"] + s["decode_s"] for s in stats) / max(messages, 1)
    compute = [s["cpu_s"] - s["wait_cpu_s"] - s["encode_s"] - s["decode_s"] for s in stats]
    imbalance = max(compute) / (sum(compute) / len(compute)) - 1
    windows = max(s["windows"] for s in stats)
    t1 = one["setup_cpu_s"] + one["run_cpu_s"]
    out = {"c_instr_us": c_instr * 1e6, "c_msg_us": c_msg * 1e6, "c_win_us": exchange_s * 1e6,
           "windows": windows, "messages_2": messages, "imbalance": imbalance, "setup_s": one["setup_cpu_s"]}
    for w in workers:
        m = messages * (1 - 1 / w) * 2
        t = (one["setup_cpu_s"] + instr * c_instr * (1 + imbalance) / w + m * c_msg / w
             + windows * exchange_s * (w - 1))
        out[f"speedup_{w}"] = t1 / t
    return out


def _report_a2e(attn: int, experts: int) -> None:
    two = _a2e(attn, experts, 2)
    one = _a2e(attn, experts, 1)
    assert (two["instructions"], two["modeled_us"]) == (one["instructions"], one["modeled_us"])
    print(f"A2E + E2A, {attn} attention x {experts} expert dies: {one['instructions']} instructions, modeled "
          f"{one['modeled_us']:.3f} us on one and two workers")
    print(f"  one process: setup {one['setup_cpu_s']:.2f} s CPU, run {one['run_cpu_s']:.2f} s CPU "
          f"({one['run_cpu_s'] / one['instructions'] * 1e6:.1f} us per instruction), wall {one['wall_s']:.1f} s")
    for rank, s in enumerate(two["stats"]):
        print(f"  worker {rank}, {len(s['dies'])} dies ({', '.join(map(str, s['dies'][:4]))}, ... {s['dies'][-1]}): "
              f"{s['windows']} windows, "
              f"{s['messages']} messages ({s['bytes_sent'] / max(s['messages'], 1):.0f} B each), CPU "
              f"{s['cpu_s']:.2f} s (packing {s['encode_s']:.2f}, unpacking {s['decode_s']:.2f}, waiting "
              f"{s['wait_cpu_s']:.2f}), wall {s['run_s']:.2f} s of which waiting {s['wait_s'] / s['run_s']:.0%}")
    spent = sum(s["cpu_s"] - s["wait_cpu_s"] for s in two["stats"])
    waiting = sum(s["wait_cpu_s"] for s in two["stats"])
    print(f"  overhead of the split: the two workers' loops spent {spent:.2f} s of CPU outside waiting against "
          f"{one['run_cpu_s']:.2f} s for one process's run ({spent / one['run_cpu_s'] - 1:+.0%}), and "
          f"{waiting:.2f} s waiting")
    busiest = max(s["cpu_s"] - s["wait_cpu_s"] for s in two["stats"])
    critical = one["setup_cpu_s"] + busiest        # the setup is the same work on both: one measure of it
    print(f"  critical path on two workers: setup {one['setup_cpu_s']:.2f} s + busiest worker {busiest:.2f} s CPU "
          f"= {critical:.2f} s vs {one['setup_cpu_s'] + one['run_cpu_s']:.2f} s on one: "
          f"{(one['setup_cpu_s'] + one['run_cpu_s']) / critical:.2f}x (wall {two['wall_s']:.1f} s)")
    p = projection(one, two, window_exchange_s(2))
    print(f"  projection (a core per worker): c_instr {p['c_instr_us']:.1f} us, c_msg {p['c_msg_us']:.1f} us per "
          f"message (packing + unpacking), c_win {p['c_win_us']:.0f} us per window and peer, {p['windows']} "
          f"windows, imbalance {p['imbalance']:.1%}: speed-up {p['speedup_16']:.1f}x at 16 workers, "
          f"{p['speedup_64']:.1f}x at 64")


def _report_small() -> None:
    base = None
    for w in (1, 2, 3):
        run, wall, stats = _run(w)
        base = base or wall
        print(f"workers={w}: {wall:.2f} s ({base / wall:.2f}x), {run.instructions} instructions, "
              f"modeled {run.modeled_us:.3f} us")
        for s in stats:
            print(f"  dies {s['dies']}: {s['windows']} windows, {s['messages']} messages, waiting "
                  f"{s['wait_s'] / max(s['run_s'], 1e-9):.0%} of {s['run_s']:.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a2e", type=int, nargs=2, metavar=("ATTN", "EXPERTS"),
                        help="A2E + E2A over ATTN attention and EXPERTS expert dies (160 288: paper scale)")
    opts = parser.parse_args()
    if opts.a2e:
        _report_a2e(*opts.a2e)
    else:
        _report_small()
