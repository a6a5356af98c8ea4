"""``ascend-emu eplb``: rebalance a saved load, print max/mean before and after, draw a die-load heatmap.

    ascend-emu eplb --load loads.npy --slots 1 --dies 288 [--algo sliced|static] [--groups 8 --nodes 1]
                    [--out plan.npz] [--png heatmap.png] [--json]

``--load``: .npy of [layers, experts] or [slices, layers, experts] token counts. ``--slots``: physical slots per die
(num_replicas = slots x dies). "Before" is the load-unaware layout: slot p holds expert p % experts (the first
experts replicated in order).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ascend_emu.ops import command

from .api import ALGOS, LOCALITY, as_loads, rebalance_experts
from .report import balance_report, lower_bound


def _args(p) -> None:
    p.add_argument("--load", required=True, help=".npy of [layers, experts] or [slices, layers, experts] loads")
    p.add_argument("--slots", type=int, required=True, help="physical expert slots per die")
    p.add_argument("--dies", type=int, required=True, help="dies (num_gpus)")
    p.add_argument("--algo", default="sliced", choices=ALGOS, help="redundancy objective (default sliced)")
    p.add_argument("--groups", type=int, default=1, help="expert groups (num_groups)")
    p.add_argument("--nodes", type=int, default=1, help="server nodes (num_nodes)")
    p.add_argument("--locality", default="auto", choices=LOCALITY, help="keep replicas within a node")
    p.add_argument("--out", default=None, help="write phy2log, log2phy, logcnt to this .npz")
    p.add_argument("--png", default=None, help="die-load heatmap before/after (default eplb_heatmap.png "
                                               "next to --out, or none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def naive_layout(num_layers: int, num_experts: int, num_replicas: int) -> np.ndarray:
    """[layers, P] int64: slot p holds expert p % num_experts (no load awareness)."""
    return np.broadcast_to(np.arange(num_replicas) % num_experts, (num_layers, num_replicas)).astype(np.int64)


def heatmap(before, after, path: str, title: str = "") -> str:
    """Two panels, layers x dies, colour = die load / mean die load of the layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True, constrained_layout=True)
    norm = lambda r: r.die_load.sum(0) / np.maximum(r.die_load.sum(0).mean(-1, keepdims=True), 1e-30)
    hi = max(norm(before).max(), norm(after).max())
    for ax, rep, name in ((axes[0], before, "before"), (axes[1], after, "after")):
        im = ax.imshow(norm(rep), aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=hi)
        ax.set_title(f"{name}: max/mean {rep.overall:.3f}")
        ax.set_xlabel("die")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="die load / layer mean")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@command("eplb", "expert-placement load balancing: rebalance a saved load, report max/mean die load", _args)
def run(args) -> int:
    w = as_loads(np.load(args.load), "--load")
    num_slices, num_layers, num_experts = w.shape
    num_replicas = args.slots * args.dies
    t = time.perf_counter()
    phy2log, log2phy, logcnt = rebalance_experts(w, num_replicas, args.groups, args.nodes, args.dies,
                                                 algo=args.algo, locality=args.locality)
    wall_ms = (time.perf_counter() - t) * 1e3
    if num_replicas < num_experts:
        raise ValueError(f"--slots x --dies = {num_replicas} is below the {num_experts} experts")
    before = balance_report(w, naive_layout(num_layers, num_experts, num_replicas), args.dies)
    after = balance_report(w, phy2log, args.dies)
    lb = lower_bound(w, num_replicas, args.dies)
    agg = w.sum(0)
    lb_overall = float((lb * agg.sum(-1) / args.dies).sum() / (agg.sum(-1) / args.dies).sum())
    out = {"layers": num_layers, "experts": num_experts, "slices": num_slices, "dies": args.dies,
           "slots_per_die": args.slots, "num_replicas": num_replicas, "redundant": num_replicas - num_experts,
           "algo": args.algo, "before": before.to_dict(), "after": after.to_dict(),
           "lower_bound": lb_overall, "max_replicas": int(logcnt.max()), "rebalance_ms": wall_ms}
    if args.out:
        np.savez(args.out, phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
        out["out_path"] = os.path.abspath(args.out)
    png = args.png or (os.path.splitext(args.out)[0] + "_heatmap.png" if args.out else None)
    if png:
        out["png_path"] = os.path.abspath(heatmap(before, after, png, f"{num_layers} layers x {num_experts} "
                                                  f"experts on {args.dies} dies x {args.slots} slots"))
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table
    tab = Table(title=f"eplb: {num_layers} layers x {num_experts} experts, {args.dies} dies x {args.slots} slots "
                      f"(R = {num_replicas - num_experts}), algo {args.algo}")
    for c in ("layout", "max/mean overall", "worst layer", "per slice overall"):
        tab.add_column(c, justify="right")
    for name, r in (("before", before), ("after", after)):
        tab.add_row(name, f"{r.overall:.4f}", f"{r.per_layer.max():.4f}", f"{r.overall_sliced:.4f}")
    tab.add_row("lower bound", f"{lb_overall:.4f}", f"{lb.max():.4f}", "")
    con = Console()
    con.print(tab)
    con.print(f"rebalance {wall_ms:.1f} ms" + "".join(f"; {k} {out[k]}" for k in ("out_path", "png_path") if k in out))
    return 0
