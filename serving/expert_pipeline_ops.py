"""``ascend-emu model expert-pipeline``: persistent expert kernels (serving.expert_pipeline), timing-only.

Dies: domain ``i`` holds attention dies ``i*A .. (i+1)*A - 1``; the expert dies follow. Routing: uniform random top-k
without repetition over ``--experts`` (default: 2 per expert die), seeded; gating weights 1/k.
"""
from __future__ import annotations

import resource
import time

import numpy as np

from ascend_emu.ops import Option, register

PIPELINE_OPTIONS = (
    Option("--attn-dies", int, 8, "attention dies per DP domain"),
    Option("--domains", int, 2, "DP domains (take turns)"),
    Option("--microbatches", int, 2, "microbatches per domain"),
    Option("--expert-dies", int, 16, "expert dies"),
    Option("--experts", int, 0, "routed experts (0: two per expert die)"),
    Option("--batch-per-die", int, 32, "tokens per attention die per layer (split over the microbatches)"),
    Option("--hidden", int, 2048, "hidden size (bf16; an expert is one [hidden, hidden] GEMM)"),
    Option("--topk", int, 8, "experts per token"),
    Option("--layers", int, 2, "MoE layers"),
    Option("--attn-us", float, 100.0, "modeled attention time per layer of one die's whole batch (us)"),
    Option("--slots", int, 2, "buffer slots per expert die (2 = double buffering)"),
    Option("--trampoline", int, 1, "1: trampoline forwarding; 0: direct", choices=(0, 1)),
    Option("--recv-aiv", int, 24, "receive-stream AIVs per expert die"),
    Option("--send-aiv", int, 24, "send-stream AIVs per expert die"),
    Option("--aic", int, 24, "compute-stream AICs per expert die"),
)


def run_pipeline(attn_dies, domains, microbatches, expert_dies, experts, batch_per_die, hidden, topk, layers, attn_us,
                 slots=2, trampoline=1, recv_aiv=24, send_aiv=24, aic=24, trace=False, seed=0):
    """Build the pod and run the pipeline timing-only; returns (PipelineResult, wall seconds)."""
    from ascend_emu import Pod, cloudmatrix384

    from .expert_pipeline import ExpertPipeline, StreamSplit
    n_exp = experts or 2 * expert_dies
    n_attn = domains * attn_dies
    pod = Pod(cloudmatrix384(dies=n_attn + expert_dies), trace=trace, max_modeled_us=None)
    doms = [list(range(i * attn_dies, (i + 1) * attn_dies)) for i in range(domains)]
    pipe = ExpertPipeline(pod, doms, list(range(n_attn, n_attn + expert_dies)), num_experts=n_exp, hidden=hidden,
                          num_microbatches=microbatches, trampoline=bool(trampoline), num_slots=slots,
                          split=StreamSplit(recv_aiv=recv_aiv, send_aiv=send_aiv, aic=aic))
    rng = np.random.default_rng(seed)
    ids = [[rng.random((batch_per_die, n_exp)).argpartition(topk, axis=1)[:, :topk] for _ in range(n_attn)]
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
