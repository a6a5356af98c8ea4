"""Per-token dynamic INT8 quantisation (torch_npu ``npu_dynamic_quant``) as an AIV kernel, its torch reference, and
its per-rank host API (per-rank plumbing lives in ``kernels.ranks``).

    y, scale = kernels.dynamic_quant(x)                          # x [T, H] bf16/fp16 -> y int8 [T, H], scale fp32 [T]
    res = kernels.dynamic_quant([x0, x1], smooth_scales=s)       # a list = one tensor per rank (die 0, die 1)
    res.y[1], res.scale[1], res.run.modeled_us

Math (bitwise equal to ``dynamic_quant_reference``): per row, ``v = x * smooth`` in fp32 (``smooth`` optional),
``scale = max|v| / 127`` (fp32), ``y = round_half_even(v / scale)`` saturated to [-128, 127]; a row of zeros gets
``scale = 0`` and ``y = 0``. MoE form: ``smooth_scales`` [G, H] with ``group_index`` [G] cumulative row ends applies
``smooth_scales[g]`` to rows ``group_index[g-1]:group_index[g]``. A NaN or inf in x or smooth_scales raises
``ArgumentError`` naming it (its row would have no finite scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.dtypes import as_dtype
from ascend_emu.errors import ArgumentError, CapacityError, ShapeError

from .ranks import (Outputs, Pending, caller_streams, check_cores, check_dtype, check_finite, join_ranks, make_pod,
                    per_rank, queue_ranks, run_ranks, split_ranks, to_gm, to_torch)


# ============================================================================================ the kernel
TILE_ROWS_MAX = 16


def plan_rows(h: int, x_bytes: int, smooth: bool, ub_bytes: int) -> int:
    """Rows per UB tile: two slots of (x + int8 y) rows, the fp32 smooth row (and its load staging) must fit."""
    fixed = (h * 4 + h * x_bytes if smooth else 0) + 4 * 64          # smooth fp32 + staging, scale slots
    per_row = 2 * h * (x_bytes + 1)
    rows = (ub_bytes - fixed) // per_row
    if rows < 1:
        raise CapacityError(f"dynamic_quant: x.shape[-1]={h} does not fit one row in the {ub_bytes}-byte UB "
                            f"(two slots of {x_bytes}-byte x + int8 y per element{' + fp32 smooth' if smooth else ''};"
                            f" at most {(ub_bytes - 4 * 64) // (2 * (x_bytes + 1) + (4 + x_bytes) * smooth)} elements)")
    return int(min(rows, TILE_ROWS_MAX))


@kernel(cores="aiv")
def dynamic_quant_kernel(ctx, x_gm, smooth_gm, group_gm, y_gm, scale_gm, tile_rows: int):
    """x_gm [T, H] -> y_gm [T, H] int8, scale_gm [T] fp32 (per token). smooth_gm: None, [H] or [G, H] (fp16/bf16;
    widened to fp32 in UB); group_gm: None or [G] int64 cumulative row ends (read by the scalar unit).

    Rows are split in contiguous ranges over the cores; each core walks its range in tiles of ``tile_rows`` rows,
    double buffered (load tile i+1 while quantising tile i), cutting tiles at group boundaries."""
    t_rows, h = x_gm.shape
    per_core = -(-t_rows // ctx.block_num)
    lo = min(ctx.block_idx * per_core, t_rows)
    hi = min(lo + per_core, t_rows)
    if lo >= hi:
        return
    bounds = [(0, t_rows, 0)]
    if group_gm is not None:
        ends = [int(e) for e in (yield ctx.gm_load(group_gm))]
        bounds = [(ends[g - 1] if g else 0, ends[g], g) for g in range(len(ends))]
    x_t = ctx.ub.alloc((2, tile_rows, h), x_gm.dtype, name="x")
    y_t = ctx.ub.alloc((2, tile_rows, h), "int8", name="y")
    s_t = ctx.ub.alloc((2, 8 * -(-tile_rows // 8)), "fp32", name="scale")    # 32-byte aligned slots
    if smooth_gm is not None:
        sm_in = None if smooth_gm.dtype == np.float32 else ctx.ub.alloc((h,), smooth_gm.dtype, name="smooth_in")
        sm_t = ctx.ub.alloc((h,), "fp32", name="smooth")
    loaded = None
    i = 0
    for g_lo, g_hi, g in bounds:
        a, b = max(lo, g_lo), min(hi, g_hi)
        if a >= b:
            continue
        smooth = None
        if smooth_gm is not None:
            if loaded != g:
                row = smooth_gm[g] if smooth_gm.ndim == 2 else smooth_gm
                if sm_in is None:
                    yield ctx.copy_gm_to_ub(sm_t, row, pad=True)
                else:
                    yield ctx.copy_gm_to_ub(sm_in, row, pad=True)
                    yield ctx.vec.cast(sm_t, sm_in)             # fp16/bf16 -> fp32: exact
                loaded = g
            smooth = sm_t
        for r in range(a, b, tile_rows):
            n = min(tile_rows, b - r)
            k = i % 2
            i += 1
            yield ctx.copy_gm_to_ub(x_t[k, :n], x_gm[r:r + n], pad=True)
            yield ctx.vec.quant_int8(y_t[k, :n], s_t[k, :n], x_t[k, :n], smooth)
            yield ctx.copy_ub_to_gm(y_gm[r:r + n], y_t[k, :n], pad=True)
            yield ctx.copy_ub_to_gm(scale_gm[r:r + n], s_t[k, :n], pad=True)   # 4 B per row: DataCopyPad


# ============================================================================================ host API
@dataclass
class DynamicQuantResult(Outputs):
    """``y`` int8 (x's shape), ``scale`` fp32 (x's shape without the last dim), ``run`` the RunResult."""
    y: object
    scale: object
    run: object
    _outputs = ("y", "scale")


def dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, numeric: bool = True,
                  pod: Pod | None = None, dies=None, cores: int | None = None, trace: bool = True, stream=None,
                  after=()):
    """torch_npu.npu_dynamic_quant on the emulator: per-token symmetric INT8.

    x: [..., H] float16/bfloat16 (float32 accepted too) for one rank, or a list of such tensors (one per rank; rank
    r runs on ``dies[r]``, default die r). A tensor is always one rank here, as in torch_npu (leading dims are
    tokens). smooth_scales: [H] or, with group_index, [G, H], same dtype as x (one value or per-rank list).
    group_index: [G] int cumulative row ends (MoE: smooth_scales[g] for rows group_index[g-1]:group_index[g]).
    dst_type: None or torch.int8 (int4 is not modeled). numeric=False: timing only (x may be a meta tensor).
    cores: AIV cores per die (default all 48). Returns ``DynamicQuantResult(y, scale, run)``. stream / after:
    queue on the caller's streams instead (their AIVs) and return a ``kernels.ranks.Pending`` (``grouped_matmul``).
    Timing only, x may be a ``kernels.ranks.HostShape`` (no torch is loaded then).
    """
    if dst_type is not None:
        import torch
        if dst_type != torch.int8:
            raise ArgumentError(f"dst_type={dst_type}: only torch.int8 is modeled")
    xs, form = split_ranks(x, "x")
    n = len(xs)
    smooth = per_rank(smooth_scales, n, "smooth_scales")
    groups = per_rank(group_index, n, "group_index")
    if stream is not None:
        pod, dies, cores, streams = caller_streams(stream, n, "aiv", cores)
    else:
        pod, dies = make_pod(pod, dies, n, trace)
        cores = check_cores(pod.profile, cores)
    prof = pod.profile
    launches, outs = [], []
    for r, (xr, sr, gr, die) in enumerate(zip(xs, smooth, groups, dies)):
        dt = check_dtype(xr, "x", ("fp16", "bf16", "fp32"))
        if xr.ndim < 2:
            raise ShapeError(f"x must have at least 2 dims [..., H], got shape {tuple(xr.shape)}")
        lead, h = tuple(xr.shape[:-1]), int(xr.shape[-1])
        x2 = xr.reshape(-1, h)
        t_rows = x2.shape[0]
        s_gm = g_gm = None
        if gr is not None:
            if sr is None:
                raise ArgumentError("group_index needs smooth_scales [G, H]")
            import torch
            gl = torch.as_tensor(gr).to(torch.int64).reshape(-1)
            if tuple(sr.shape) != (gl.numel(), h):
                raise ShapeError(f"smooth_scales with group_index must be [G={gl.numel()}, H={h}], got "
                                 f"{tuple(sr.shape)}")
            if gl.numel() and (bool((gl[1:] < gl[:-1]).any()) or int(gl[0]) < 0 or int(gl[-1]) != t_rows):
                raise ArgumentError(f"group_index must be non-decreasing cumulative row ends ending at the row count "
                                    f"{t_rows}, got {gl.tolist()}")
            g_gm = to_gm(pod, die, gl, f"group_index{r}", numeric, real=True)
        elif sr is not None and tuple(sr.shape) != (h,):
            raise ShapeError(f"smooth_scales must be [H={h}] (or [G, H] with group_index), got {tuple(sr.shape)}")
        if sr is not None:
            check_dtype(sr, "smooth_scales", ("fp16", "bf16", "fp32"))
            s_gm = to_gm(pod, die, sr, f"smooth{r}", numeric)
        if numeric:
            why = "a per-token INT8 scale needs finite values (max|x| would be inf or NaN)"
            check_finite(x2, "x" if form == "single" else f"x[{r}]", why)
            check_finite(sr, "smooth_scales", why)
        x_gm = to_gm(pod, die, x2, f"x{r}", numeric)
        y_gm = pod.alloc(die, (t_rows, h), "int8", phantom=not numeric, name=f"y{r}")
        sc_gm = pod.alloc(die, (t_rows,), "fp32", phantom=not numeric, name=f"scale{r}")
        rows = plan_rows(h, np.dtype(as_dtype(dt)).itemsize, sr is not None, prof.ub_bytes)
        launches.append((die, dynamic_quant_kernel, (x_gm, s_gm, g_gm, y_gm, sc_gm, rows),
                         {"aiv": min(cores, max(t_rows, 1))}, numeric))
        outs.append((y_gm, sc_gm, lead, h))
    def finish(run):
        ys, scales = [], []
        for y_gm, sc_gm, lead, h in outs:
            ys.append(to_torch(y_gm.numpy()).reshape(*lead, h) if numeric else None)
            scales.append(to_torch(sc_gm.numpy()).reshape(lead) if numeric else None)
        return DynamicQuantResult(join_ranks(ys, form), join_ranks(scales, form), run)
    if stream is not None:
        return Pending(queue_ranks(launches, streams, after), finish)
    return finish(run_ranks(pod, launches))


def dynamic_quant_reference(x, *, smooth_scales=None, group_index=None):
    """torch reference (one rank): (y int8, scale fp32). Bitwise what the kernel computes."""
    import torch
    h = x.shape[-1]
    xf = x.reshape(-1, h).float()
    if smooth_scales is not None:
        sm = smooth_scales.float()
        if group_index is not None:
            ends = torch.as_tensor(group_index).to(torch.int64).reshape(-1)
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            sm = sm.repeat_interleave(counts, dim=0)
        xf = xf * sm
    scale = xf.abs().amax(-1) / 127
    y = torch.round(xf / torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]).clamp(-128, 127)
    return y.to(torch.int8).reshape(x.shape), scale.reshape(x.shape[:-1])
