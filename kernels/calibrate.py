"""``ascend-emu calibrate``: the timing model against the calibration set of DESIGN.md 9, and the fit of its three
calibration parameters (and nothing else) to that set.

The set: CloudMatrix384's fused dispatch / combine latencies at EP 8..256 (CANN EP, 128 tokens per rank, hidden
7168, top-8, INT8 dispatch, bf16 combine; 12 points) and one grouped INT8 GEMM (CANN kernel, BM x BN = 128 x 152,
4 groups of M = 7168, N = K = 4096, per-token x per-channel scales, bf16 out: 1,611 us). Each modeled figure is the
kernel time of a timing-only run (first core's start to the last core's end), without host launch overhead.
Routing is uniform random top-8 without repetition over 256 experts, seeded, so every point is deterministic.

The parameters (``fit``; nothing else in the profile is fitted):
- ``mte_startup_cycles``, the fixed cost of one MTE copy (DESIGN.md 3.1's "mtu start"), over a grid, with
- ``comm_start_us`` by least squares to the 12 dispatch / combine points for each grid value: the residual of those
  two operators, the device-side start the model does not detail; it applies only to kernels marked ``comm=True``
  (FusedDispatch / FusedCombine);
- ``l2_gbps`` (the L2's aggregate bandwidth, not published) to the GEMM point, the only point that loads the L2 near
  its limit. Its modeled time falls as the bandwidth grows until the cores' own movers and the cube bind; when the
  point lies at or below that floor the fit takes the smallest bandwidth that reaches the floor: a lower bound.
"Mechanism only" is the same run with the residual at zero: what the model explains from named costs.
"""
from __future__ import annotations

import time

import numpy as np

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.profile import HardwareProfile, load_profile

from .fused_moe import MoeGroup, moe_distribute_combine, moe_distribute_dispatch
from .grouped_matmul import GemmTiling, grouped_matmul

PUBLISHED = {  # EP ranks -> (dispatch us, combine us)
    8: (116.0, 118.0), 16: (131.0, 132.0), 32: (133.0, 146.0), 64: (141.0, 150.0), 128: (152.0, 150.0),
    256: (152.0, 149.0),
}
GEMM_POINT = {"groups": 4, "m": 7168, "n": 4096, "k": 4096, "tile_m": 128, "tile_n": 152, "published_us": 1611.0}
RESIDUALS = ("comm_start_us",)


def mechanism_only(profile: HardwareProfile) -> HardwareProfile:
    """The profile with the fitted residual at zero."""
    return profile.replace(**{k: 0.0 for k in RESIDUALS})


def measure(ep: int, profile: HardwareProfile | str | None = None, *, tokens: int = 128, hidden: int = 7168,
            topk: int = 8, experts: int = 256, seed: int = 0) -> dict:
    """Modeled kernel latency (us) of one fused dispatch and the combine that follows, at ``ep`` ranks."""
    prof = load_profile(profile, max(ep, 2))
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


def measure_gemm(profile: HardwareProfile | str | None = None, point: dict = GEMM_POINT) -> dict:
    """The grouped INT8 GEMM calibration point, timing-only: kernel us, cube utilisation, HBM bytes."""
    import torch
    prof = load_profile(profile, 1)
    g, m, n, k = point["groups"], point["m"], point["n"], point["k"]
    x = torch.empty(g * m, k, dtype=torch.int8, device="meta")
    w = torch.empty(g, k, n, dtype=torch.int8, device="meta")
    scale = torch.empty(g, n, dtype=torch.float32, device="meta")
    pts = torch.empty(g * m, dtype=torch.float32, device="meta")
    ends = [m * (i + 1) for i in range(g)]
    pod = Pod(prof, trace=False)
    t0 = time.perf_counter()
    res = grouped_matmul(x, w, group_list=ends, scale=scale, per_token_scale=pts, numeric=False, pod=pod,
                         tiling=GemmTiling(m=point["tile_m"], n=point["tile_n"]))
    run = res.run
    compulsory = g * m * k + g * k * n + g * m * n * 2 + g * n * 4 + g * m * 4
    return {"kernel_us": run.kernel_us, "cube_utilization": res.cube_utilization(prof),
            "hbm_bytes": run.hbm_bytes(), "compulsory_bytes": compulsory, "instructions": run.instructions,
            "wall_s": time.perf_counter() - t0}


def compare(points: list[dict]) -> dict:
    """Per-point and mean absolute percentage errors of dispatch / combine against PUBLISHED."""
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


def fit_l2_gbps(profile: HardwareProfile | None = None, *, lo: float = 1000.0, hi: float = 20000.0,
                tol: float = 0.005) -> dict:
    """Fit ``l2_gbps`` to the GEMM point: bisection on the modeled time (which does not grow with the bandwidth)
    for the published time, or, when the published time lies at or below the model's floor (the time at ``hi``), for
    the smallest bandwidth within ``tol`` of that floor (then the fit is a lower bound)."""
    base = profile or cloudmatrix384()
    target = GEMM_POINT["published_us"]
    t = {}

    def at(gbps):
        if gbps not in t:
            t[gbps] = measure_gemm(base.replace(l2_gbps=gbps))["kernel_us"]
        return t[gbps]
    floor = at(hi)
    bound = floor >= target * (1 - tol)
    goal = floor * (1 + tol) if bound else target
    a, b = lo, hi
    if at(a) <= goal:
        return {"l2_gbps": a, "lower_bound": bound, "gemm_us": at(a), "floor_us": floor, "evaluations": t}
    while b - a > 50.0:
        mid = round((a + b) / 2, 1)
        if at(mid) > goal:
            a = mid
        else:
            b = mid
    return {"l2_gbps": b, "lower_bound": bound, "gemm_us": at(b), "floor_us": floor, "evaluations": t}


def fit(eps=(8, 16, 32, 64, 128, 256), profile: HardwareProfile | None = None,
        startups=(0, 8, 16, 24, 32), progress=None) -> dict:
    """The fit of the calibration parameters to the 13 points (how the profile defaults were obtained; slow: tens
    of paper-scale runs). Nothing else in the profile moves.

    For each copy start-up ``mte_startup_cycles`` S in ``startups`` (the mtu start of DESIGN.md 3.1): measure the
    GEMM point, and dispatch d(EP) / combine c(EP) with the residual at zero. ``comm_start_us`` F shifts both
    operators' kernel time; minimising sum (d + F - pub_d)^2 + sum (c + F - pub_c)^2 gives F = mean(pub - model)
    over the 12 points. S is the value with the least squared relative error over the 13 points, each of the two
    published operators weighing the same (the GEMM point counts as many times as there are dispatch / combine
    points: twelve points of one operator must not outvote the only point of the other). Last, ``l2_gbps`` at that S
    (``fit_l2_gbps``)."""
    prof = profile or cloudmatrix384()
    pub = GEMM_POINT["published_us"]
    trials = []
    for su in startups:
        base = mechanism_only(prof.replace(mte_startup_cycles=su))
        pts = [measure(ep, base) for ep in eps]
        gaps = [PUBLISHED[p["ep"]][i] - p[k] for p in pts for i, k in ((0, "dispatch_us"), (1, "combine_us"))]
        f = float(np.mean(gaps))
        gemm_us = measure_gemm(base)["kernel_us"]
        errs = [(PUBLISHED[p["ep"]][i] - (p[k] + f)) / PUBLISHED[p["ep"]][i]
                for p in pts for i, k in ((0, "dispatch_us"), (1, "combine_us"))]
        loss = float(np.sum(np.square(errs))) + len(errs) * ((gemm_us - pub) / pub) ** 2
        trials.append({"mte_startup_cycles": su, "comm_start_us": f, "gemm_us": gemm_us, "loss": loss,
                       "baseline": pts})
        if progress is not None:
            progress(f"start-up {su}")
    best = min(trials, key=lambda t: t["loss"])
    chosen = prof.replace(mte_startup_cycles=best["mte_startup_cycles"], comm_start_us=best["comm_start_us"])
    l2 = fit_l2_gbps(chosen)
    return {"l2_gbps": l2["l2_gbps"], "l2_fit": l2, "mte_startup_cycles": best["mte_startup_cycles"],
            "comm_start_us": best["comm_start_us"], "trials": trials}


def calibrate(eps=(8, 16, 32, 64, 128, 256), profile: HardwareProfile | str | None = None, progress=None, *,
              gemm: bool = True) -> dict:
    """Model vs the calibration set: per point published, modeled, mechanism only and the residual between them;
    the GEMM point; the fitted parameters. ``profile``: a profile, preset name or TOML path (default
    cloudmatrix384). ``progress(label)`` is called after each point."""
    prof = load_profile(profile)
    points = []
    for ep in eps:
        full, mech = measure(ep, prof), measure(ep, mechanism_only(prof))
        full["mechanism_dispatch_us"] = mech["dispatch_us"]
        full["mechanism_combine_us"] = mech["combine_us"]
        full["residual_dispatch_us"] = full["dispatch_us"] - mech["dispatch_us"]
        full["residual_combine_us"] = full["combine_us"] - mech["combine_us"]
        points.append(full)
        if progress is not None:
            progress(f"EP{ep}")
    out = compare(points)
    if gemm:
        g = measure_gemm(prof)
        pub = GEMM_POINT["published_us"]
        out["gemm"] = {**{k: v for k, v in GEMM_POINT.items() if k != "published_us"}, "published_us": pub,
                       "modeled_us": g["kernel_us"], "mechanism_us": g["kernel_us"], "residual_us": 0.0,
                       "err_pct": abs(g["kernel_us"] - pub) / pub * 100,
                       "cube_utilization": g["cube_utilization"], "hbm_bytes": g["hbm_bytes"],
                       "compulsory_bytes": g["compulsory_bytes"]}
        if progress is not None:
            progress("gemm")
    out["fitted"] = {"l2_gbps": prof.l2_gbps, "mte_startup_cycles": prof.mte_startup_cycles,
                     "comm_start_us": prof.comm_start_us}
    return out
