"""``ascend-emu eplb``: rebalance a saved load, print max/mean before and after, draw a die-load heatmap.

    ascend-emu eplb --load loads.npy --slots 1 --dies 288 [--algo sliced|static] [--groups 8 --nodes 1]
                    [--out plan.npz] [--png heatmap.png] [--json]

``--load``: .npy of [layers, experts] or [slices, layers, experts] token counts. ``--slots``: physical slots per die
(num_replicas = slots x dies). "Before" is the load-unaware layout: slot p holds expert p % experts (the first
experts replicated in order). Registered with the ``ascend-emu`` command through the ``ascend_emu.cli`` entry point
(pyproject.toml); the rest of ``eplb`` does not import ``ascend_emu``.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ascend_emu.cli import OptionError, bounded, command, console, progress

from .api import ALGOS, LOCALITY, as_loads, rebalance_experts
from .report import balance_report, lower_bound


def _args(p) -> None:
    p.add_argument("--load", required=True, help=".npy of [layers, experts] or [slices, layers, experts] loads")
    p.add_argument("--slots", type=bounded(int, 1), required=True, help="physical expert slots per die")
    p.add_argument("--dies", type=bounded(int, 1), required=True, help="dies (num_gpus)")
    p.add_argument("--algo", default="sliced", choices=ALGOS, help="redundancy objective (default sliced)")
    p.add_argument("--groups", type=bounded(int, 1), default=1, help="expert groups (num_groups)")
    p.add_argument("--nodes", type=bounded(int, 1), default=1, help="server nodes (num_nodes)")
    p.add_argument("--locality", default="auto", choices=LOCALITY, help="keep replicas within a node")
    p.add_argument("--out", default=None, help="write phy2log, log2phy, logcnt to this .npz")
    p.add_argument("--png", default=None, help="die-load heatmap before/after (default eplb_heatmap.png "
                                               "next to --out, or none)")
    # the library's names for these options: its errors are reported against the option
    p.set_defaults(_aliases={"num_gpus": "--dies", "num_groups": "--groups", "num_nodes": "--nodes",
                             "num_replicas": "--slots", "algo": "--algo", "locality": "--locality"})


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
    try:
        raw = np.load(args.load)
    except (OSError, ValueError) as e:          # missing, unreadable or pickled
        raise OptionError(f"--load: {e}", "--load") from None
    try:
        w = as_loads(raw, "--load")
    except ValueError as e:                     # the wrong shape or dtype, NaN or negative loads
        raise OptionError(str(e), "--load") from None
    num_slices, num_layers, num_experts = w.shape
    num_replicas = args.slots * args.dies
    if num_replicas < num_experts:
        raise OptionError(f"--slots {args.slots} x --dies {args.dies} = {num_replicas} slots is below the "
                          f"{num_experts} logical experts", "--slots")
    with progress(args, f"eplb: rebalancing {num_layers} layers x {num_experts} experts", total=3) as bar:
        t = time.perf_counter()
        phy2log, log2phy, logcnt = rebalance_experts(w, num_replicas, args.groups, args.nodes, args.dies,
                                                     algo=args.algo, locality=args.locality)
        wall_ms = (time.perf_counter() - t) * 1e3
        bar.update("eplb: die loads before and after", advance=1)
        before = balance_report(w, naive_layout(num_layers, num_experts, num_replicas), args.dies)
        after = balance_report(w, phy2log, args.dies)
        lb = lower_bound(w, num_replicas, args.dies)
        agg = w.sum(0)
        lb_overall = float((lb * agg.sum(-1) / args.dies).sum() / (agg.sum(-1) / args.dies).sum())
        bar.update("eplb: plan and heatmap", advance=1)
        paths = _write(args, phy2log, log2phy, logcnt, before, after, num_layers, num_experts)
    out = {"layers": num_layers, "experts": num_experts, "slices": num_slices, "dies": args.dies,
           "slots_per_die": args.slots, "num_replicas": num_replicas, "redundant": num_replicas - num_experts,
           "algo": args.algo, "before": before.to_dict(), "after": after.to_dict(),
           "lower_bound": lb_overall, "max_replicas": int(logcnt.max()), "rebalance_ms": wall_ms, **paths}
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.table import Table
    tab = Table(title=f"eplb: {num_layers} layers x {num_experts} experts, {args.dies} dies x {args.slots} slots "
                      f"(R = {num_replicas - num_experts}), algo {args.algo}")
    for c in ("layout", "max/mean overall", "worst layer", "per slice overall"):
        tab.add_column(c, justify="right")
    for name, r in (("before", before), ("after", after)):
        tab.add_row(name, f"{r.overall:.4f}", f"{r.per_layer.max():.4f}", f"{r.overall_sliced:.4f}")
    tab.add_row("lower bound", f"{lb_overall:.4f}", f"{lb.max():.4f}", "")
    con = console()
    con.print(tab)
    con.print(f"rebalance {wall_ms:.1f} ms" + "".join(f"; {k} {out[k]}" for k in ("out_path", "png_path") if k in out))
    return 0


def _write(args, phy2log, log2phy, logcnt, before, after, num_layers, num_experts) -> dict:
    """The plan (--out) and the heatmap (--png, or beside --out); their absolute paths."""
    paths = {}
    if args.out:
        np.savez(args.out, phy2log=phy2log, log2phy=log2phy, logcnt=logcnt)
        paths["out_path"] = os.path.abspath(args.out)
    png = args.png or (os.path.splitext(args.out)[0] + "_heatmap.png" if args.out else None)
    if png:
        paths["png_path"] = os.path.abspath(heatmap(before, after, png, f"{num_layers} layers x {num_experts} "
                                                    f"experts on {args.dies} dies x {args.slots} slots"))
    return paths
