"""``ascend-emu model`` ops ``a2e`` and ``e2a``: disaggregated MoE-attention exchange, timing-only, any scale.

Dies: domain ``i`` holds attention dies ``i*A .. (i+1)*A - 1``; the expert dies follow (``D*A .. D*A + E - 1``). The
domains take turns (each domain's A2E and E2A run after the previous domain's E2A). Routing: uniform random top-k
without repetition over ``--experts`` (default: one expert per expert die), seeded.
"""
from __future__ import annotations

import resource
import time

import numpy as np

from ascend_emu.ops import Option, register

A2E_OPTIONS = (
    Option("--attn-dies", int, 160, "attention dies per DP domain"),
    Option("--expert-dies", int, 288, "expert dies"),
    Option("--batch-per-die", int, 96, "tokens per attention die"),
    Option("--hidden", int, 7168, "hidden size (bf16 on the wire)"),
    Option("--topk", int, 8, "experts per token"),
    Option("--domains", int, 1, "DP domains (take turns)"),
    Option("--experts", int, 0, "routed experts (0: one per expert die)"),
    Option("--trampoline", int, 1, "1: trampoline forwarding; 0: direct", choices=(0, 1)),
    Option("--direct", int, 0, "1: direct mode (overrides --trampoline)", choices=(0, 1)),
    Option("--path", str, "mtu", "mtu (AIV copies) or dma (DMA engine) for the attention <-> trampoline hops "
           "(the A2E forward to partners always runs on the trampolines' AIVs)", ("mtu", "dma")),
    Option("--cores", int, 48, "AIV cores per die"),
)


def run_exchange(attn_dies, expert_dies, batch_per_die, hidden, topk, domains, experts, trampoline, path, cores,
                 direct=0, trace=False, seed=0, profile=None):
    """Queue every domain's A2E and E2A, run once; returns (group, [(a2e handle, e2a handle)], run, wall s)."""
    from ascend_emu import Pod, cloudmatrix384

    from .a2e import A2EGroup
    n_exp = experts or expert_dies
    dies = domains * attn_dies + expert_dies
    pod = Pod((profile or cloudmatrix384()).replace(dies=dies), trace=trace, max_modeled_us=None)
    doms = [list(range(i * attn_dies, (i + 1) * attn_dies)) for i in range(domains)]
    grp = A2EGroup(pod, doms, list(range(domains * attn_dies, dies)), num_experts=n_exp, hidden=hidden,
                   trampoline=bool(trampoline) and not direct, path=path, cores=cores, phantom=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    pairs, prev = [], []
    for d in range(domains):
        ids = [rng.random((batch_per_die, n_exp)).argpartition(topk, axis=1)[:, :topk] for _ in range(attn_dies)]
        w = [np.full((batch_per_die, topk), 1.0 / topk, np.float32)] * attn_dies
        h = grp.a2e(d, None, ids, w, numeric=False, after=prev)
        o = grp.e2a(h)
        prev = [o.launch]
        pairs.append((h, o))
    run = pod.synchronize()
    return grp, pairs, run, time.perf_counter() - t0


def _figures(op, grp, pairs, run, wall, which):
    per = []
    for h, o in pairs:
        la = h.launch if which == "a2e" else o.launch
        per.append((la.end_ps - la.start_ps) / 1e6)
    port, util = run.busiest_port()
    return {"op": op, "modeled_us": run.modeled_us, "kernel_us": run.kernel_us, "bytes_moved": run.bytes_moved,
            "utilization": util, "busiest_port": port, f"{which}_us_per_domain": per,
            "a2e_us": [(h.launch.end_ps - h.launch.start_ps) / 1e6 for h, _ in pairs],
            "e2a_us": [(o.launch.end_ps - o.launch.start_ps) / 1e6 for _, o in pairs],
            "trampolines": grp.num_trampolines, "instructions": run.instructions, "wall_s": wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "run": run}


@register("a2e", "attention -> expert dies (A2E), trampoline or direct; runs A2E + E2A, reports A2E", A2E_OPTIONS)
def _a2e(trace=False, **kw):
    grp, pairs, run, wall = run_exchange(trace=trace, **kw)
    return _figures("a2e", grp, pairs, run, wall, "a2e")


@register("e2a", "expert -> attention dies (E2A, weighted sum); runs A2E + E2A, reports E2A", A2E_OPTIONS)
def _e2a(trace=False, **kw):
    grp, pairs, run, wall = run_exchange(trace=trace, **kw)
    return _figures("e2a", grp, pairs, run, wall, "e2a")
