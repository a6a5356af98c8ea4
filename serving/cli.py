"""The serving layer's part of the ``ascend-emu`` command line.

- The end-to-end stage of ``ascend-emu demo``: a small ragged workload (shared prompt prefix, so prefix reuse
  engages) served with the mini model on two emulated dies (DP attention x 2, EP MoE over both), numeric mode, every
  generated token checked against the plain-torch reference model. It adds ``tokens_match``, ``ttft_ms``,
  ``tpot_ms``, ``tokens_per_s`` (modeled) and a ``serving`` object (per-op breakdown per layer, trace and timeline
  of a decode step) to the demo's JSON.
- ``ascend-emu serve-model``: the timing-only decode step of a whole model, and ``ascend-emu model decode-layer``:

      ascend-emu serve-model --config v3 --dies 32 --batch-per-die 96 --seq-len 4096 --microbatches 2 --mtp 1 --json
      ascend-emu serve-model --preset cloudmatrix-infer --mtp 1 --json      # the paper's decode instance

  ``--preset`` names a deployment of ``serving.deployment.PRESETS``; options given alongside override its fields.

- ``ascend-emu model expert-pipeline``: persistent expert kernels (``serving.expert_pipeline``), timing-only. Dies:
  domain ``i`` holds attention dies ``i*A .. (i+1)*A - 1``; the expert dies follow. Routing: uniform random top-k
  without repetition over ``--experts`` (default: 2 per expert die), seeded; gating weights 1/k.

Registered with the ``ascend-emu`` command through the ``ascend_emu.cli`` entry point (pyproject.toml).
"""
from __future__ import annotations

import json
import os
import resource
import time

import numpy as np

from ascend_emu.cli import (Option, add_workers, add_workers_block, bounded, command, console, demo_stage, not_above,
                            pod_profile, progress, register)

from .deployment import PRESETS

DEMO_PROMPTS = 6
DEMO_MAX_TOKENS = 5
DEMO_GROUPS = 2


# ------------------------------------------------------------------------------------------------- the demo
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
             n: int = DEMO_PROMPTS, profile=None) -> dict:
    """Serve ``n`` ragged prompts end to end; returns the demo fields (see module docstring)."""
    from .config import MINI
    from .engine import Engine
    from .model import ReferenceModel, init_weights
    from .request import SamplingParams
    from .runner import EmulatedRunner

    weights = init_weights(MINI, seed=0)
    prompts = demo_prompts(MINI.vocab_size, n)
    prof = pod_profile(profile, groups, "--profile", f"the serving demo ({groups} DP groups)")
    runner = EmulatedRunner(weights, groups=groups, block_size=16, num_blocks=32, profile=prof)
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
def _demo(out_dir: str, quiet: bool, profile=None) -> dict:
    return run_demo(out_dir, quiet, profile=profile)


# -------------------------------------------------------------------------------------------- serve-model
def _serve_args(p) -> None:
    p.add_argument("--config", default="v3", choices=("v3", "mini"), help="model shapes (default v3)")
    add_workers(p)
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a named deployment (serving.deployment.PRESETS; cloudmatrix-infer: the paper's decode "
                        "instance, 320 dies); the options below given alongside override its fields")
    p.add_argument("--dies", type=bounded(int, 1), default=None,
                   help="dies = DP attention ranks = EP ranks (default 16, or the preset's)")
    p.add_argument("--batch-per-die", type=bounded(int, 1), default=None,
                   help="sequences per die (default 96, or the preset's)")
    p.add_argument("--seq-len", type=bounded(int, 1), default=None,
                   help="context length per sequence (default 4096, or the preset's)")
    p.add_argument("--shared-expert-dies", type=bounded(int, 0), default=None,
                   help="dies hosting a copy of the shared expert, fed through dispatch (default 0: the shared "
                        "expert on every die; or the preset's)")
    p.add_argument("--redundant-experts", type=bounded(int, 0), default=None,
                   help="redundant routed-expert replicas placed by eplb (default 0, or the preset's)")
    p.add_argument("--microbatches", type=int, default=None, choices=(1, 2),
                   help="1: one stream on the whole die; 2: attention and MoE streams on split cores, pipelined "
                        "(default 2, or the preset's)")
    p.add_argument("--mtp", type=int, default=None, choices=(0, 1), help="MTP draft tokens per step (default 0)")
    p.add_argument("--acceptance", type=bounded(float, 0.0, 1.0), default=None,
                   help="MTP draft acceptance rate, 0..1 (default 0.85, DeepSeek-V3 reports 85-90 %%; the "
                        "cloudmatrix-infer preset: 0.7)")
    p.add_argument("--kv-int8", action="store_true", default=None, help="int8 latent KV cache")
    p.add_argument("--bf16", action="store_true", default=None,
                   help="bf16 experts / FFN / o_proj / W_uq_qr / dispatch (default W8A8 INT8)")
    p.add_argument("--layers", type=bounded(int, 1), default=None, help="decoder layers (default the config's)")


def run_serve_model(config: str, dies: int | None = None, batch_per_die: int | None = None,
                    seq_len: int | None = None, microbatches: int | None = None, mtp: int | None = None,
                    kv_int8: bool | None = None, quant: bool | None = None, layers: int | None = None,
                    acceptance: float | None = None, progress=None, profile=None, preset: str | None = None,
                    shared_expert_dies: int | None = None, redundant_experts: int | None = None) -> dict:
    """The decode step's figures as a JSON-ready dict (``DecodeStepTiming.to_dict`` plus ``wall_s`` and
    ``peak_rss_mb``). Arguments left None take the preset's value (``preset``) or the default deployment's."""
    from .config import get_config
    from .timing import decode_step_timing
    t0 = time.perf_counter()
    res = decode_step_timing(get_config(config), dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                             microbatches=microbatches, mtp=mtp, kv_int8=kv_int8, quant=quant, layers=layers,
                             acceptance=acceptance, progress=progress, profile=profile, preset=preset,
                             shared_expert_dies=shared_expert_dies, redundant_experts=redundant_experts)
    out = res.to_dict()
    out["wall_s"] = time.perf_counter() - t0
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _deployment_dies(preset, dies) -> int:
    """The pod size a command asks for (its --dies, else its preset's, else the default deployment's)."""
    from .deployment import resolve
    return resolve(preset=preset).dies if dies is None else dies


@command("serve-model", "timing-only decode step of a whole model (DP attention + EP MoE): modeled TPOT, tokens/s",
         _serve_args, profile=True)
def _serve_model(args) -> int:
    dies = _deployment_dies(args.preset, args.dies)
    pod_profile(args.profile, max(dies, 2), "--dies", f"{dies} DP/EP ranks")
    kw = dict(config=args.config, dies=args.dies, batch_per_die=args.batch_per_die, seq_len=args.seq_len,
              microbatches=args.microbatches, mtp=args.mtp, kv_int8=args.kv_int8,
              quant=None if args.bf16 is None else not args.bf16, layers=args.layers, acceptance=args.acceptance,
              profile=args.profile, preset=args.preset, shared_expert_dies=args.shared_expert_dies,
              redundant_experts=args.redundant_experts)
    with progress(args, "serve-model") as bar:
        out = run_serve_model(**kw, progress=lambda name: bar.update(f"simulating {name}"))
    add_workers_block(args, out)
    if args.json:
        print(json.dumps(out, default=float))
    else:
        _print_summary(out)
    return 0


def _print_summary(out: dict) -> None:
    from rich.table import Table
    con = console()
    layout = (f" ({out['shared_expert_dies']} shared-expert dies, {out['redundant_experts']} redundant experts)"
              if out["shared_expert_dies"] or out["redundant_experts"] else "")
    preset = f" (preset {out['preset']})" if out["preset"] != "custom" else ""
    con.print(f"[bold]{out['config']}[/]{preset} decode on {out['dies']} dies{layout}, {out['batch_per_die']} "
              f"seqs/die at {out['seq_len']} context, {out['microbatches']} microbatch(es), MTP {out['mtp']}"
              f"{' (acceptance %.2f)' % out['acceptance'] if out['mtp'] else ''}, "
              f"{'INT8' if out['quant'] else 'bf16'} experts, {'int8' if out['kv_int8'] else 'bf16'} KV cache")
    con.print(f"modeled TPOT {out['modeled_tpot_ms']:.2f} ms (step {out['step_us'] / 1000:.2f} ms, "
              f"{out['tokens_per_step']:.2f} tokens/step); {out['tokens_per_s_per_die']:,.0f} tokens/s per die "
              f"({out['tokens_per_s_per_npu']:,.0f} per NPU), "
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


_PRESET_OR = "(None: the preset's, else "


@register("decode-layer", "one decoder layer (attention + MoE or dense FFN) of a DP/EP decode step, timing-only", (
    Option("--config", str, "v3", "model shapes", ("v3", "mini")),
    Option("--kind", str, "moe", "layer kind", ("moe", "dense")),
    Option("--preset", str, None, "a named deployment (serving.deployment.PRESETS); the options below override "
                                  "its fields", tuple(sorted(PRESETS))),
    Option("--dies", int, None, f"dies (DP attention ranks = EP ranks) {_PRESET_OR}16)", min=1),
    Option("--batch-per-die", int, None, f"sequences per die {_PRESET_OR}96)", min=1),
    Option("--seq-len", int, None, f"context length {_PRESET_OR}4096)", min=1),
    Option("--shared-expert-dies", int, None, f"dies hosting a copy of the shared expert {_PRESET_OR}0: the "
                                              f"shared expert on every die)", min=0),
    Option("--redundant-experts", int, None, f"redundant routed experts placed by eplb {_PRESET_OR}0)", min=0),
    Option("--microbatches", int, None, f"1: one stream; 2: attention / MoE streams on split cores "
                                        f"{_PRESET_OR}2)", (1, 2)),
    Option("--mtp", int, None, f"MTP depth: 1 + mtp query tokens per sequence {_PRESET_OR}0)", (0, 1)),
    Option("--kv-int8", int, None, f"int8 latent cache {_PRESET_OR}0)", (0, 1)),
    Option("--quant", int, None, f"W8A8: INT8 experts / FFN / o_proj / W_uq_qr / dispatch {_PRESET_OR}1)", (0, 1)),
    Option("--sim-layers", int, 0, "consecutive layers simulated (0: 1 with one microbatch, 2 with two; see "
                                   "serving.timing for how the period is taken)", min=0),
))
def _decode_layer(config, kind, dies, batch_per_die, seq_len, microbatches, mtp, kv_int8, quant, sim_layers,
                  preset=None, shared_expert_dies=None, redundant_experts=None, trace=False, profile=None):
    from .config import get_config
    from .timing import layer_timing
    pod_dies = _deployment_dies(preset, dies)
    prof = pod_profile(profile, max(pod_dies, 2), "--dies", f"{pod_dies} DP/EP ranks")
    flag = lambda v: None if v is None else bool(v)
    r = layer_timing(get_config(config), kind, dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                     microbatches=microbatches, query_tokens=None if mtp is None else 1 + mtp, kv_int8=flag(kv_int8),
                     quant=flag(quant), sim_layers=sim_layers or None, trace=trace, profile=prof, preset=preset,
                     shared_expert_dies=shared_expert_dies, redundant_experts=redundant_experts)
    dep = r.deployment
    return {"op": "decode-layer", "modeled_us": r.period_us, "first_layer_us": r.first_layer_us,
            "bytes_moved": r.bytes_moved, "utilization": r.utilization["hbm"], "utilization_detail": r.utilization,
            "breakdown_us": r.breakdown_us, "stream_busy_us": r.stream_busy_us, "bound": r.bound,
            "instructions": r.instructions, "roofline": r.roofline, "preset": dep.name, "deployment": dep.to_dict(),
            "shared_expert_dies": dep.shared_expert_dies, "redundant_experts": dep.redundant_experts,
            "compute_dies": r.compute_dies,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "run": r.run}


# ---------------------------------------------------------------------------------------- expert pipeline
PIPELINE_OPTIONS = (
    Option("--attn-dies", int, 8, "attention dies per DP domain", min=1),
    Option("--domains", int, 2, "DP domains (take turns)", min=1),
    Option("--microbatches", int, 2, "microbatches per domain", min=1),
    Option("--expert-dies", int, 16, "expert dies", min=1),
    Option("--experts", int, 0, "routed experts (0: two per expert die)", min=0, param="num_experts"),
    Option("--batch-per-die", int, 32, "tokens per attention die per layer (split over the microbatches)", min=1),
    Option("--hidden", int, 2048, "hidden size (bf16; an expert is one [hidden, hidden] GEMM)", min=1),
    Option("--topk", int, 8, "experts per token", min=1),
    Option("--layers", int, 2, "MoE layers", min=1),
    Option("--attn-us", float, 100.0, "modeled attention time per layer of one die's whole batch (us)", min=0.0),
    Option("--slots", int, 2, "buffer slots per expert die (2 = double buffering)", min=1),
    Option("--trampoline", int, 1, "1: trampoline forwarding; 0: direct", choices=(0, 1)),
    Option("--recv-aiv", int, 24, "receive-stream AIVs per expert die", min=1, max="aiv_per_die"),
    Option("--send-aiv", int, 24, "send-stream AIVs per expert die", min=1, max="aiv_per_die"),
    Option("--aic", int, 24, "compute-stream AICs per expert die", min=1, max="aic_per_die"),
)


def run_pipeline(attn_dies, domains, microbatches, expert_dies, experts, batch_per_die, hidden, topk, layers, attn_us,
                 slots=2, trampoline=1, recv_aiv=24, send_aiv=24, aic=24, trace=False, seed=0, profile=None):
    """Build the pod and run the pipeline timing-only; returns (PipelineResult, wall seconds)."""
    from ascend_emu import Pod

    from .expert_pipeline import ExpertPipeline, StreamSplit
    n_exp = experts or 2 * expert_dies
    not_above("--topk", topk, n_exp, f"the {n_exp} routed experts (--experts, 0: two per --expert-dies)")
    n_attn = domains * attn_dies
    prof = pod_profile(profile, n_attn + expert_dies, "--attn-dies",
                       f"--domains {domains} x --attn-dies {attn_dies} + --expert-dies {expert_dies}")
    pod = Pod(prof, trace=trace, max_modeled_us=None)
    doms = [list(range(i * attn_dies, (i + 1) * attn_dies)) for i in range(domains)]
    pipe = ExpertPipeline(pod, doms, list(range(n_attn, n_attn + expert_dies)), num_experts=n_exp, hidden=hidden,
                          num_microbatches=microbatches, trampoline=bool(trampoline), num_slots=slots,
                          split=StreamSplit(recv_aiv=recv_aiv, send_aiv=send_aiv, aic=aic))
    rng = np.random.default_rng(seed)
    kth = min(topk, n_exp - 1)        # topk == n_exp routes to every expert: the largest valid partition index
    ids = [[rng.random((batch_per_die, n_exp)).argpartition(kth, axis=1)[:, :topk] for _ in range(n_attn)]
           for _ in range(layers)]
    w = [[np.full((batch_per_die, topk), 1.0 / topk, np.float32)] * n_attn for _ in range(layers)]
    t0 = time.perf_counter()
    res = pipe.run(ids, w, numeric=False, attn_us=attn_us)
    return res, time.perf_counter() - t0


@register("expert-pipeline", "persistent receive / grouped-GEMM / send streams on expert dies, DP domains x "
          "microbatches of attention dies taking turns", PIPELINE_OPTIONS)
def _expert_pipeline(trace=False, **kw):
    res, wall = run_pipeline(trace=trace, **kw)
    return {"op": "expert-pipeline", "modeled_us": res.modeled_us, "kernel_us": res.window_us,
            "bytes_moved": res.run.bytes_moved, "utilization": res.expert_busy, "expert_busy": res.expert_busy,
            "recv_busy": res.mean_stream_busy("recv"), "compute_busy": res.mean_stream_busy("compute"),
            "send_busy": res.mean_stream_busy("send"), "cube_utilization": res.cube_utilization,
            "layer_us": [float(t) for t in res.layer_us], "exchange_us_mean": float(res.exchange_us.mean()),
            "instructions": res.run.instructions, "wall_s": wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "run": res.run}
