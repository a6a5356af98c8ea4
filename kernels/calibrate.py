"""``ascend-emu calibrate``: fused dispatch / combine at EP 8..256 in timing-only mode against the published table.

The published figures (DESIGN.md 9: CloudMatrix384, CANN EP, 128 tokens per rank, hidden 7168, top-8, INT8 dispatch,
bf16 combine) are operator latencies on the device; the modeled figure compared with them is the kernel time of
the run (first rank's kernel start to the last rank's kernel end), without host launch overhead.
Routing is uniform random top-8 without repetition over 256 experts, seeded, so every point is deterministic.
"""
from __future__ import annotations

import time

import numpy as np

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.profile import HardwareProfile

from .fused_moe import MoeGroup, moe_distribute_combine, moe_distribute_dispatch

PUBLISHED = {  # EP ranks -> (dispatch us, combine us)
    8: (116.0, 118.0), 16: (131.0, 132.0), 32: (133.0, 146.0), 64: (141.0, 150.0), 128: (152.0, 150.0),
    256: (152.0, 149.0),
}


def measure(ep: int, profile: HardwareProfile | None = None, *, tokens: int = 128, hidden: int = 7168,
            topk: int = 8, experts: int = 256, seed: int = 0) -> dict:
    """Modeled kernel latency (us) of one fused dispatch and the combine that follows, at ``ep`` ranks."""
    prof = profile or cloudmatrix384()
    prof = prof.replace(dies=max(ep, 2))
    pod = Pod(prof, trace=False)
    g = MoeGroup(pod, range(ep), max_bs=tokens, hidden=hidden, topk=topk, num_experts=experts, phantom=True)
    rng = np.random.default_rng(seed)
    ids = [np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk] for _ in range(ep)]
    t0 = time.perf_counter()
    d = moe_distribute_dispatch(None, ids, g, numeric=False)
    t1 = time.perf_counter()
    _, c = moe_distribute_combine(None, d, [np.ones((tokens, topk), np.float32)] * ep, g, numeric=False)
    t2 = time.perf_counter()
    return {"ep": ep, "dispatch_us": d.run.kernel_us, "combine_us": c.kernel_us,
            "wall_s": {"dispatch": t1 - t0, "combine": t2 - t1},
            "instructions": d.run.instructions + c.instructions}


def compare(points: list[dict]) -> dict:
    """Per-point and mean absolute percentage errors against PUBLISHED."""
    rows, errs = [], []
    for p in points:
        pub_d, pub_c = PUBLISHED[p["ep"]]
        ed = abs(p["dispatch_us"] - pub_d) / pub_d * 100
        ec = abs(p["combine_us"] - pub_c) / pub_c * 100
        errs += [ed, ec]
        rows.append({**p, "published_dispatch_us": pub_d, "published_combine_us": pub_c,
                     "dispatch_err_pct": ed, "combine_err_pct": ec})
    return {"points": rows, "mean_abs_pct_err": float(np.mean(errs)) if errs else None,
            "max_abs_pct_err": float(np.max(errs)) if errs else None}


def fit(eps=(8, 16, 32, 64, 128, 256), profile: HardwareProfile | None = None) -> dict:
    """Least-squares fit of the two calibration constants to PUBLISHED (how the profile defaults were obtained).

    With both at zero, measure dispatch d(EP) and combine c(EP). ``comm_start_us`` F shifts both operators'
    kernel time; ``poll_field_ns`` P adds (fields - 1) x P to dispatch's poll over its ``num_experts`` status
    records (one field per (source, expert)), and nothing to combine's one-word polls. Minimising
    sum (d + F + (fields - 1) P - pub_d)^2 + sum (c + F - pub_c)^2 gives F = mean(pub_c - c) and
    (fields - 1) P = mean(pub_d - d) - F."""
    base = (profile or cloudmatrix384()).replace(comm_start_us=0.0, poll_field_ns=0.0)
    pts = [measure(ep, base) for ep in eps]
    rd = [PUBLISHED[p["ep"]][0] - p["dispatch_us"] for p in pts]
    rc = [PUBLISHED[p["ep"]][1] - p["combine_us"] for p in pts]
    f = float(np.mean(rc))
    fields = 256                      # status records per die at 256 experts: ranks x experts-per-rank
    p_ns = max(0.0, (float(np.mean(rd)) - f) / (fields - 1) * 1e3)
    return {"comm_start_us": f, "poll_field_ns": p_ns, "baseline": pts}


def calibrate(eps=(8, 16, 32, 64, 128, 256), profile: HardwareProfile | None = None, progress=None) -> dict:
    points = []
    for ep in eps:
        points.append(measure(ep, profile))
        if progress is not None:
            progress(ep)
    return compare(points)
