"""Grouped GEMM for MoE experts (torch_npu ``npu_grouped_matmul``, the single-tensor form split_item=2/3 with
group_type=0) as a MIX kernel: AIC cube tiles with an AIV epilogue handed over by cross-core flags.

    y = kernels.grouped_matmul(x, w, group_list=ends, scale=s, per_token_scale=t).y     # one rank
    res = kernels.grouped_matmul([x0, x1], [w0, w1], group_list=[g0, g1], ...)          # one die per rank

Math. Rows ``x[start_e:end_e]`` belong to group (expert) e, with ``end_e = group_list[e]`` (group_list_type=0,
cumulative, torch_npu's default) or ``end_e = sum(group_list[:e+1])`` (group_list_type=1, counts); rows past the
last group are not computed (they stay 0).
- int8: acc = x_e @ w[e] exactly in int32 (output_dtype=torch.int32 returns it), then
  y = bf16((fp32(acc) * per_token_scale[row]) * scale[e, col]) (either scale optional), RNE.
- bf16/fp16: y = round(x_e @ w[e]) with fp32 accumulation over K steps of 64.
- swiglu=True (an extension; torch_npu fuses it in npu_grouped_matmul_swiglu_quant): w[e] holds [gate | up] along
  N (N = 2I); y[:, :I] = silu(g) * u with g, u the dequantised gate/up columns, silu(g) = g / (1 + exp(-g)) (fp32).

Tiling (CATLASS's grouped per-token-dequant GEMM; only ``GemmTiling`` and the constants below know the chip):
- output tiles of ``tiling.m x tiling.n`` (default 128 x 256; with SwiGLU: n/2 gate + the matching n/2 up columns in
  one tile); the CloudMatrix384 paper's kernels use 128 x 152 (``GemmTiling(n=152)``);
- K in L1 steps of ``k_l1`` (int8 512, bf16 256) over ``l1_stages`` = 2 L1 slots (GM -> L1 by MTE2), each split
  into L0 steps of ``k_l0`` (int8 128, bf16 64) over 2 L0A/L0B slots (MTE1), mmad into one m x n L0C accumulator
  (one L0C stage, as CATLASS's preload policy: a tile's fixpipe and the next tile's first mmad serialise);
- tiles are numbered group by group (m-tiles, then n-tiles) and dealt round-robin over the AICs: tile i -> AIC
  i % num_aic. Each group therefore starts on the AIC after the one that took the previous group's last tile: the
  cores rotate across groups, and an uneven group_list costs at most one tile of imbalance per core;
- epilogue (int8 with a per-token scale, or SwiGLU): fixpipe the raw int32/fp32 tile to a per-AIC GM workspace of
  2 slots, cross-core flag READY to both AIVs; each AIV dequantises half of the tile's rows in chunks of up to 32
  rows (fewer for a wide output dtype such as fp32: ``epilogue_rows`` sizes them against the UB at plan time)
  (ping-pong UB), applies SwiGLU, casts to bf16, stores, and flags FREE back when the AIC may reuse the slot.
  Without a per-token scale the fixpipe writes y itself (per-channel scale from L1, like FixPipe's quant vector).
- NZ weights (weight_format="NZ", as npu_format_cast(w, 29) would store them): each B tile's 32-byte-wide fractal
  column blocks are contiguous in GM and land in their columns of the L1 tile.
  modeled as: one DataCopy per fractal column block (8 per 128 x 256 int8 tile); the die issues one strided
  DataCopy. Same bytes, 7 more MTE2 start-ups per K step.
- a tile width whose rows are not whole 32-byte blocks (152 int8 columns) copies B with DataCopyPad (whole bursts).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.dtypes import as_dtype, name_of
from ascend_emu.errors import ArgumentError, DTypeError, ShapeError
from ascend_emu.layout import n0_of, nd_to_nz

from .gemm_plan import (BASE_K, BASE_M, BASE_N, EPI_ROWS, GemmPlan, GemmTiling, choose_tiling,  # noqa: F401
                        epilogue_rows, group_ends, k_ranges, plan_tiles, plan_units, reduce_rows)
from .tiles import gm_b_tile
from .ranks import (HostShape, Outputs, Pending, Ranks, caller_streams, check_cores, check_dtype, integer_array,
                    join_ranks, make_pod, per_rank, queue_ranks, run_ranks, split_ranks, to_gm, to_torch,
                    warn_plain_list)

FLAG_READY, FLAG_FREE = 0, 1          # AIC -> AIV: workspace slot holds a tile; AIV -> AIC: slot read


@dataclass(frozen=True)
class GemmTensors:
    """The GM tensors of one rank's launch. x [M, K]; w ND [E, K, N] or NZ [E, N1, K1, 16, N0]; group_list [E]
    int64 (control data); scale [E, N] fp32 or None; per_token_scale [M] fp32 or None; workspace [num_aic, 2, m, n]
    (the per-tile epilogue's slots, else None); y [M, N] (SwiGLU [M, N/2]); split K only: partials [tiles, splits,
    m, n] (int32 / fp32 raw accumulators) and counters [tiles] int32 (parts landed)."""
    x: object
    w: object
    group_list: object
    y: object
    scale: object = None
    per_token_scale: object = None
    workspace: object = None
    partials: object = None
    counters: object = None


@kernel(cores="mix")
def grouped_matmul_kernel(ctx, t: GemmTensors, p: GemmPlan):
    """x @ w by groups -> y (see the module docstring), one rank's ``GemmTensors`` under ``GemmPlan`` p."""
    k_dim = t.x.shape[1]
    if ctx.is_aiv and not p.aiv_work:
        return                                            # the fixpipe writes y itself
    ends = group_ends((yield ctx.gm_load(t.group_list)), p.group_list_type)
    tl = p.tiling
    tiles = plan_tiles(ends, p.n_out, tl.n // 2 if p.swiglu else tl.n, tl.m)
    n_aic = ctx.block_num if ctx.is_aic else ctx.block_num // 2
    if p.splits > 1:
        units = plan_units(len(tiles), p.splits, n_aic, ctx.group_idx)
        if ctx.is_aic:
            parts = k_ranges(k_dim, p.splits, tl.k_l0)
            split = SplitK(t.partials, t.counters, [(i, j) + parts[j] for i, j in units])
            yield from cube_tiles(ctx, t.x, t.w, t.scale, None, None, p, [tiles[i] for i, _ in units], k_dim,
                                  split=split)
        else:
            yield from _reduce_epilogue(ctx, t, p, tiles, units)
        return
    mine = tiles[ctx.group_idx::n_aic]
    if ctx.is_aic:
        yield from cube_tiles(ctx, t.x, t.w, t.scale, t.workspace, t.y, p, mine, k_dim)
    else:
        yield from _epilogue(ctx, t, p, mine)


@dataclass(frozen=True)
class SplitK:
    """Split-K output of ``cube_tiles``: per entry of its tiles, (tile index, part, k0, k1); the raw accumulator
    of K rows [k0, k1) goes to partials[tile, part] and counters[tile] counts the parts landed."""
    partials: object
    counters: object
    units: list


def _as_plan(p) -> GemmPlan:
    if isinstance(p, GemmPlan):
        return p
    warnings.warn("cube_tiles: pass a kernels.gemm_plan.GemmPlan instead of a plan dict", DeprecationWarning,
                  stacklevel=3)
    keys = ("tiling", "n", "nz", "swiglu", "epilogue", "fixpipe_scale", "group_list_type", "int8", "epi_rows")
    return GemmPlan(**{k: p[k] for k in keys if k in p})


def cube_tiles(ctx, x_gm, w_gm, scale_gm, ws_gm, y_gm, p, mine, k_dim, split: SplitK | None = None):
    """The AIC tile loop (public: persistent pipelines run it inside their own kernels, serving.expert_pipeline).
    AIC: per tile, L1 steps of k_l1 (GM -> L1, MTE2), each in L0 steps of k_l0 (L1 -> L0A/L0B, MTE1; mmad), then
    fixpipe to the workspace (+ READY), to y, or (``split``) to the tile's partial slot (+ its counter).
    ``p`` (a ``GemmPlan`` with a resolved tiling) sets the shapes."""
    p = _as_plan(p)
    dt = x_gm.dtype
    tl = p.tiling
    k1, k0, stages = tl.k_l1, tl.k_l0, tl.l1_stages
    acc_dt = "int32" if dt == np.int8 else "fp32"
    a_l1 = ctx.l1.alloc((stages, tl.m, k1), dt, name="a_l1")
    b_l1 = ctx.l1.alloc((stages, k1 * tl.n), dt, name="b_l1")
    a_l0 = ctx.l0a.alloc((2, tl.m, k0), dt, name="a_l0")
    b_l0 = ctx.l0b.alloc((2, k0, tl.n), dt, name="b_l0")
    acc = ctx.l0c.alloc((tl.m, tl.n), acc_dt, name="acc")
    fix_scale = p.fixpipe_scale and scale_gm is not None and split is None
    if fix_scale:
        cs_l1 = ctx.l1.alloc((tl.n,), "fp32", name="channel_scale")
    half_n = p.n // 2
    pad = (tl.n * dt.itemsize) % 32 != 0          # B rows are not whole 32-byte bursts: DataCopyPad
    step = step0 = 0
    for j, (g, m0, mt, n0, nw) in enumerate(mine):
        # B column ranges of this tile: [n0, n0 + nw), and with SwiGLU the matching up columns
        cols = [(n0, 0)] + ([(half_n + n0, nw)] if p.swiglu else [])
        nt = nw * len(cols)
        k_lo, k_hi = (0, k_dim) if split is None else split.units[j][2:]
        for kb in range(k_lo, k_hi, k1):
            kt = min(k1, k_hi - kb)
            s1 = step % stages
            step += 1
            b_src = gm_b_tile(w_gm, g, kb, kt, [c0 for c0, _ in cols], nw, p.nz)
            b_dst = b_l1[s1, :kt * nt].reshape(kt, nt)      # compact [kt, nt] in the slot
            yield ctx.copy_gm_to_l1(a_l1[s1, :mt, :kt], x_gm[m0:m0 + mt, kb:kb + kt])
            yield ctx.copy_gm_to_l1(b_dst.reshape(b_src.shape), b_src, pad=pad)
            for kk in range(0, kt, k0):
                kw = min(k0, kt - kk)
                s0 = step0 % 2
                step0 += 1
                yield ctx.copy_l1_to_l0a(a_l0[s0, :mt, :kw], a_l1[s1, :mt, kk:kk + kw])
                yield ctx.copy_l1_to_l0b(b_l0[s0, :kw, :nt], b_dst[kk:kk + kw])
                yield ctx.mmad(acc[:mt, :nt], a_l0[s0, :mt, :kw], b_l0[s0, :kw, :nt], accumulate=kb + kk > k_lo)
        if split is not None:
            tile, part = split.units[j][:2]
            yield ctx.copy_l0c_to_gm(split.partials[tile, part, :mt, :nt], acc[:mt, :nt])
            yield ctx.atomic_add(split.counters[tile:tile + 1], 1, after="FIXP")    # once the part has landed
        elif p.epilogue:
            if j >= 2:
                yield ctx.cross_core_wait(FLAG_FREE)     # both AIVs have read slot j % 2
            yield ctx.copy_l0c_to_gm(ws_gm[ctx.group_idx, j % 2, :mt, :nt], acc[:mt, :nt])
            yield ctx.cross_core_set(FLAG_READY)         # fires once the fixpipe write is visible
        else:
            scale = None
            if fix_scale:
                yield ctx.copy_gm_to_l1(cs_l1[:nw], scale_gm[g, n0:n0 + nw], pad=pad)
                scale = cs_l1[:nw]
            yield ctx.copy_l0c_to_gm(y_gm[m0:m0 + mt, n0:n0 + nw], acc[:mt, :nt], scale=scale)


b_tile_view = gm_b_tile          # the name before kernels.tiles existed


@dataclass
class _EpilogueTiles:
    """An AIV's UB tiles for the epilogue: two slots each of the raw tile (``acc``), the dequantised one and the
    output, the SwiGLU scratch, token scales and the tile's channel scales."""
    acc: object
    deq: object
    out: object
    silu: object
    token_scale: object
    channel_scale: object
    rows: int
    pad: bool


def _epilogue_tiles(ctx, t: GemmTensors, p: GemmPlan, raw_dtype):
    """The UB tiles, sized as ``epilogue_rows`` counted them: two ping-pong slots of each, or with a K split one
    raw slot per part and one of the rest."""
    tn, rows = p.tiling.n, p.epi_rows
    raw_slots, slots = (2, 2) if p.splits == 1 else (p.splits, 1)
    q_t = ctx.ub.alloc((raw_slots, rows, tn), raw_dtype, name="acc")
    f_t = ctx.ub.alloc((slots, rows, tn), "fp32", name="deq") if raw_dtype == np.int32 else q_t
    o_t = ctx.ub.alloc((slots, rows, tn), t.y.dtype, name="out")
    tmp = ctx.ub.alloc((rows, tn // 2), "fp32", name="silu") if p.swiglu else None
    pt_t = ctx.ub.alloc((slots, rows), "fp32", name="token_scale")
    cs_t = ctx.ub.alloc((tn,), "fp32", name="channel_scale") if t.scale is not None else None
    pad = (tn * t.y.dtype.itemsize) % 32 != 0    # output rows that are not whole bursts: DataCopyPad
    if raw_dtype == np.int32 and t.per_token_scale is None:
        yield ctx.vec.duplicate(pt_t, 1.0)                # dequant_int8 takes a row scale: exact ones
    return _EpilogueTiles(q_t, f_t, o_t, tmp, pt_t, cs_t, rows, pad)


def _tile_columns(p: GemmPlan, n0: int, nw: int) -> list:
    """(first weight column, first tile column) of each column range of a tile: [n0, n0 + nw), and with SwiGLU the
    matching up columns."""
    return [(n0, 0)] + ([(p.n // 2 + n0, nw)] if p.swiglu else [])


def _load_channel_scales(ctx, t: GemmTensors, e: _EpilogueTiles, g: int, cols: list, nw: int):
    if e.channel_scale is not None:
        for c0, at in cols:
            yield ctx.copy_gm_to_ub(e.channel_scale[at:at + nw], t.scale[g, c0:c0 + nw])


def _finish_rows(ctx, t: GemmTensors, p: GemmPlan, e: _EpilogueTiles, q: int, m0: int, r0: int, cr: int, n0: int,
                 nw: int, nt: int):
    """Rows [r0, r0 + cr) of a tile whose raw values sit in slot ``q`` of ``e.acc``: dequantise (int32), SwiGLU,
    cast, store to y."""
    Q, F, O = e.acc[q, :cr, :nt], e.deq[q, :cr, :nt], e.out[q, :cr, :nw]
    if Q.dtype == np.int32:
        if O.dtype == np.int32:                           # raw accumulators out
            yield ctx.copy_ub_to_gm(t.y[m0 + r0:m0 + r0 + cr, n0:n0 + nw], Q[:, :nw], pad=e.pad)
            return
        if t.per_token_scale is not None:
            yield ctx.copy_gm_to_ub(e.token_scale[q, :cr], t.per_token_scale[m0 + r0:m0 + r0 + cr], pad=True)
        cs = None if e.channel_scale is None else e.channel_scale[:nt]
        yield ctx.vec.dequant_int8(F, Q, e.token_scale[q, :cr], cs)
    if p.swiglu:
        gate, up, tmp = e.deq[q, :cr, :nw], e.deq[q, :cr, nw:nt], e.silu[:cr, :nw]
        yield ctx.vec.muls(tmp, gate, -1.0)           # silu(g) = g / (1 + exp(-g))
        yield ctx.vec.exp(tmp, tmp)
        yield ctx.vec.adds(tmp, tmp, 1.0)
        yield ctx.vec.div(tmp, gate, tmp)
        yield ctx.vec.mul(tmp, tmp, up)
        yield ctx.vec.cast(O, tmp)
    else:
        yield ctx.vec.cast(O, F)
    yield ctx.copy_ub_to_gm(t.y[m0 + r0:m0 + r0 + cr, n0:n0 + nw], O, pad=e.pad)


def _epilogue(ctx, t: GemmTensors, p: GemmPlan, mine):
    """AIV: per tile, wait READY, dequantise (int8) / SwiGLU / cast this AIV's half of the rows, store, flag FREE."""
    ws_gm = t.workspace
    e = yield from _epilogue_tiles(ctx, t, p, ws_gm.dtype)
    q = 0
    for j, (g, m0, mt, n0, nw) in enumerate(mine):
        cols = _tile_columns(p, n0, nw)
        nt = nw * len(cols)
        h = -(-mt // 2)
        lo, hi = (0, h) if ctx.sub_block_idx == 0 else (h, mt)
        yield ctx.cross_core_wait(FLAG_READY)
        if hi > lo:
            yield from _load_channel_scales(ctx, t, e, g, cols, nw)
        for r0 in range(lo, hi, e.rows):
            cr = min(e.rows, hi - r0)
            yield ctx.copy_gm_to_ub(e.acc[q, :cr, :nt], ws_gm[ctx.group_idx, j % 2, r0:r0 + cr, :nt])
            yield from _finish_rows(ctx, t, p, e, q, m0, r0, cr, n0, nw, nt)
            q ^= 1
        if j + 2 < len(mine):
            yield ctx.cross_core_set(FLAG_FREE, after="MTE2")   # once this AIV's reads of the slot are done


def _reduce_epilogue(ctx, t: GemmTensors, p: GemmPlan, tiles: list, units: list):
    """AIV, split K: per unit of this AIV's AIC, wait until every part of the tile has landed, then for this AIV's
    slice of the tile's rows (``reduce_rows``) add the parts in order and finish the rows like the epilogue. The
    parts land in their own slots back to back; the sum runs in part order (part 0 + part 1, + part 2, ...),
    whatever order they landed in."""
    e = yield from _epilogue_tiles(ctx, t, p, t.partials.dtype)
    for tile, part in units:
        g, m0, mt, n0, nw = tiles[tile]
        cols = _tile_columns(p, n0, nw)
        nt = nw * len(cols)
        lo, hi = reduce_rows(mt, p.splits, part, ctx.sub_block_idx)
        if hi <= lo:
            continue
        yield ctx.wait_gm(t.counters[tile:tile + 1], "ge", p.splits)
        yield from _load_channel_scales(ctx, t, e, g, cols, nw)
        for r0 in range(lo, hi, e.rows):
            cr = min(e.rows, hi - r0)
            for q in range(p.splits):
                yield ctx.copy_gm_to_ub(e.acc[q, :cr, :nt], t.partials[tile, q, r0:r0 + cr, :nt])
            total = e.acc[0, :cr, :nt]
            for q in range(1, p.splits):
                yield ctx.vec.add(total, total, e.acc[q, :cr, :nt])
            yield from _finish_rows(ctx, t, p, e, 0, m0, r0, cr, n0, nw, nt)


# ============================================================================================ host API
@dataclass
class GroupedMatmulResult(Outputs):
    """``y`` [M, N] (SwiGLU: [M, N/2]) in output_dtype, ``run`` the RunResult, ``macs`` the useful multiply-adds
    (sum over ranks of rows_in_groups x K x N) for utilisation figures. Iterating yields (y,) like torch_npu's list."""
    y: object
    run: object
    macs: int
    _outputs = ("y",)

    def cube_utilization(self, pod_profile, dtype: str = "int8", dies: int = 1) -> float:
        """Useful cube work / (kernel time x peak of ``dies`` dies)."""
        peak = pod_profile.peak_cube_tflops(dtype) * 1e12 * dies
        return 2.0 * self.macs / (self.run.kernel_us * 1e-6) / peak


def _group_lists(group_list, n: int) -> list:
    if group_list is None:
        raise ArgumentError("group_list is required (the MoE form: one x, one stacked weight, one y)")
    if isinstance(group_list, Ranks) or (isinstance(group_list, (list, tuple)) and group_list and
                                          not np.isscalar(group_list[0]) and getattr(group_list[0], "ndim", 1) >= 1):
        vals = list(group_list)
    elif getattr(group_list, "ndim", 1) == 2:
        vals = [group_list[i] for i in range(group_list.shape[0])]
    else:
        vals = [group_list] * n
    if len(vals) != n:
        raise ShapeError(f"group_list: {len(vals)} per-rank lists for {n} ranks")
    return [integer_array(v, "group_list" if n == 1 else f"group_list[{r}]").reshape(-1) for r, v in enumerate(vals)]


def grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                   per_token_scale=None, group_list=None, activation_input=None, split_item: int = 3,
                   group_type: int = 0, group_list_type: int = 0, act_type: int = 0, output_dtype=None,
                   swiglu: bool = False, weight_format: str = "ND", tiling: GemmTiling | None = None,
                   numeric: bool = True, pod: Pod | None = None,
                   dies=None, cores: int | None = None, trace: bool = True, stream=None, after=()):
    """torch_npu.npu_grouped_matmul (x, weight and y single tensors: split_item 2/3, group_type 0) on the emulator,
    in the native per-rank form (torch_npu's own signature, lists and outputs: ``kernels.npu.npu_grouped_matmul``).

    x: [M, K] int8/bf16/fp16 for one rank, [R, M, K] or ``kernels.Ranks([x0, x1, ...])`` of per-rank [M_r, K]
    (a plain list still means ranks, with a DeprecationWarning: torch_npu reads it as groups). weight: [E, K, N]
    (same dtype; shared by every rank), [R, E, K, N] or ``Ranks``. group_list: [E] ints (one list for every rank,
    or ``Ranks`` of per-rank lists), group_list_type 0 cumulative / 1 counts.
    scale: [E, N] fp32 per-channel; per_token_scale: [M] fp32 (int8 only). output_dtype: torch.bfloat16 (default for
    int8 with a scale and for bf16), torch.float16, torch.float32, or torch.int32 (int8 without scales: the exact
    accumulators). swiglu: fuse SwiGLU on [gate | up] halves of N. weight_format: "ND" or "NZ" (stored as NZ in GM).
    tiling: the cube's block and K-step shapes (``GemmTiling``; default 128 x 256, CATLASS's K steps), checked
    against the AIC's buffers before launch; e.g. ``GemmTiling(n=152)`` for the CloudMatrix384 paper's 128 x 152.
    numeric=False: timing only (x / weight may be meta tensors; group_list stays real). cores: AICs per die
    (each with its two AIVs; default 24). Returns ``GroupedMatmulResult(y, run, macs)``.
    stream: queue instead of run: a ``Stream`` (one rank) or one per rank (``kernels.ranks.caller_streams``); the
    kernel uses the stream's AICs, each launch waits for ``after``; returns a ``kernels.ranks.Pending`` whose
    ``collect(run)`` gives the result once the caller's ``pod.synchronize()`` has run it. Timing only, x / weight /
    scales may be ``kernels.ranks.HostShape`` (no torch is loaded then).
    """
    warn_plain_list(x, "x", "kernels.grouped_matmul", "npu_grouped_matmul")
    warn_plain_list(weight, "weight", "kernels.grouped_matmul", "npu_grouped_matmul")
    for name, v in (("bias", bias), ("offset", offset), ("antiquant_scale", antiquant_scale),
                    ("antiquant_offset", antiquant_offset), ("activation_input", activation_input)):
        if v is not None:
            raise ArgumentError(f"{name} is not modeled: pass None")
    if split_item not in (2, 3):
        raise ArgumentError(f"split_item={split_item}: only the single-tensor forms 2 and 3 are modeled")
    if group_type != 0:
        raise ArgumentError(f"group_type={group_type}: only 0 (groups along M) is modeled")
    if group_list_type not in (0, 1):
        raise ArgumentError(f"group_list_type={group_list_type}: use 0 (cumulative) or 1 (counts)")
    if act_type != 0:
        raise ArgumentError(f"act_type={act_type}: only 0 is modeled (use swiglu=True for the fused SwiGLU)")
    if weight_format not in ("ND", "NZ"):
        raise ArgumentError(f"weight_format={weight_format!r}: use 'ND' or 'NZ'")
    xs, form = split_ranks(x, "x", stacked_ndim=2)
    n = len(xs)
    ws = per_rank(weight, n, "weight", stacked_ndim=3)
    gls = _group_lists(group_list, n)
    scales = per_rank(scale, n, "scale", stacked_ndim=2)
    ptss = per_rank(per_token_scale, n, "per_token_scale", stacked_ndim=1)
    if stream is not None:
        pod, dies, cores, streams = caller_streams(stream, n, "aic", cores)
    else:
        pod, dies = make_pod(pod, dies, n, trace)
        cores = check_cores(pod.profile, cores, "aic")
    prof = pod.profile
    launches, outs, macs = [], [], 0
    for r, (xr, wr, gl, sc, pt, die) in enumerate(zip(xs, ws, gls, scales, ptss, dies)):
        p, out_dt, m, n_out = _plan(xr, wr, gl, sc, pt, output_dtype, group_list_type, swiglu, weight_format,
                                    tiling, prof, cores)
        ends = group_ends(gl, group_list_type)
        macs += (ends[-1] if ends else 0) * int(xr.shape[1]) * int(wr.shape[2])
        w_host = _nz(wr, numeric) if weight_format == "NZ" else wr
        tl = p.tiling
        raw_dt = "int32" if p.int8 else "fp32"
        t = GemmTensors(
            x=to_gm(pod, die, xr, f"x{r}", numeric),
            w=to_gm(pod, die, w_host, f"weight{r}", numeric, dtype=name_of(as_dtype(wr.dtype))),
            group_list=to_gm(pod, die, gl, f"group_list{r}", numeric, real=True),         # int64 (_group_lists)
            y=pod.alloc(die, (m, n_out), out_dt, phantom=not numeric, name=f"y{r}"),
            scale=None if sc is None else to_gm(pod, die, sc, f"scale{r}", numeric, dtype="fp32"),
            per_token_scale=None if pt is None else to_gm(pod, die, pt, f"per_token_scale{r}", numeric,
                                                          dtype="fp32"),
            workspace=pod.alloc(die, (cores, 2, tl.m, tl.n), raw_dt, phantom=not numeric, name=f"workspace{r}")
            if p.epilogue else None)
        if p.splits > 1:
            num_tiles = len(plan_tiles(ends, p.n_out, tl.n // 2 if p.swiglu else tl.n, tl.m))
            t = replace(t, partials=pod.alloc(die, (max(1, num_tiles), p.splits, tl.m, tl.n), raw_dt,
                                              phantom=not numeric, name=f"partials{r}"),
                        counters=pod.alloc(die, (max(1, num_tiles),), "int32", name=f"split_counters{r}"))
        launches.append((die, grouped_matmul_kernel, (t, p), {"aic": cores}, numeric))
        outs.append(t.y)
    def finish(run):
        ys = [to_torch(y.numpy()) if numeric else None for y in outs]
        return GroupedMatmulResult(join_ranks(ys, form), run, macs)
    if stream is not None:
        return Pending(queue_ranks(launches, streams, after), finish)
    return finish(run_ranks(pod, launches))


def _nz(w, numeric: bool):
    """[E, K, N] -> NZ [E, N1, K1, 16, N0] (host side, like npu_format_cast); timing only, the NZ shape."""
    from ascend_emu.layout import nz_shape
    dt = as_dtype(w.dtype)
    if not numeric:
        return HostShape(nz_shape(tuple(w.shape), dt), dt)
    import torch
    a = w.numpy() if w.dtype != torch.bfloat16 else w.view(torch.int16).numpy().view(dt)
    return nd_to_nz(a)


def _plan(xr, wr, gl, sc, pt, output_dtype, group_list_type, swiglu, weight_format, tiling, prof, cores):
    """Check one rank's operands and the tiling (None: ``choose_tiling`` for this shape on ``cores`` AICs);
    return (GemmPlan, output dtype name, M, output columns)."""
    dt = check_dtype(xr, "x", ("int8", "bf16", "fp16"))
    wdt = check_dtype(wr, "weight", ("int8", "bf16", "fp16"))
    if wdt != dt:
        raise DTypeError(f"weight dtype {wdt} != x dtype {dt}")
    if xr.ndim != 2 or wr.ndim != 3:
        raise ShapeError(f"x must be [M, K] and weight [E, K, N] per rank, got {tuple(xr.shape)} and "
                         f"{tuple(wr.shape)}")
    m, k = (int(d) for d in xr.shape)
    e, kw, n = (int(d) for d in wr.shape)
    if kw != k:
        raise ShapeError(f"weight K={kw} != x K={k}")
    n0 = n0_of(as_dtype(dt))
    if k % n0 or n % n0:
        raise ShapeError(f"K={k} and N={n} must be multiples of {n0} for {dt} (32-byte rows / fractal blocks)")
    if swiglu and (n // 2) % n0:
        raise ShapeError(f"swiglu: N/2={n // 2} must be a multiple of {n0} (gate and up halves)")
    if len(gl) != e:
        raise ShapeError(f"group_list has {len(gl)} entries for E={e} weight groups")
    if len(gl) and int(gl.min()) < 0:
        raise ArgumentError(f"group_list entries must be >= 0, got {gl.tolist()}")
    ends = group_ends(gl, group_list_type)
    if group_list_type == 0 and any(b < a for a, b in zip(ends, ends[1:])):
        raise ArgumentError(f"group_list_type=0 needs non-decreasing cumulative ends, got {gl.tolist()}")
    if ends and ends[-1] > m:
        raise ShapeError(f"group_list covers {ends[-1]} rows, x has M={m}")
    is8 = dt == "int8"
    if sc is not None:
        if not is8:
            raise ArgumentError("scale (dequant) applies to int8 inputs only")
        if tuple(sc.shape) != (e, n):
            raise ShapeError(f"scale must be [E={e}, N={n}], got {tuple(sc.shape)}")
    if pt is not None:
        if not is8:
            raise ArgumentError("per_token_scale applies to int8 inputs only")
        if tuple(pt.shape) != (m,):
            raise ShapeError(f"per_token_scale must be [M={m}], got {tuple(pt.shape)}")
    if output_dtype is None:
        out = ("bf16" if (sc is not None or pt is not None or swiglu) else "int32") if is8 else dt
    else:
        out = name_of(as_dtype(output_dtype, "output_dtype"))
    allowed = ("int32", "bf16", "fp16", "fp32") if is8 else (dt, "fp32")
    if out not in allowed:
        raise DTypeError(f"output_dtype {out} not supported for {dt} x: use {', '.join(allowed)}")
    if out == "int32" and (sc is not None or pt is not None or swiglu):
        raise ArgumentError("output_dtype=torch.int32 returns raw accumulators: no scale, per_token_scale or swiglu")
    nz = weight_format == "NZ"
    if tiling is None:
        tl = choose_tiling(prof, ends, n // 2 if swiglu else n, k, dt, bool(swiglu), as_dtype(out).itemsize, cores)
    else:
        tl = tiling.resolve(dt)
    tl.check(prof, dt, swiglu, k)
    if nz and tl.n % n0:
        raise ArgumentError(f"tiling n={tl.n}: NZ weights need tiles of whole {n0}-column fractal blocks")
    split = tl.k_splits > 1
    epilogue = (swiglu or pt is not None) and not split
    p = GemmPlan(tl, n, nz=nz, swiglu=bool(swiglu), epilogue=epilogue, fixpipe_scale=not epilogue and not split,
                 group_list_type=group_list_type, int8=is8,
                 epi_rows=epilogue_rows(prof.ub_bytes, tl.n, is8, as_dtype(out).itemsize, bool(swiglu), tl.k_splits)
                 if epilogue or split else 0)
    return p, out, m, p.n_out


# ============================================================================================ torch reference
def grouped_matmul_reference(x, weight, *, group_list, group_list_type: int = 0, scale=None, per_token_scale=None,
                             output_dtype=None, swiglu: bool = False):
    """torch reference for one rank: (y, acc). int8: acc = exact int64 x_e @ w[e] per group ([M, N], rows outside
    the groups 0), y = out((fp32(acc) * per_token_scale) * scale) (SwiGLU on the dequantised halves).
    bf16/fp16: acc = fp32 x_e @ w[e] (torch's summation order), y = acc rounded (SwiGLU in fp32 first)."""
    import torch
    m, n = x.shape[0], weight.shape[2]
    ends = group_ends(torch.as_tensor(group_list).reshape(-1).tolist(), group_list_type)
    is8 = x.dtype == torch.int8
    acc = torch.zeros(m, n, dtype=torch.int64 if is8 else torch.float32)
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            if is8:
                acc[start:end] = x[start:end].long() @ weight[g].long()
            else:
                acc[start:end] = x[start:end].float() @ weight[g].float()
        start = max(start, end)
    if output_dtype is None:
        output_dtype = (torch.bfloat16 if (scale is not None or per_token_scale is not None or swiglu)
                        else torch.int32) if is8 else x.dtype
    if output_dtype == torch.int32:
        return acc.to(torch.int32), acc
    f = acc.to(torch.float32)
    if is8:
        rows = torch.zeros(m, dtype=torch.long)
        start = 0
        for g, end in enumerate(ends):
            rows[start:end] = g
            start = max(start, end)
        if per_token_scale is not None:
            f = f * per_token_scale.float()[:, None]
        if scale is not None:
            f = f * scale.float()[rows]
    if swiglu:
        g_, u = f[:, :n // 2], f[:, n // 2:]
        f = torch.nn.functional.silu(g_) * u
    covered = ends[-1] if ends else 0
    f[covered:] = 0
    return f.to(output_dtype), acc
