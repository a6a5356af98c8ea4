"""The emulator's cost at scale (issue 19): instructions per second as a run grows, and the CPU time and peak memory
of the paper-scale timing-only runs.

1. ``rate``: one kernel family (per-row dynamic INT8 quantisation streaming through new GM rows, 48 AIVs, tracing
   on, timing-only) at about 10k, 100k and 1M instructions; CPU seconds of the run alone, instructions per CPU
   second, and each size's rate over the 10k rate (flat: it stays near 1).
2. ``paper``: each paper-scale ``ascend-emu model`` command in a fresh process: its CPU seconds (user + system,
   imports included) and its peak resident memory.
3. ``demo``: ``ascend-emu demo`` in a fresh process, wall seconds.

Run:  python benches/bench_scale.py [--part rate,paper,demo] [--sizes 10000,100000,1000000] [--json]
  or  python -m pytest benches/bench_scale.py --benchmark-only
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # run as a script from a source tree

from ascend_emu import Pod, cloudmatrix384, kernel  # noqa: E402

R, H, CORES = 8, 2048, 48
INSTR_PER_TILE = 4

PAPER = {   # name -> ascend-emu arguments (issue 19's targets; the 256-die layer was its stand-in for the preset)
    "decode-layer cloudmatrix-infer": ["model", "decode-layer", "--preset", "cloudmatrix-infer", "--microbatches", "1",
                                       "--mtp", "0"],
    "decode-layer 256 dies": ["model", "decode-layer", "--dies", "256"],
    "a2e/e2a 160 x 288 dies, 1 domain": ["model", "a2e", "--attn-dies", "160", "--expert-dies", "288",
                                         "--domains", "1"],
    "fused-dispatch EP256": ["model", "fused-dispatch", "--ep", "256"],
}


@kernel(cores="aiv")
def quantize_stream(ctx, x_gm, y_gm, s_gm, tiles):
    """Each core quantises its own run of ``tiles`` x R new rows (double-buffered): 4 instructions per tile."""
    x_t = ctx.ub.alloc((2, R, H), "bf16")
    y_t = ctx.ub.alloc((2, R, H), "int8")
    s_t = ctx.ub.alloc((2, R), "fp32")
    base = ctx.block_idx * tiles * R
    for i in range(tiles):
        k = i % 2
        r = base + i * R
        yield ctx.copy_gm_to_ub(x_t[k], x_gm[r:r + R])
        yield ctx.vec.quant_int8(y_t[k], s_t[k], x_t[k])
        yield ctx.copy_ub_to_gm(y_gm[r:r + R], y_t[k])
        yield ctx.copy_ub_to_gm(s_gm[r:r + R], s_t[k])


def rate(instructions: int) -> dict:
    """Run ``quantize_stream`` with about ``instructions`` instructions; CPU seconds of the launch alone."""
    tiles = max(1, instructions // (CORES * INSTR_PER_TILE))
    rows = CORES * tiles * R
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    x = pod.alloc(0, (rows, H), "bf16", phantom=True)
    y = pod.alloc(0, (rows, H), "int8", phantom=True)
    s = pod.alloc(0, (rows,), "fp32", phantom=True)
    t = time.process_time()
    run = pod.launch(quantize_stream, aiv=CORES, args=(x, y, s, tiles), numeric=False)
    cpu = time.process_time() - t
    return {"instructions": run.instructions, "cpu_s": cpu, "instructions_per_s": run.instructions / cpu,
            "modeled_us": run.modeled_us}


def rates(sizes) -> list:
    rate(CORES * INSTR_PER_TILE * 2)           # warm up (imports, first-call paths)
    out = [rate(n) for n in sizes]
    for r in out:
        r["vs_first"] = r["instructions_per_s"] / out[0]["instructions_per_s"]
    return out


_CHILD = """
import json, resource, sys, time
t = time.perf_counter()
from ascend_emu.cli import main
rc = main(sys.argv[1:] + ["--json", "--quiet"])
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"rc": rc, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": ru.ru_maxrss / 1024,
                  "wall_s": time.perf_counter() - t}), file=sys.stderr)
"""


def child(args: list) -> dict:
    """Run ``ascend-emu ARGS`` in a fresh process; its exit code, CPU seconds, peak RSS (MB), wall seconds, and
    the command's JSON output (its modeled figures)."""
    r = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, cwd=ROOT)
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    out = r.stdout.strip().splitlines()
    result = json.loads(out[-1]) if out and out[-1].startswith("{") else {}
    stats["modeled_us"] = result.get("modeled_us")
    stats["instructions"] = result.get("instructions")
    stats["command"] = "ascend-emu " + " ".join(args)
    return stats


def paper(names=None) -> dict:
    return {name: child(args) for name, args in PAPER.items() if names is None or name in names}


def demo() -> dict:
    with tempfile.TemporaryDirectory() as d:
        return child(["demo", "--out", d])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="rate,paper,demo", help="comma-separated subset of rate, paper, demo")
    ap.add_argument("--sizes", default="10000,100000,1000000", help="instructions per rate run")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    parts = args.part.split(",")
    res = {}
    if "rate" in parts:
        res["rate"] = rates([int(n) for n in args.sizes.split(",")])
        if not args.json:
            for r in res["rate"]:
                print(f"{r['instructions']:>9} instructions  {r['cpu_s']:7.2f} s CPU  "
                      f"{r['instructions_per_s'] / 1e3:6.0f}k instructions/s  ({r['vs_first']:.2f} of the first)",
                      flush=True)
    if "paper" in parts:
        res["paper"] = {}
        for name, args_ in PAPER.items():
            r = res["paper"][name] = child(args_)
            if not args.json:
                print(f"{name:<36} {r['cpu_s']:7.1f} s CPU  peak {r['peak_rss_mb']:7.0f} MB  "
                      f"({r['command']}, exit {r['rc']})", flush=True)
    if "demo" in parts:
        r = res["demo"] = demo()
        if not args.json:
            print(f"{'ascend-emu demo':<36} {r['wall_s']:7.1f} s wall ({r['cpu_s']:.1f} s CPU, exit {r['rc']})")
    if args.json:
        print(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------------------------ pytest-benchmark
def test_rate_flat(benchmark):
    out = benchmark.pedantic(lambda: rates([10_000, 100_000, 1_000_000]), rounds=1, iterations=1)
    benchmark.extra_info["rates"] = out


def test_paper_scale(benchmark):
    out = benchmark.pedantic(paper, rounds=1, iterations=1)
    benchmark.extra_info["paper"] = out


def test_demo_wall(benchmark):
    out = benchmark.pedantic(demo, rounds=1, iterations=1)
    benchmark.extra_info["demo"] = out


if __name__ == "__main__":
    sys.exit(main())
