"""The ``ascend-emu`` command.

    ascend-emu demo [--json] [--out DIR] [--quiet]     worked example: quantise + int8 GEMM, checked against torch
    ascend-emu model OP [options] [--json] [--trace F] timing-only run of a registered op at any scale
    ascend-emu model --list                            the registered ops and their options
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

# layers above the emulator register model ops and commands in these modules (each imported if it exists)
PLUGINS = ("xccl.ops", "kernels.ops", "quant.cli", "eplb.cli", "serving.ops")


def _load_plugins() -> None:
    for mod in PLUGINS:
        pkg = mod.split(".")[0]
        if importlib.util.find_spec(pkg) is not None and importlib.util.find_spec(mod) is not None:
            importlib.import_module(mod)


def _progress(quiet: bool):
    """A rich progress bar on stderr, or a silent stand-in."""
    if quiet:
        class _Null:
            def __enter__(self): return self
            def __exit__(self, *a): return False
            def add_task(self, *a, **k): return 0
            def advance(self, *a, **k): pass
            def update(self, *a, **k): pass
        return _Null()
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _pipe_table(title: str, run) -> "object":
    from rich.table import Table
    t = Table(title=title)
    t.add_column("pipe")
    t.add_column("busy us (sum over cores)", justify="right")
    t.add_column("utilisation", justify="right")
    for pipe, us in run.busy_by_pipe().items():
        t.add_row(pipe, f"{us:.3f}", f"{run.utilization.get(pipe, 0.0):.1%}")
    return t


def cmd_demo(args) -> int:
    from . import demo
    from .trace import Trace
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    t_wall = time.perf_counter()
    with _progress(args.quiet or args.json) as prog:
        task = prog.add_task("demo", total=4)
        prog.update(task, description="quantise 3072 x 1024 bf16 rows on 48 AIVs")
        q = demo.run_quantize()
        prog.advance(task)
        prog.update(task, description="int8 GEMM 256 x 512 x 512 on 8 AIC + 16 AIV")
        g = demo.run_gemm()
        prog.advance(task)
        prog.update(task, description="writing trace")
        merged = Trace(q["run"].trace.slices + _shift(g["run"].trace, q["run"]),
                       q["run"].trace.flows + _shift_flows(g["run"].trace, q["run"]),
                       clock_ghz=q["run"].trace.clock_ghz, title="ascend-emu demo")
        trace_path = merged.save(os.path.join(out_dir, "demo_trace.json"))
        prog.advance(task)
        prog.update(task, description="plotting timeline")
        png_path = merged.plot(os.path.join(out_dir, "demo_timeline.png"))
        prog.advance(task)
    qr, gr = q["run"], g["run"]
    result = {
        "modeled_us": qr.modeled_us + gr.modeled_us,
        "max_abs_err": max(q["max_abs_err"], g["max_abs_err"]),
        "trace_path": os.path.abspath(trace_path),
        "png_path": os.path.abspath(png_path),
        "quantize": {"modeled_us": qr.modeled_us, "kernel_us": qr.kernel_us, "tokens": q["tokens"],
                     "hidden": q["hidden"], "cores": q["cores"], "q_mismatches": q["q_mismatches"],
                     "max_abs_err": q["max_abs_err"], "pipe_busy_us": qr.busy_by_pipe(),
                     "utilization": qr.utilization, "instructions": qr.instructions},
        "gemm": {"modeled_us": gr.modeled_us, "kernel_us": gr.kernel_us, "m": g["m"], "n": g["n"], "k": g["k"],
                 "int32_exact": g["int32_exact"], "max_abs_err": g["max_abs_err"],
                 "cube_utilization": g["cube_utilization"], "pipe_busy_us": gr.busy_by_pipe(),
                 "utilization": gr.utilization, "instructions": gr.instructions},
    }
    from .ops import DEMO_STAGES
    stages_ok, reports = True, []
    for stage in DEMO_STAGES.values():            # e.g. the serving loop, end to end (serving.ops)
        fields = stage.run(out_dir, args.quiet or args.json)
        stages_ok &= bool(fields.pop("ok", True))
        reports.append(fields.pop("report", None))
        result.update(fields)
    result["wall_s"] = time.perf_counter() - t_wall
    if args.json:
        print(json.dumps(result, indent=None))
    else:
        from rich.console import Console
        con = Console()
        con.print(f"[bold]quantise[/] {q['tokens']}x{q['hidden']} bf16 -> int8 on {q['cores']} AIVs: "
                  f"modeled {qr.modeled_us:.2f} us ({qr.kernel_us:.2f} us in the kernel), "
                  f"{q['q_mismatches']} int8 mismatches vs torch, max scale error {q['max_abs_err']:.3g}")
        con.print(_pipe_table("quantise: time per pipe", qr))
        con.print(f"[bold]int8 GEMM[/] {g['m']}x{g['n']}x{g['k']} (MIX, AIV dequant epilogue): modeled "
                  f"{gr.modeled_us:.2f} us ({gr.kernel_us:.2f} us in the kernel), int32 exact: "
                  f"{g['int32_exact']}, bf16 max abs err vs torch {g['max_abs_err']:.3g}, "
                  f"cube utilisation {g['cube_utilization']:.1%}")
        con.print(_pipe_table("int8 GEMM: time per pipe", gr))
        con.print(f"trace: {result['trace_path']} (Perfetto / chrome://tracing / MindStudio Insight)")
        con.print(f"timeline: {result['png_path']}")
        for report in reports:
            if report is not None:
                report(con)
    ok = q["q_mismatches"] == 0 and g["int32_exact"] and result["max_abs_err"] == 0.0 and stages_ok
    return 0 if ok else 1


def _shift(trace, after_run):
    """Place the second run's slices after the first on one timeline (they ran on separate pods)."""
    dt = int(after_run.end_us * 1e6)
    return [(d, u, tr, n, s + dt, e + dt, a) for (d, u, tr, n, s, e, a) in trace.slices]


def _shift_flows(trace, after_run):
    dt = int(after_run.end_us * 1e6)
    return [(i, (s[0], s[1], s[2], s[3] + dt), (d[0], d[1], d[2], d[3] + dt), n) for (i, s, d, n) in trace.flows]


def cmd_model(args, extra) -> int:
    from .ops import REGISTRY
    _load_plugins()
    if args.list or not args.op:
        for name, op in sorted(REGISTRY.items()):
            opts = " ".join(f"{o.name} ({o.default})" for o in op.options)
            print(f"{name:<16} {op.help}\n{'':<16} {opts}")
        return 0
    op = REGISTRY.get(args.op)
    if op is None:
        print(f"ascend-emu model: unknown op {args.op!r}; registered: {', '.join(sorted(REGISTRY))}",
              file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog=f"ascend-emu model {op.name}", description=op.help)
    for o in op.options:
        p.add_argument(o.name, type=o.type, default=o.default, help=o.help, choices=o.choices)
    opts = vars(p.parse_args(extra))
    t = time.perf_counter()
    from . import pod as pod_module
    with _progress(args.quiet or args.json) as prog:
        task = prog.add_task(f"model {op.name}", total=1)

        def show(modeled_us, n):
            prog.update(task, description=f"model {op.name}: {modeled_us:,.1f} us modeled, {n:,} instructions")
        pod_module.DEFAULT_PROGRESS = None if (args.quiet or args.json) else show
        try:
            res = op.fn(**opts, trace=bool(args.trace))
        finally:
            pod_module.DEFAULT_PROGRESS = None
        prog.advance(task)
    run = res.pop("run", None)
    res.setdefault("op", op.name)
    res["options"] = opts
    res["wall_s"] = time.perf_counter() - t
    if args.trace and run is not None and run.trace is not None:
        res["trace_path"] = os.path.abspath(run.trace.save(args.trace))
    if args.json:
        print(json.dumps(res, default=float))
    else:
        from rich.console import Console
        con = Console()
        con.print(f"[bold]{op.name}[/] modeled {res['modeled_us']:.3f} us, {res['bytes_moved']} bytes moved, "
                  f"utilisation {res['utilization'] if res['utilization'] is None else format(res['utilization'], '.1%')}")
        if run is not None:
            con.print(_pipe_table(f"{op.name}: time per pipe", run))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ascend-emu", description="Ascend NPU die emulator")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="worked example kernels, checked against torch, with trace and timeline")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--out", default="ascend-emu-demo", help="directory for the trace and PNG")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    m = sub.add_parser("model", help="timing-only run of a registered op", add_help=False)
    m.add_argument("op", nargs="?")
    m.add_argument("--json", action="store_true")
    m.add_argument("--quiet", action="store_true")
    m.add_argument("--list", action="store_true")
    m.add_argument("--trace", default=None, help="write the Chrome trace JSON here")
    _load_plugins()
    from .ops import COMMANDS
    for name, cmd in sorted(COMMANDS.items()):
        sp = sub.add_parser(name, help=cmd.help)
        cmd.add_arguments(sp)
    args, extra = parser.parse_known_args(argv)
    from .errors import EmulatorError
    try:
        return _dispatch(parser, args, extra)
    except (EmulatorError, ValueError) as e:
        print(f"ascend-emu {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _dispatch(parser, args, extra) -> int:
    from .ops import COMMANDS
    if args.cmd in COMMANDS:
        if extra:
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        return COMMANDS[args.cmd].run(args)
    if args.cmd == "demo":
        if extra:
            parser.error(f"unrecognised arguments: {' '.join(extra)}")
        return cmd_demo(args)
    if "-h" in extra or "--help" in extra:
        if not args.op:
            return cmd_model(argparse.Namespace(op=None, list=True, json=False, quiet=True, trace=None), [])
    return cmd_model(args, extra)


if __name__ == "__main__":
    sys.exit(main())
