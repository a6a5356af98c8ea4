"""``ascend-emu model grouped-gemm``: the decode MoE expert GEMM, timing-only, at any scale.

Default shape: one EP rank of DeepSeek-V3 decode on CloudMatrix384 (256 experts, 8 per rank; 128 tokens x top-8
land on the rank, M = 1024 rows spread evenly over its 8 experts; gate+up projection K = 7168, N = 2 x 2048, int8
with per-channel and per-token scales, fused SwiGLU):

    ascend-emu model grouped-gemm --groups 8 --m 1024 --n 4096 --k 7168 --dtype int8 --swiglu 1 --json
"""
from __future__ import annotations

import numpy as np

from ascend_emu import cloudmatrix384
from ascend_emu.ops import Option, register


def run_grouped_gemm(groups: int, m: int, n: int, k: int, dtype: str = "int8", swiglu: int = 1,
                     weight_format: str = "NZ", aic: int = 24, trace: bool = False) -> dict:
    """Timing-only grouped GEMM on one die: ``m`` rows split as evenly as possible over ``groups`` experts."""
    import torch
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
    res = grouped_matmul(x, w, group_list=ends, swiglu=bool(swiglu), weight_format=weight_format, numeric=False,
                         cores=aic, trace=trace, **kw)
    run = res.run
    prof = cloudmatrix384()
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
    Option("--groups", int, 8, "experts on the rank (weight groups)"),
    Option("--m", int, 1024, "rows (tokens x top-k routed to the rank), split evenly over the groups"),
    Option("--n", int, 4096, "output columns per expert (gate+up: 2 x intermediate)"),
    Option("--k", int, 7168, "hidden size"),
    Option("--dtype", str, "int8", "int8 (W8A8, per-channel x per-token dequant) or bf16", ("int8", "bf16")),
    Option("--swiglu", int, 1, "1: fuse SwiGLU on the [gate | up] halves (output N/2)", (0, 1)),
    Option("--format", str, "NZ", "weight layout in GM", ("ND", "NZ")),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)"),
))
def _grouped_gemm(groups, m, n, k, dtype, swiglu, format, aic, trace=False):
    return run_grouped_gemm(groups, m, n, k, dtype, swiglu, format, aic, trace)
