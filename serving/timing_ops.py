"""``ascend-emu serve-model`` (the timing-only decode step of a whole model) and ``ascend-emu model decode-layer``.

    ascend-emu serve-model --config v3 --dies 32 --batch-per-die 96 --seq-len 4096 --microbatches 2 --mtp 1 --json

Importing this module registers both (``serving.ops`` imports it).
"""
from __future__ import annotations

import json
import time

from ascend_emu.ops import Option, command, register


def _args(p) -> None:
    p.add_argument("--config", default="v3", choices=("v3", "mini"), help="model shapes (default v3)")
    p.add_argument("--dies", type=int, default=16, help="dies = DP attention ranks = EP ranks (must divide the "
                                                        "routed experts; default 16)")
    p.add_argument("--batch-per-die", type=int, default=96, help="sequences per die (default 96)")
    p.add_argument("--seq-len", type=int, default=4096, help="context length per sequence (default 4096)")
    p.add_argument("--microbatches", type=int, default=2, choices=(1, 2),
                   help="1: one stream on the whole die; 2: attention and MoE streams on split cores, pipelined")
    p.add_argument("--mtp", type=int, default=0, choices=(0, 1), help="MTP draft tokens per step (default 0)")
    p.add_argument("--acceptance", type=float, default=None,
                   help="MTP draft acceptance rate (default 0.85, DeepSeek-V3 reports 85-90 %%)")
    p.add_argument("--kv-int8", action="store_true", help="int8 latent KV cache")
    p.add_argument("--bf16", action="store_true", help="bf16 experts / FFN / o_proj / dispatch (default INT8)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default the config's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_serve_model(config: str, dies: int, batch_per_die: int, seq_len: int, microbatches: int, mtp: int,
                    kv_int8: bool, quant: bool = True, layers: int | None = None, acceptance: float | None = None,
                    progress=None) -> dict:
    """The decode step's figures as a JSON-ready dict (``DecodeStepTiming.to_dict`` plus ``wall_s``)."""
    from .config import get_config
    from .timing import DEFAULT_ACCEPTANCE, decode_step_timing
    t0 = time.perf_counter()
    res = decode_step_timing(get_config(config), dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                             microbatches=microbatches, mtp=mtp, kv_int8=kv_int8, quant=quant, layers=layers,
                             acceptance=DEFAULT_ACCEPTANCE if acceptance is None else acceptance,
                             progress=progress)
    out = res.to_dict()
    out["wall_s"] = time.perf_counter() - t0
    return out


@command("serve-model", "timing-only decode step of a whole model (DP attention + EP MoE): modeled TPOT, tokens/s",
         _args)
def _serve_model(args) -> int:
    kw = dict(config=args.config, dies=args.dies, batch_per_die=args.batch_per_die, seq_len=args.seq_len,
              microbatches=args.microbatches, mtp=args.mtp, kv_int8=args.kv_int8, quant=not args.bf16,
              layers=args.layers, acceptance=args.acceptance)
    if args.json or args.quiet:
        out = run_serve_model(**kw)
    else:
        from rich.console import Console
        from rich.progress import Progress, TextColumn, TimeElapsedColumn
        with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True) as prog:
            task = prog.add_task("serve-model")
            out = run_serve_model(**kw, progress=lambda name: prog.update(task, description=f"simulating {name}"))
    if args.json:
        print(json.dumps(out, default=float))
    else:
        _print_summary(out)
    return 0


def _print_summary(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console()
    con.print(f"[bold]{out['config']}[/] decode on {out['dies']} dies, {out['batch_per_die']} seqs/die at "
              f"{out['seq_len']} context, {out['microbatches']} microbatch(es), MTP {out['mtp']}"
              f"{' (acceptance %.2f)' % out['acceptance'] if out['mtp'] else ''}, "
              f"{'INT8' if out['quant'] else 'bf16'} experts, {'int8' if out['kv_int8'] else 'bf16'} KV cache")
    con.print(f"modeled TPOT {out['modeled_tpot_ms']:.2f} ms (step {out['step_us'] / 1000:.2f} ms, "
              f"{out['tokens_per_step']:.2f} tokens/step); {out['tokens_per_s_per_die']:,.0f} tokens/s per die, "
              f"{out['tokens_per_s']:,.0f} tokens/s in all")
    con.print("per layer: " + ", ".join(f"{k} {v:.1f} us (set by: {out['pipeline'][k]['bound']})"
                                        for k, v in out["per_layer_us"].items())
              + f"; fill {out['fill_us']:.1f} us, lm_head {out['lm_head_us']:.1f} us, MTP {out['mtp_us']:.1f} us; "
              f"HBM footprint {out['hbm_footprint_gib']:.1f} of {out['hbm_capacity_gib']:.0f} GiB per die; "
              f"wall {out['wall_s']:.1f} s")
    kinds = list(out["breakdown_us"])
    t = Table(title="kernel us per op and layer (summed over microbatches)")
    t.add_column("op")
    for kind in kinds:
        t.add_column(kind, justify="right")
    ops = list(dict.fromkeys(op for kind in kinds for op in out["breakdown_us"][kind]))
    for op in ops:
        t.add_row(op, *(f"{out['breakdown_us'][k][op]:.1f}" if op in out["breakdown_us"][k] else "" for k in kinds))
    con.print(t)


@register("decode-layer", "one decoder layer (attention + MoE or dense FFN) of a DP/EP decode step, timing-only", (
    Option("--config", str, "v3", "model shapes", ("v3", "mini")),
    Option("--kind", str, "moe", "layer kind", ("moe", "dense")),
    Option("--dies", int, 16, "dies (DP attention ranks = EP ranks)"),
    Option("--batch-per-die", int, 96, "sequences per die"),
    Option("--seq-len", int, 4096, "context length"),
    Option("--microbatches", int, 2, "1: one stream; 2: attention / MoE streams on split cores", (1, 2)),
    Option("--mtp", int, 0, "MTP depth: 1 + mtp query tokens per sequence", (0, 1)),
    Option("--kv-int8", int, 0, "int8 latent cache", (0, 1)),
    Option("--quant", int, 1, "INT8 experts / FFN / o_proj / dispatch", (0, 1)),
    Option("--sim-layers", int, 0, "consecutive layers simulated (0: 1 with one microbatch, 2 with two; see "
                                   "serving.timing for how the period is taken)"),
))
def _decode_layer(config, kind, dies, batch_per_die, seq_len, microbatches, mtp, kv_int8, quant, sim_layers,
                  trace=False):
    from .config import get_config
    from .timing import layer_timing
    r = layer_timing(get_config(config), kind, dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                     microbatches=microbatches, query_tokens=1 + mtp, kv_int8=bool(kv_int8), quant=bool(quant),
                     sim_layers=sim_layers or None, trace=trace)
    return {"op": "decode-layer", "modeled_us": r.period_us, "first_layer_us": r.first_layer_us,
            "bytes_moved": r.bytes_moved, "utilization": r.utilization["hbm"], "utilization_detail": r.utilization,
            "breakdown_us": r.breakdown_us, "stream_busy_us": r.stream_busy_us, "bound": r.bound,
            "instructions": r.instructions, "run": r.run}
