"""`ascend-emu model fused-dispatch | fused-combine` and `ascend-emu calibrate` (timing-only, paper scale)."""
from __future__ import annotations

import json

import numpy as np

from ascend_emu.ops import Option, command, register

FUSED_OPTIONS = (
    Option("--ep", int, 8, "expert-parallel ranks (dies 0 .. ep-1)"),
    Option("--tokens-per-rank", int, 128, "tokens per rank"),
    Option("--hidden", int, 7168, "hidden size (elements)"),
    Option("--topk", int, 8, "experts per token"),
    Option("--experts", int, 256, "routed experts (experts / ep per rank)"),
    Option("--quant", int, 1, "1: INT8 + per-token scale records; 0: bf16", choices=(0, 1)),
)


def _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace):
    from ascend_emu import Pod, cloudmatrix384

    from .fused_moe import MoeGroup
    pod = Pod(cloudmatrix384(dies=max(ep, 2)), trace=trace)
    g = MoeGroup(pod, range(ep), max_bs=tokens_per_rank, hidden=hidden, topk=topk, num_experts=experts,
                 quant=bool(quant), phantom=True)
    rng = np.random.default_rng(0)
    ids = [np.argsort(rng.random((tokens_per_rank, experts)), axis=1)[:, :topk] for _ in range(ep)]
    return g, ids


def _figures(op, run, **extra):
    port, util = run.busiest_port()
    return {"op": op, "modeled_us": run.modeled_us, "kernel_us": run.kernel_us, "bytes_moved": run.bytes_moved,
            "utilization": util, "busiest_port": port, "instructions": run.instructions, **extra, "run": run}


@register("fused-dispatch", "FusedDispatch: push-based AIV-direct MoE dispatch (INT8 records) over an EP group",
          FUSED_OPTIONS)
def _fused_dispatch(ep, tokens_per_rank, hidden, topk, experts, quant, trace=False):
    from .fused_moe import moe_distribute_dispatch
    g, ids = _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace)
    res = moe_distribute_dispatch(None, ids, g, numeric=False)
    return _figures("fused-dispatch", res.run, window_bytes_per_die=g.window_bytes())


@register("fused-combine", "FusedCombine: bf16 rows back to their tokens, per-token arrival counters, fp32 sum",
          FUSED_OPTIONS)
def _fused_combine(ep, tokens_per_rank, hidden, topk, experts, quant, trace=False):
    from .fused_moe import moe_distribute_combine, moe_distribute_dispatch
    g, ids = _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace)
    res = moe_distribute_dispatch(None, ids, g, numeric=False)
    _, run = moe_distribute_combine(None, res, [np.ones((tokens_per_rank, topk), np.float32)] * ep, g,
                                    numeric=False)
    return _figures("fused-combine", run)


def _calibrate_args(p):
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--ep", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256], help="EP sizes to sweep")


@command("calibrate", "fused dispatch/combine at EP 8..256 vs the published CloudMatrix384 table", _calibrate_args)
def _calibrate(args) -> int:
    from .calibrate import PUBLISHED, calibrate
    bad = [e for e in args.ep if e not in PUBLISHED]
    if bad:
        raise ValueError(f"--ep {bad}: the published table has EP {sorted(PUBLISHED)}")
    if args.quiet or args.json:
        res = calibrate(args.ep)
    else:
        from rich.console import Console
        from rich.progress import Progress
        with Progress(console=Console(stderr=True), transient=True) as prog:
            task = prog.add_task("calibrate", total=len(args.ep))
            res = calibrate(args.ep, progress=lambda ep: prog.advance(task))
    if args.json:
        print(json.dumps(res))
    else:
        from rich.console import Console
        from rich.table import Table
        t = Table(title="fused dispatch / combine: modeled kernel latency vs published (us)")
        for c in ("EP", "dispatch", "published", "err %", "combine", "published", "err %"):
            t.add_column(c, justify="right")
        for p in res["points"]:
            t.add_row(str(p["ep"]), f"{p['dispatch_us']:.1f}", f"{p['published_dispatch_us']:.0f}",
                      f"{p['dispatch_err_pct']:.1f}", f"{p['combine_us']:.1f}", f"{p['published_combine_us']:.0f}",
                      f"{p['combine_err_pct']:.1f}")
        Console().print(t)
        Console().print(f"mean abs error {res['mean_abs_pct_err']:.1f} %, max {res['max_abs_pct_err']:.1f} %")
    return 0
