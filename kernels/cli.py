"""``ascend-emu model`` ops of the kernels layer (timing-only, any scale; defaults are DeepSeek-V3 shapes) and
``ascend-emu calibrate``.

- ``grouped-gemm``: the decode MoE expert GEMM. Default shape: one EP rank of DeepSeek-V3 decode on CloudMatrix384
  (256 experts, 8 per rank; 128 tokens x top-8 land on the rank, M = 1024 rows spread evenly over its 8 experts;
  gate+up projection K = 7168, N = 2 x 2048, int8 with per-channel and per-token scales, fused SwiGLU):

      ascend-emu model grouped-gemm --groups 8 --m 1024 --n 4096 --k 7168 --dtype int8 --swiglu 1 --json

- ``mla-prolog``, ``attention``: the MLA kernels. ``fused-dispatch``, ``fused-combine``: the push-based MoE exchange.
- ``calibrate``: fused dispatch/combine at EP 8..256 against the published CloudMatrix384 table (DESIGN.md 9).

Registered with the ``ascend-emu`` command through the ``ascend_emu.cli`` entry point (pyproject.toml).
"""
from __future__ import annotations

import json

import numpy as np

from ascend_emu.cli import (Option, OptionError, add_workers, add_workers_block, command, console, not_above,
                            pod_profile, progress, register)


# ------------------------------------------------------------------------------------------------ grouped GEMM
def run_grouped_gemm(groups: int, m: int, n: int, k: int, dtype: str = "int8", swiglu: int = 1,
                     weight_format: str = "NZ", aic: int = 24, trace: bool = False, profile=None) -> dict:
    """Timing-only grouped GEMM on one die: ``m`` rows split as evenly as possible over ``groups`` experts."""
    import torch

    from ascend_emu import Pod

    from .grouped_matmul import grouped_matmul
    tdt = {"int8": torch.int8, "bf16": torch.bfloat16}[dtype]
    x = torch.empty(m, k, dtype=tdt, device="meta")
    w = torch.empty(groups, k, n, dtype=tdt, device="meta")
    counts = np.full(groups, m // groups, dtype=np.int64)
    counts[: m % groups] += 1
    ends = torch.from_numpy(np.cumsum(counts))
    kw = {}
    if dtype == "int8":
        kw = {"scale": torch.empty(groups, n, device="meta"), "per_token_scale": torch.empty(m, device="meta")}
    pod = Pod(pod_profile(profile), trace=trace)
    res = grouped_matmul(x, w, group_list=ends, swiglu=bool(swiglu), weight_format=weight_format, numeric=False,
                         cores=aic, pod=pod, **kw)
    run = res.run
    prof = pod.profile
    util = res.cube_utilization(prof, dtype)
    weight_bytes = groups * k * n * np.dtype(np.int8 if dtype == "int8" else np.float16).itemsize
    return {"op": "grouped-gemm", "modeled_us": run.modeled_us, "bytes_moved": run.bytes_moved,
            "utilization": min(1.0, util),
            "extras": {"kernel_us": run.kernel_us, "tops": 2.0 * res.macs / (run.kernel_us * 1e-6) / 1e12,
                       "peak_tops": prof.peak_cube_tflops(dtype), "weight_bytes": weight_bytes,
                       "hbm_utilization": run.servers.get("hbm0", {}).get("utilization", 0.0),
                       "pipe_utilization": run.utilization, "instructions": run.instructions,
                       "rows_per_group": counts.tolist()[:4] + (["..."] if groups > 4 else [])},
            "run": run}


@register("grouped-gemm", "MoE grouped GEMM (npu_grouped_matmul): AIC 128x256 tiles + AIV dequant/SwiGLU epilogue", (
    Option("--groups", int, 8, "experts on the rank (weight groups)", min=1),
    Option("--m", int, 1024, "rows (tokens x top-k routed to the rank), split evenly over the groups", min=1),
    Option("--n", int, 4096, "output columns per expert (gate+up: 2 x intermediate)", min=1),
    Option("--k", int, 7168, "hidden size", min=1),
    Option("--dtype", str, "int8", "int8 (W8A8, per-channel x per-token dequant) or bf16", ("int8", "bf16")),
    Option("--swiglu", int, 1, "1: fuse SwiGLU on the [gate | up] halves (output N/2)", (0, 1)),
    Option("--format", str, "NZ", "weight layout in GM", ("ND", "NZ")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)", min=1, max="aic_per_die", param="cores"),
))
def _grouped_gemm(groups, m, n, k, dtype, swiglu, format, aic, trace=False, profile=None):
    return run_grouped_gemm(groups, m, n, k, dtype, swiglu, format, aic, trace, profile)


# --------------------------------------------------------------------------------------------------------- MLA
def _hbm(run) -> float:
    return max((s["utilization"] for k, s in run.servers.items() if k.startswith("hbm")), default=0.0)


@register("mla-prolog", "fused MLAProlog (npu_mla_prolog_v3): AIC matmuls + AIV norms/RoPE/cache scatter", (
    Option("--tokens", int, 96, "tokens of the decode step (batch x query tokens)", min=1),
    Option("--heads", int, 128, "attention heads N", min=1),
    Option("--quant-mode", int, 0, "weight_quant_mode: 0 bf16, 1 int8 weight_uq_qr, 2 int8 x and weights",
           (0, 1, 2)),
    Option("--kv-quant", int, 0, "kv_cache_quant_mode: 0 bf16, 1 int8", (0, 1)),
    Option("--cache-mode", str, "PA_NZ", "cache layout", ("PA_BSND", "PA_NZ")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)", min=1, max="aic_per_die"),
    Option("--staged", int, 1, "also run the five stages one after the other and report their sum (0/1)", (0, 1)),
))
def _mla_prolog(tokens, heads, quant_mode, kv_quant, cache_mode, aic, staged, trace=False, profile=None):
    from ascend_emu import Pod

    from .mla import mla_prolog_timing, prolog_flops
    prof = pod_profile(profile)
    kw = dict(n=heads, weight_quant_mode=quant_mode, kv_cache_quant_mode=kv_quant, cache_mode=cache_mode, aic=aic)
    r = mla_prolog_timing(tokens, pod=Pod(prof, trace=trace), **kw)
    run = r.run
    flops = prolog_flops((tokens, 7168, 1536, 512, heads, 128, 64))
    peak = prof.peak_cube_tflops("int8" if quant_mode == 2 else "bf16") * 1e12 * aic / prof.aic_per_die
    out = {"op": "mla-prolog", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
           "bytes_moved": run.bytes_moved, "utilization": flops / (run.kernel_us * 1e-6) / peak,
           "cube_utilization": flops / (run.kernel_us * 1e-6) / peak, "hbm_utilization": _hbm(run),
           "instructions": run.instructions, "run": run}
    if staged:
        out["staged_kernel_us"] = mla_prolog_timing(tokens, staged=True, pod=Pod(prof, trace=False), **kw).kernel_us
    return out


@register("attention", "MLA decode attention over the paged latent cache (absorb mode, flash tiling)", (
    Option("--batch", int, 96, "sequences", min=1),
    Option("--seq-len", int, 4096, "kv length per sequence", min=1),
    Option("--heads", int, 128, "attention heads N", min=1),
    Option("--mtp", int, 0, "MTP depth: 1 + mtp query tokens per sequence", min=0),
    Option("--block-size", int, 128, "page size", (16, 128)),
    Option("--tiling", str, "balanced", "work split", ("balanced", "batch")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)", min=1, max="aic_per_die"),
    Option("--kv-int8", int, 0, "latent cache: 0 bf16, 1 int8 with a per-channel scale (dequantised on the cube)",
           (0, 1)),
    Option("--cache-mode", str, "PA_BSND", "cache layout", ("PA_BSND", "PA_NZ")),
))
def _attention(batch, seq_len, heads, mtp, block_size, tiling, aic, kv_int8=0, cache_mode="PA_BSND", trace=False,
               profile=None):
    from ascend_emu import Pod

    from .attention import attention_bytes, attention_flops, mla_decode_attention_timing
    prof = pod_profile(profile)
    r = mla_decode_attention_timing(batch, seq_len, heads=heads, mtp=mtp, block_size=block_size, tiling=tiling,
                                    kv_int8=bool(kv_int8), cache_mode=cache_mode, aic=aic,
                                    pod=Pod(prof, trace=trace))
    run = r.run
    lens = [seq_len] * batch
    need = attention_bytes(lens, 1 + mtp, heads, 512, 64, kv_bytes=1 if kv_int8 else 2)
    flops = attention_flops(lens, 1 + mtp, heads, 512, 64)
    return {"op": "attention", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": need / (run.kernel_us * 1e-6) / (prof.hbm_gbps * 1e9),
            "hbm_utilization": _hbm(run),
            "compulsory_bytes": need, "bandwidth_efficiency": need / (run.kernel_us * 1e-6) / (prof.hbm_gbps * 1e9),
            "cube_utilization": flops / (run.kernel_us * 1e-6) / (prof.peak_cube_tflops("bf16") * 1e12 * aic
                                                                   / prof.aic_per_die),
            "instructions": run.instructions, "run": run}


# ------------------------------------------------------------------------------ fused dispatch / combine
FUSED_OPTIONS = (
    Option("--ep", int, 8, "expert-parallel ranks (dies 0 .. ep-1)", min=1),
    Option("--tokens-per-rank", int, 128, "tokens per rank", min=1),
    Option("--hidden", int, 7168, "hidden size (elements)", min=1),
    Option("--topk", int, 8, "experts per token", min=1),
    Option("--experts", int, 256, "routed experts (experts / ep per rank)", min=1, param="num_experts"),
    Option("--quant", int, 1, "1: INT8 + per-token scale records; 0: bf16", choices=(0, 1)),
)


def _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace, profile=None):
    from ascend_emu import Pod

    from .fused_moe import MoeGroup
    not_above("--topk", topk, experts, f"the --experts {experts}")
    pod = Pod(pod_profile(profile, max(ep, 2), "--ep", f"EP {ep}"), trace=trace)
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
def _fused_dispatch(ep, tokens_per_rank, hidden, topk, experts, quant, trace=False, profile=None):
    from .fused_moe import moe_distribute_dispatch
    g, ids = _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace, profile)
    res = moe_distribute_dispatch(None, ids, g, numeric=False)
    return _figures("fused-dispatch", res.run, window_bytes_per_die=g.window_bytes())


@register("fused-combine", "FusedCombine: bf16 rows back to their tokens, per-token arrival counters, fp32 sum",
          FUSED_OPTIONS)
def _fused_combine(ep, tokens_per_rank, hidden, topk, experts, quant, trace=False, profile=None):
    from .fused_moe import moe_distribute_combine, moe_distribute_dispatch
    g, ids = _group(ep, tokens_per_rank, hidden, topk, experts, quant, trace, profile)
    res = moe_distribute_dispatch(None, ids, g, numeric=False)
    _, run = moe_distribute_combine(None, res, [np.ones((tokens_per_rank, topk), np.float32)] * ep, g,
                                    numeric=False)
    return _figures("fused-combine", run)


# ------------------------------------------------------------------------------------------------- calibrate
def _calibrate_args(p):
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256], help="EP sizes to sweep")
    p.add_argument("--gemm", type=int, choices=(0, 1), default=1, help="also the grouped INT8 GEMM point (1)")
    add_workers(p)


@command("calibrate", "the timing model vs the calibration set: fused dispatch/combine at EP 8..256 and the grouped "
         "INT8 GEMM (DESIGN.md 9)", _calibrate_args, profile=True)
def _calibrate(args) -> int:
    from .calibrate import PUBLISHED, calibrate
    bad = [e for e in args.ep if e not in PUBLISHED]
    if bad:
        raise OptionError(f"--ep: {bad} not in the published table's EP {sorted(PUBLISHED)}", "--ep")
    for ep in args.ep:
        pod_profile(args.profile, max(ep, 2), "--ep", f"EP {ep}")
    with progress(args, "calibrate", total=len(args.ep) + args.gemm) as bar:
        res = calibrate(args.ep, profile=args.profile, gemm=bool(args.gemm),
                        progress=lambda what: bar.update(f"calibrate: {what} done", advance=1))
    add_workers_block(args, res)
    if args.json:
        print(json.dumps(res))
        return 0
    from rich.table import Table
    t = Table(title="calibration set: modeled kernel latency vs published (us); mechanism = fitted residuals at 0")
    for c in ("op", "EP", "published", "modeled", "err %", "mechanism", "residual"):
        t.add_column(c, justify="right")
    for p in res["points"]:
        for op in ("dispatch", "combine"):
            t.add_row(op, str(p["ep"]), f"{p[f'published_{op}_us']:.0f}", f"{p[f'{op}_us']:.1f}",
                      f"{p[f'{op}_err_pct']:.1f}", f"{p[f'mechanism_{op}_us']:.1f}", f"{p[f'residual_{op}_us']:.1f}")
    g = res.get("gemm")
    if g is not None:
        t.add_row("grouped GEMM", "-", f"{g['published_us']:.0f}", f"{g['modeled_us']:.1f}", f"{g['err_pct']:.1f}",
                  f"{g['mechanism_us']:.1f}", f"{g['residual_us']:.1f}")
    con = console()
    con.print(t)
    f = res["fitted"]
    con.print(f"dispatch/combine: mean abs error {res['mean_abs_pct_err']:.1f} %, max {res['max_abs_pct_err']:.1f} %; "
              f"fitted: l2_gbps {f['l2_gbps']:.0f}, mte_startup_cycles {f['mte_startup_cycles']}, "
              f"comm_start_us {f['comm_start_us']:.1f}")
    return 0
