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

from dataclasses import dataclass

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.dtypes import as_dtype, name_of
from ascend_emu.errors import ArgumentError, CapacityError, DTypeError, ShapeError
from ascend_emu.layout import n0_of, nd_to_nz

from .ranks import (Outputs, Ranks, check_cores, check_dtype, integer_array, join_ranks, make_pod, per_rank,
                    run_ranks, split_ranks, to_gm, to_torch, warn_plain_list)

BASE_M, BASE_N = 128, 256
BASE_K = {"int8": 128, "bf16": 64, "fp16": 64}     # the L0 K step: fp32 accumulation order of the bf16 path
EPI_ROWS = 32          # most rows per epilogue chunk; fewer when the chunk's tiles would not fit the UB (epi_rows)
FLAG_READY, FLAG_FREE = 0, 1          # AIC -> AIV: workspace slot holds a tile; AIV -> AIC: slot read


@dataclass(frozen=True)
class GemmTiling:
    """Block and tile shape of the cube loop (CATLASS's grouped per-token-dequant GEMM: L1 tile 128 x 256 x 512,
    L0 tile 128 x 256 x 128 for int8, K halved for 2-byte types; 2 L1 stages, 2 L0 stages, 1 L0C stage).
    ``k_l1``/``k_l0`` None: the dtype's default."""
    m: int = BASE_M
    n: int = BASE_N
    k_l1: int | None = None
    k_l0: int | None = None
    l1_stages: int = 2

    def resolve(self, dtype: str) -> "GemmTiling":
        """The tiling with its K steps filled in for ``dtype`` ("int8", "bf16", "fp16")."""
        k0 = self.k_l0 or BASE_K[dtype]
        k1 = self.k_l1 or k0 * 4
        return GemmTiling(self.m, self.n, k1, k0, self.l1_stages)

    def check(self, prof, dtype: str, swiglu: bool) -> None:
        """Raise ArgumentError unless the tiles fit the AIC's buffers (checked when the plan is built)."""
        isz = 1 if dtype == "int8" else 2
        acc = 4
        need = {
            "L1": (self.l1_stages * (self.m + self.n) * self.k_l1 * isz + self.n * 4, prof.l1_bytes),
            "L0A": (2 * self.m * self.k_l0 * isz, prof.l0a_bytes),
            "L0B": (2 * self.k_l0 * self.n * isz, prof.l0b_bytes),
            "L0C": (self.m * self.n * acc, prof.l0c_bytes),
        }
        for buf, (got, cap) in need.items():
            if got > cap:
                raise ArgumentError(f"tiling {self}: {buf} needs {got} bytes, the AIC has {cap}")
        if self.k_l1 % self.k_l0 or self.m % 16 or self.n % 8 or (swiglu and self.n % 32):
            raise ArgumentError(f"tiling {self}: k_l1 must be a multiple of k_l0, m a multiple of 16, n of 8 "
                                f"(of 32 with swiglu; the cube pads n to whole 16-column fractals)")


def group_ends(values, group_list_type: int) -> list:
    """Cumulative row ends from a group list (type 0: cumulative, type 1: counts)."""
    vals = [int(v) for v in values]
    return vals if group_list_type == 0 else list(np.cumsum(vals, dtype=np.int64).tolist())


def plan_tiles(ends: list, n_out: int, tile_n: int, tile_m: int = BASE_M) -> list:
    """Every output tile, group by group: (group, m0, rows, n0, cols). Tile i runs on AIC i % num_aic."""
    tiles, start = [], 0
    for g, end in enumerate(ends):
        for m0 in range(start, end, tile_m):
            rows = min(tile_m, end - m0)
            for n0 in range(0, n_out, tile_n):
                tiles.append((g, m0, rows, n0, min(tile_n, n_out - n0)))
        start = max(start, end)
    return tiles


@kernel(cores="mix")
def grouped_matmul_kernel(ctx, x_gm, w_gm, group_gm, scale_gm, pts_gm, ws_gm, y_gm, p):
    """x_gm [M, K] @ w_gm (ND [E, K, N] or NZ [E, N1, K1, 16, N0]) by groups -> y_gm [M, N] (SwiGLU: [M, N/2]).
    group_gm [E] int64 group list (control data, read by the scalar unit); scale_gm [E, N] fp32 or None; pts_gm
    [M] fp32 or None; ws_gm [num_aic, 2, m, n] workspace (epilogue only, m x n the tiling); p: the plan dict."""
    k_dim = x_gm.shape[1]
    if ctx.is_aiv and not p["epilogue"]:
        return                                            # the fixpipe writes y itself
    ends = group_ends((yield ctx.gm_load(group_gm)), p["group_list_type"])
    tl = p["tiling"]
    tiles = plan_tiles(ends, p["n_out"], tl.n // 2 if p["swiglu"] else tl.n, tl.m)
    n_aic = ctx.block_num if ctx.is_aic else ctx.block_num // 2
    mine = tiles[ctx.group_idx::n_aic]
    if ctx.is_aic:
        yield from cube_tiles(ctx, x_gm, w_gm, scale_gm, ws_gm, y_gm, p, mine, k_dim)
    elif p["epilogue"]:
        yield from _epilogue(ctx, scale_gm, pts_gm, ws_gm, y_gm, p, mine)


def cube_tiles(ctx, x_gm, w_gm, scale_gm, ws_gm, y_gm, p, mine, k_dim):
    """The AIC tile loop (public: persistent pipelines run it inside their own kernels, serving.expert_pipeline).
    AIC: per tile, L1 steps of k_l1 (GM -> L1, MTE2), each in L0 steps of k_l0 (L1 -> L0A/L0B, MTE1; mmad), then
    fixpipe to the workspace (+ READY) or to y. ``p["tiling"]`` (a resolved GemmTiling) sets the shapes."""
    dt = x_gm.dtype
    tl = p.get("tiling") or GemmTiling().resolve("int8" if dt == np.int8 else "bf16")
    k1, k0, stages = tl.k_l1, tl.k_l0, tl.l1_stages
    acc_dt = "int32" if dt == np.int8 else "fp32"
    a_l1 = ctx.l1.alloc((stages, tl.m, k1), dt, name="a_l1")
    b_l1 = ctx.l1.alloc((stages, k1 * tl.n), dt, name="b_l1")
    a_l0 = ctx.l0a.alloc((2, tl.m, k0), dt, name="a_l0")
    b_l0 = ctx.l0b.alloc((2, k0, tl.n), dt, name="b_l0")
    acc = ctx.l0c.alloc((tl.m, tl.n), acc_dt, name="acc")
    fix_scale = p["fixpipe_scale"] and scale_gm is not None
    if fix_scale:
        cs_l1 = ctx.l1.alloc((tl.n,), "fp32", name="channel_scale")
    half_n = p["n"] // 2
    pad = (tl.n * dt.itemsize) % 32 != 0          # B rows are not whole 32-byte bursts: DataCopyPad
    step = step0 = 0
    for j, (g, m0, mt, n0, nw) in enumerate(mine):
        # B column ranges of this tile: [n0, n0 + nw), and with SwiGLU the matching up columns
        cols = [(n0, 0)] + ([(half_n + n0, nw)] if p["swiglu"] else [])
        nt = nw * len(cols)
        for kb in range(0, k_dim, k1):
            kt = min(k1, k_dim - kb)
            s1 = step % stages
            step += 1
            b_src = b_tile_view(w_gm, g, kb, kt, [c0 for c0, _ in cols], nw, p["nz"])
            b_dst = b_l1[s1, :kt * nt].reshape(kt, nt)      # compact [kt, nt] in the slot
            yield ctx.copy_gm_to_l1(a_l1[s1, :mt, :kt], x_gm[m0:m0 + mt, kb:kb + kt])
            yield ctx.copy_gm_to_l1(b_dst.reshape(b_src.shape), b_src, pad=pad)
            for kk in range(0, kt, k0):
                kw = min(k0, kt - kk)
                s0 = step0 % 2
                step0 += 1
                yield ctx.copy_l1_to_l0a(a_l0[s0, :mt, :kw], a_l1[s1, :mt, kk:kk + kw])
                yield ctx.copy_l1_to_l0b(b_l0[s0, :kw, :nt], b_dst[kk:kk + kw])
                yield ctx.mmad(acc[:mt, :nt], a_l0[s0, :mt, :kw], b_l0[s0, :kw, :nt], accumulate=kb + kk > 0)
        if p["epilogue"]:
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


def b_tile_view(w_gm, g, k0: int, kt: int, col_starts: list, nw: int, nz: bool):
    """The GM view of one B tile: rows k0:k0+kt of expert g, ``nw`` columns from each start in ``col_starts`` (one
    start, or the gate and up starts with SwiGLU), as [kt, parts, nw] (ND) or [kt, parts, nw / N0, N0] (NZ), in the
    order the compact [kt, parts * nw] L1 tile holds them. One DataCopy moves it: bursts of a row's ``nw`` elements
    (ND) or of one 32-byte fractal row (NZ: each column block's K rows are contiguous in GM).

    Built with a raw strided view (a DataCopy's block count / length / source stride): the views API has no
    permute, and column slices written by separate copies would be ordered by their overlapping byte extents."""
    isz = w_gm.dtype.itemsize
    parts = len(col_starts)
    gap = (col_starts[1] - col_starts[0]) if parts > 1 else 0
    if not nz:
        s_e, s_k, _ = w_gm.strides
        off = w_gm.offset + g * s_e + k0 * s_k + col_starts[0] * isz
        return w_gm._new(off, (kt, parts, nw), (s_k, gap * isz, isz))
    s_e, s_n1, _, _, _ = w_gm.strides
    n0 = w_gm.shape[-1]
    off = w_gm.offset + g * s_e + (col_starts[0] // n0) * s_n1 + k0 * n0 * isz
    return w_gm._new(off, (kt, parts, nw // n0, n0), (n0 * isz, (gap // n0) * s_n1, s_n1, isz))


def _epilogue(ctx, scale_gm, pts_gm, ws_gm, y_gm, p, mine):
    """AIV: per tile, wait READY, dequantise (int8) / SwiGLU / cast this AIV's half of the rows, store, flag FREE."""
    ws_dt = ws_gm.dtype
    tn, rows = p["tiling"].n, p["epi_rows"]
    q_t = ctx.ub.alloc((2, rows, tn), ws_dt, name="acc")
    f_t = ctx.ub.alloc((2, rows, tn), "fp32", name="deq") if ws_dt == np.int32 else q_t
    o_t = ctx.ub.alloc((2, rows, tn), y_gm.dtype, name="out")
    tmp = ctx.ub.alloc((rows, tn // 2), "fp32", name="silu") if p["swiglu"] else None
    pt_t = ctx.ub.alloc((2, rows), "fp32", name="token_scale")
    cs_t = ctx.ub.alloc((tn,), "fp32", name="channel_scale") if scale_gm is not None else None
    pad = (tn * y_gm.dtype.itemsize) % 32 != 0    # output rows that are not whole bursts: DataCopyPad
    if ws_dt == np.int32 and pts_gm is None:
        yield ctx.vec.duplicate(pt_t, 1.0)                # dequant_int8 takes a row scale: exact ones
    half_n = p["n"] // 2
    q = 0
    for j, (g, m0, mt, n0, nw) in enumerate(mine):
        cols = [(n0, 0)] + ([(half_n + n0, nw)] if p["swiglu"] else [])
        nt = nw * len(cols)
        h = -(-mt // 2)
        lo, hi = (0, h) if ctx.sub_block_idx == 0 else (h, mt)
        yield ctx.cross_core_wait(FLAG_READY)
        if cs_t is not None and hi > lo:
            for c0, at in cols:
                yield ctx.copy_gm_to_ub(cs_t[at:at + nw], scale_gm[g, c0:c0 + nw])
        for r0 in range(lo, hi, rows):
            cr = min(rows, hi - r0)
            Q, F, O = q_t[q, :cr, :nt], f_t[q, :cr, :nt], o_t[q, :cr, :nw]
            yield ctx.copy_gm_to_ub(Q, ws_gm[ctx.group_idx, j % 2, r0:r0 + cr, :nt])
            if ws_dt == np.int32:
                if pts_gm is not None:
                    yield ctx.copy_gm_to_ub(pt_t[q, :cr], pts_gm[m0 + r0:m0 + r0 + cr], pad=True)
                yield ctx.vec.dequant_int8(F, Q, pt_t[q, :cr], None if cs_t is None else cs_t[:nt])
            if p["swiglu"]:
                gate, up, t = f_t[q, :cr, :nw], f_t[q, :cr, nw:nt], tmp[:cr, :nw]
                yield ctx.vec.muls(t, gate, -1.0)         # silu(g) = g / (1 + exp(-g))
                yield ctx.vec.exp(t, t)
                yield ctx.vec.adds(t, t, 1.0)
                yield ctx.vec.div(t, gate, t)
                yield ctx.vec.mul(t, t, up)
                yield ctx.vec.cast(O, t)
            else:
                yield ctx.vec.cast(O, F)
            yield ctx.copy_ub_to_gm(y_gm[m0 + r0:m0 + r0 + cr, n0:n0 + nw], O, pad=pad)
            q ^= 1
        if j + 2 < len(mine):
            yield ctx.cross_core_set(FLAG_FREE, after="MTE2")   # once this AIV's reads of the slot are done


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
                   dies=None, cores: int | None = None, trace: bool = True) -> GroupedMatmulResult:
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
    """
    import torch
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
    pod, dies = make_pod(pod, dies, n, trace)
    prof = pod.profile
    cores = check_cores(prof, cores, "aic")
    launches, outs, macs = [], [], 0
    for r, (xr, wr, gl, sc, pt, die) in enumerate(zip(xs, ws, gls, scales, ptss, dies)):
        p, out_dt, m, n_out = _plan(xr, wr, gl, sc, pt, output_dtype, group_list_type, swiglu, weight_format,
                                    tiling or GemmTiling(), prof)
        ends = group_ends(gl, group_list_type)
        macs += (ends[-1] if ends else 0) * int(xr.shape[1]) * int(wr.shape[2])
        x_gm = to_gm(pod, die, xr, f"x{r}", numeric)
        w_host = wr
        if weight_format == "NZ":
            w_host = _nz(wr, numeric)
        w_gm = to_gm(pod, die, w_host, f"weight{r}", numeric, dtype=name_of(as_dtype(wr.dtype)))
        g_gm = to_gm(pod, die, torch.as_tensor(gl, dtype=torch.int64), f"group_list{r}", numeric, real=True)
        s_gm = None if sc is None else to_gm(pod, die, sc, f"scale{r}", numeric, dtype="fp32")
        t_gm = None if pt is None else to_gm(pod, die, pt, f"per_token_scale{r}", numeric, dtype="fp32")
        ws_gm = None
        if p["epilogue"]:
            ws_dt = "int32" if p["int8"] else "fp32"
            tl = p["tiling"]
            ws_gm = pod.alloc(die, (cores, 2, tl.m, tl.n), ws_dt, phantom=not numeric, name=f"workspace{r}")
        y_gm = pod.alloc(die, (m, n_out), out_dt, phantom=not numeric, name=f"y{r}")
        launches.append((die, grouped_matmul_kernel, (x_gm, w_gm, g_gm, s_gm, t_gm, ws_gm, y_gm, p),
                         {"aic": cores}, numeric))
        outs.append(y_gm)
    run = run_ranks(pod, launches)
    ys = [to_torch(y.numpy()) if numeric else None for y in outs]
    return GroupedMatmulResult(join_ranks(ys, form), run, macs)


def _nz(w, numeric: bool):
    """[E, K, N] -> NZ [E, N1, K1, 16, N0] (host side, like npu_format_cast); a meta tensor gets the NZ shape."""
    import torch
    from ascend_emu.layout import nz_shape
    dt = as_dtype(w.dtype)
    if not numeric:
        return torch.empty(nz_shape(tuple(w.shape), dt), dtype=w.dtype, device="meta")
    a = w.numpy() if w.dtype != torch.bfloat16 else w.view(torch.int16).numpy().view(dt)
    return nd_to_nz(a)


def _plan(xr, wr, gl, sc, pt, output_dtype, group_list_type, swiglu, weight_format, tiling, prof):
    """Check one rank's operands and the tiling; return (plan dict, output dtype name, M, output columns)."""
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
    epilogue = swiglu or pt is not None
    tl = tiling.resolve(dt)
    tl.check(prof, dt, swiglu)
    if weight_format == "NZ" and tl.n % n0:
        raise ArgumentError(f"tiling n={tl.n}: NZ weights need tiles of whole {n0}-column fractal blocks")
    p = {"tiling": tl, "nz": weight_format == "NZ", "swiglu": bool(swiglu), "epilogue": epilogue,
         "group_list_type": group_list_type, "n": n, "n_out": n // 2 if swiglu else n, "int8": is8,
         "fixpipe_scale": not epilogue,
         "epi_rows": epilogue_rows(prof.ub_bytes, tl.n, is8, as_dtype(out).itemsize, bool(swiglu)) if epilogue
         else 0}
    return p, out, m, p["n_out"]


def epilogue_rows(ub_bytes: int, tile_n: int, int8: bool, out_itemsize: int, swiglu: bool) -> int:
    """Rows per AIV epilogue chunk: at most EPI_ROWS, a multiple of 8 (the [2, rows] fp32 token-scale slots stay
    32-byte aligned), and few enough that the chunk's ping-pong tiles fit the UB for this output dtype: the
    workspace tile (int32 / fp32), the dequantised fp32 tile (int8), the output tile, the SwiGLU scratch and the
    token scales, per row; the channel scales once."""
    per_row = 2 * tile_n * (4 + (4 if int8 else 0) + out_itemsize) + (tile_n // 2 * 4 if swiglu else 0) + 2 * 4
    fixed = tile_n * 4 + 6 * 32                         # channel scales, one 32-byte alignment per tile
    rows = min(EPI_ROWS, 8 * ((ub_bytes - fixed) // (8 * per_row)))
    if rows < 8:
        raise CapacityError(f"grouped_matmul epilogue: 8 rows of {per_row} bytes do not fit the {ub_bytes}-byte UB")
    return rows


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
