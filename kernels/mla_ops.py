"""``ascend-emu model`` ops for the MLA kernels (timing-only, any scale; defaults are DeepSeek-V3 shapes)."""
from __future__ import annotations

from ascend_emu.ops import Option, register


def _hbm(run) -> float:
    return max((s["utilization"] for k, s in run.servers.items() if k.startswith("hbm")), default=0.0)


@register("mla-prolog", "fused MLAProlog (npu_mla_prolog_v3): AIC matmuls + AIV norms/RoPE/cache scatter", (
    Option("--tokens", int, 96, "tokens of the decode step (batch x query tokens)"),
    Option("--heads", int, 128, "attention heads N"),
    Option("--quant-mode", int, 0, "weight_quant_mode: 0 bf16, 1 int8 weight_uq_qr, 2 int8 x and weights",
           (0, 1, 2)),
    Option("--kv-quant", int, 0, "kv_cache_quant_mode: 0 bf16, 1 int8", (0, 1)),
    Option("--cache-mode", str, "PA_NZ", "cache layout", ("PA_BSND", "PA_NZ")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)"),
    Option("--staged", int, 1, "also run the five stages one after the other and report their sum (0/1)"),
))
def _mla_prolog(tokens, heads, quant_mode, kv_quant, cache_mode, aic, staged, trace=False):
    from .mla import mla_prolog_timing, prolog_flops
    kw = dict(n=heads, weight_quant_mode=quant_mode, kv_cache_quant_mode=kv_quant, cache_mode=cache_mode, aic=aic)
    r = mla_prolog_timing(tokens, trace=trace, **kw)
    run = r.run
    flops = prolog_flops((tokens, 7168, 1536, 512, heads, 128, 64))
    from ascend_emu import cloudmatrix384
    peak = cloudmatrix384().peak_cube_tflops("int8" if quant_mode == 2 else "bf16") * 1e12 * aic / 24
    out = {"op": "mla-prolog", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
           "bytes_moved": run.bytes_moved, "utilization": flops / (run.kernel_us * 1e-6) / peak,
           "cube_utilization": flops / (run.kernel_us * 1e-6) / peak, "hbm_utilization": _hbm(run),
           "instructions": run.instructions, "run": run}
    if staged:
        out["staged_kernel_us"] = mla_prolog_timing(tokens, staged=True, **kw).kernel_us
    return out


@register("attention", "MLA decode attention over the paged latent cache (absorb mode, flash tiling)", (
    Option("--batch", int, 96, "sequences"),
    Option("--seq-len", int, 4096, "kv length per sequence"),
    Option("--heads", int, 128, "attention heads N"),
    Option("--mtp", int, 0, "MTP depth: 1 + mtp query tokens per sequence"),
    Option("--block-size", int, 128, "page size", (16, 128)),
    Option("--tiling", str, "balanced", "work split", ("balanced", "batch")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)"),
    Option("--kv-int8", int, 0, "latent cache: 0 bf16, 1 int8 with a per-channel scale (dequantised on the cube)",
           (0, 1)),
    Option("--cache-mode", str, "PA_BSND", "cache layout", ("PA_BSND", "PA_NZ")),
))
def _attention(batch, seq_len, heads, mtp, block_size, tiling, aic, kv_int8=0, cache_mode="PA_BSND", trace=False):
    from .attention import attention_bytes, attention_flops, mla_decode_attention_timing
    from ascend_emu import cloudmatrix384
    r = mla_decode_attention_timing(batch, seq_len, heads=heads, mtp=mtp, block_size=block_size, tiling=tiling,
                                    kv_int8=bool(kv_int8), cache_mode=cache_mode, aic=aic, trace=trace)
    run = r.run
    lens = [seq_len] * batch
    need = attention_bytes(lens, 1 + mtp, heads, 512, 64, kv_bytes=1 if kv_int8 else 2)
    prof = cloudmatrix384()
    flops = attention_flops(lens, 1 + mtp, heads, 512, 64)
    return {"op": "attention", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": need / (run.kernel_us * 1e-6) / (prof.hbm_gbps * 1e9),
            "hbm_utilization": _hbm(run),
            "compulsory_bytes": need, "bandwidth_efficiency": need / (run.kernel_us * 1e-6) / (prof.hbm_gbps * 1e9),
            "cube_utilization": flops / (run.kernel_us * 1e-6) / (prof.peak_cube_tflops("bf16") * 1e12 * aic / 24),
            "instructions": run.instructions, "run": run}
