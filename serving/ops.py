"""CLI hooks of the serving layer: the end-to-end part of ``ascend-emu demo`` and ``ascend-emu serve-model``.

The demo serves a small ragged workload (shared prompt prefix, so prefix reuse engages) with the mini model on two
emulated dies (DP attention x 2, EP MoE over both), numeric mode, and checks every generated token against the
plain-torch reference model. It adds ``tokens_match``, ``ttft_ms``, ``tpot_ms``, ``tokens_per_s`` (modeled) and a
``serving`` object (per-op breakdown per layer, trace and timeline of a decode step) to the demo's JSON.
"""
from __future__ import annotations

import os

from ascend_emu.ops import demo_stage

from . import expert_pipeline_ops, timing_ops  # noqa: F401  (register expert-pipeline, serve-model)

DEMO_PROMPTS = 6
DEMO_MAX_TOKENS = 5
DEMO_GROUPS = 2


def demo_prompts(vocab: int, n: int = DEMO_PROMPTS, seed: int = 0) -> list:
    """Ragged prompts (5..37 tokens); half share a 20-token prefix (one full 16-token KV block to reuse)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (20,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(0, vocab, (5 + 7 * i % 18,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


def step_trace(timeline: list, title: str):
    """A Chrome trace of one step's op timeline: (stream, name, start_us, end_us) -> ascend_emu Trace; one process
    per stream, one thread (and plot colour) per op kind."""
    from ascend_emu.trace import Trace
    slices = [(0, stream, name.rsplit(".", 1)[-1], name, int(t0 * 1e6), int(t1 * 1e6), None)
              for stream, name, t0, t1 in timeline]
    return Trace(slices, [], title=title)


def run_demo(out_dir: str, quiet: bool = True, *, groups: int = DEMO_GROUPS, max_tokens: int = DEMO_MAX_TOKENS,
             n: int = DEMO_PROMPTS) -> dict:
    """Serve ``n`` ragged prompts end to end; returns the demo fields (see module docstring)."""
    from .config import MINI
    from .engine import Engine
    from .model import ReferenceModel, init_weights
    from .request import SamplingParams
    from .runner import EmulatedRunner

    weights = init_weights(MINI, seed=0)
    prompts = demo_prompts(MINI.vocab_size, n)
    runner = EmulatedRunner(weights, groups=groups, block_size=16, num_blocks=32)
    steps = []
    execute = runner.execute

    def recording(batch):
        out = execute(batch)
        steps.append(out)
        return out
    runner.execute = recording
    engine = Engine(runner, max_batch=4, token_budget=256)
    res = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    ref = ReferenceModel(weights)
    expected = [ref.generate(p, max_tokens) for p in prompts]
    got = [r.output_tokens for r in sorted(res.requests, key=lambda r: r.rid)]
    m = res.metrics
    decode = [s for s in steps if all(len(v) == 1 for v in s.tokens.values())] or steps
    last = decode[-1]
    trace = step_trace(last.timeline, "ascend-emu serving: one decode step (mini model, 2 dies)")
    trace_path = trace.save(os.path.join(out_dir, "serve_step_trace.json"))
    png_path = trace.plot(os.path.join(out_dir, "serve_step_timeline.png"))
    per_layer = {}
    for k, us in last.per_layer.items():
        layer, op = k.split(".", 1)
        per_layer.setdefault(layer, {})[op] = us
    fields = {
        "tokens_match": got == expected,
        "ttft_ms": m.mean_ttft_ms,
        "tpot_ms": m.mean_tpot_ms,
        "tokens_per_s": m.tokens_per_s,
        "serving": {"model": "mini", "dies": groups, "requests": len(prompts), "max_tokens": max_tokens,
                    "prompt_lens": [len(p) for p in prompts], "steps": m.num_steps,
                    "makespan_us": m.makespan_us, "decode_step_us": last.modeled_us,
                    "decode_step_per_layer_us": per_layer, "decode_step_breakdown_us": last.breakdown,
                    "trace_path": os.path.abspath(trace_path), "png_path": os.path.abspath(png_path)},
    }

    def report(con):
        from rich.table import Table
        con.print(f"[bold]serving[/] mini DeepSeek-V3-style model on {groups} dies (DP attention + EP MoE), "
                  f"{len(prompts)} ragged requests x {max_tokens} tokens: tokens match the torch reference: "
                  f"{fields['tokens_match']}")
        con.print(f"  TTFT {m.mean_ttft_ms:.3f} ms, TPOT {m.mean_tpot_ms:.3f} ms, {m.tokens_per_s:,.0f} tokens/s "
                  f"(modeled), {m.num_steps} steps")
        t = Table(title=f"one decode step: modeled us per op per layer (total {last.modeled_us:.1f} us)")
        ops = sorted({op for d in per_layer.values() for op in d})
        t.add_column("layer")
        for op in ops:
            t.add_column(op, justify="right")
        for layer, d in per_layer.items():
            t.add_row(layer, *[f"{d[op]:.1f}" if op in d else "" for op in ops])
        con.print(t)
        con.print(f"  step trace: {fields['serving']['trace_path']}, timeline: {fields['serving']['png_path']}")

    fields["ok"] = fields["tokens_match"]
    fields["report"] = report
    return fields


@demo_stage("serving")
def _demo(out_dir: str, quiet: bool) -> dict:
    return run_demo(out_dir, quiet)
