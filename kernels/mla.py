"""MLA prolog (torch_npu ``npu_mla_prolog_v3``) as one fused MIX kernel, plus its torch references.

Math (DeepSeek-V3 absorb mode, DESIGN.md 5): c_q = RMSNorm(x W_dq); q_c = c_q W_uq; q_nope = q_c . W_uk (per head,
absorbed); q_rope = RoPE(c_q W_qr); k_c = RMSNorm(x W_dkv) -> kv_cache; k_rope = RoPE(x W_kr) -> kr_cache, written at
``cache_index`` slots. RoPE order: ``kernels.rope``.

Layers: the tile layer (``kernels.tiles``: ``CubeTiles``, ``Weight``, ``split``: GM -> L1 -> L0 -> mmad -> fixpipe,
the only code that knows tile sizes) -> the prolog's per-core bodies (``_prolog_aic``, ``_prolog_aiv``) -> the kernel
(``mla_prolog_kernel``) -> the host API (``mla_prolog``, ``mla_prolog_timing``).

Precision choices: GEMM outputs that feed the vector cores stay fp32 (int32 in int8 modes) in the GM workspace, so
RMSNorm and RoPE see unrounded values; c_q is rounded to bf16 (or re-quantised per token to int8) before W_uq_qr,
q_nope to bf16 before W_uk, as the cube needs. The output query is bf16 in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ascend_emu.errors import ArgumentError, CapacityError, ShapeError
from ascend_emu import Pod, RunResult, cloudmatrix384, kernel, nz_shape
from ascend_emu.dtypes import bf16

from .tiles import KiB, Carve, CubeTiles, Weight, split
from .paged_cache import cache_shapes, check_cache_mode, check_caches
from .ranks import Pending, caller_streams, integer_array, to_gm

# ============================================================================================ MLA prolog
# cross-core flags: AIC -> AIV "q tiles of my heads are in GM"; AIV -> AIC "q_nope dequantised"
F_Q, F_QN = 1, 2
ROWS_AIV = 8              # token rows per AIV chunk (norm / cache path)
ROWS_ROPE = 64            # token rows per AIV chunk (query rope path)
STAGES = ("mm1", "norm", "kv", "mm2", "rope", "mm3")


@dataclass(frozen=True)
class PrologPlan:
    """Shapes and modes of one mla_prolog launch (checked when built, not in the kernel)."""
    t: int
    he: int
    hcq: int
    hckv: int
    n: int
    d: int
    dr: int
    block_size: int
    cache_mode: str
    weight_quant_mode: int
    kv_cache_quant_mode: int
    eps_cq: float
    eps_ckv: float
    aic: int
    smooth: bool

    @property
    def q_int8(self) -> bool:            # c_q re-quantised per token, int8 weight_uq_qr
        return self.weight_quant_mode in (1, 2)

    @property
    def x_int8(self) -> bool:            # int8 token_x and weight_dq / weight_dkv_kr
        return self.weight_quant_mode == 2

    @property
    def dqr(self) -> int:
        return self.d + self.dr


def _check_plan(p: PrologPlan) -> None:
    check_cache_mode(p.cache_mode)
    if p.weight_quant_mode not in (0, 1, 2):
        raise ArgumentError(f"weight_quant_mode={p.weight_quant_mode}: use 0 (bf16), 1 (int8 weight_uq_qr) or "
                            f"2 (int8 token_x and weights)")
    if p.kv_cache_quant_mode not in (0, 1):
        raise ArgumentError(f"kv_cache_quant_mode={p.kv_cache_quant_mode}: use 0 (bf16) or 1 (int8, per-channel "
                            f"quant_scale_ckv)")
    for name, v in (("He", p.he), ("Hcq", p.hcq), ("Hckv", p.hckv), ("D", p.d), ("Dr", p.dr),
                    ("block_size", p.block_size)):
        if v <= 0 or v % 16:
            raise ShapeError(f"{name}={v} must be a positive multiple of 16 (cube fractal / 32-byte bf16 rows)")
    if p.q_int8 and (p.d + p.dr) % 32:
        raise ShapeError(f"D + Dr = {p.d + p.dr} must be a multiple of 32 for an int8 weight_uq_qr "
                         f"(weight_quant_mode={p.weight_quant_mode}): each head's columns are copied as whole "
                         f"32-byte blocks")
    if p.kv_cache_quant_mode and p.hckv % 32:
        raise ShapeError(f"Hckv={p.hckv} must be a multiple of 32 for an int8 kv_cache")
    if not 1 <= p.aic <= 24:
        raise ArgumentError(f"aic={p.aic} out of range 1..24 (AIC cores of a die)")
    if p.t < 1:
        raise ShapeError(f"token_x has {p.t} tokens; need at least 1")


@dataclass(frozen=True)
class PrologTensors:
    """The GM tensors of one prolog launch (npu_mla_prolog_v3 names; shapes in ``mla_prolog``), built in
    ``_run_prolog``: the inputs and caches, ``kv_rows`` / ``kr_rows`` (PA_BSND caches as [slots, H] rows), the
    fp32 / int32 workspaces ``ws_*``, the outputs and ``sync`` (int32 counters, fused launch only). None: not used
    in this mode."""
    token_x: object = None
    weight_dq: object = None
    weight_uq_qr: object = None
    weight_uk: object = None
    weight_dkv_kr: object = None
    rmsnorm_gamma_cq: object = None
    rmsnorm_gamma_ckv: object = None
    rope_sin: object = None
    rope_cos: object = None
    kv_cache: object = None
    kr_cache: object = None
    cache_index: object = None
    dequant_scale_x: object = None
    dequant_scale_w_dq: object = None
    dequant_scale_w_uq_qr: object = None
    dequant_scale_w_dkv_kr: object = None
    quant_scale_ckv: object = None
    smooth_scales_cq: object = None
    kv_rows: object = None
    kr_rows: object = None
    ws_cq: object = None
    ws_kv: object = None
    ws_cqn: object = None
    ws_cqs: object = None
    ws_q: object = None
    ws_qn: object = None
    query: object = None
    query_rope: object = None
    sync: object = None


@kernel(cores="mix")
def mla_prolog_kernel(ctx, p: PrologPlan, g: PrologTensors, stages: frozenset, sync: bool):
    """MLAProlog as one MIX kernel (``sync=True``), or one stage of it per launch (``sync=False``).

    AIC (cube)                                      AIV (vector)
      mm1 x @ [W_dq | W_dkv_kr] -> ws_cq, ws_kv       wait mm1: RMSNorm(c_q) (-> int8) -> ws_cqn -> signal cqn
          -> signal mm1                                 then RMSNorm(k_c) (-> int8), RoPE(k_r) -> caches
      wait cqn: mm2 c_q @ W_uq_qr (my heads) -> ws_q  wait F_Q: RoPE(q_r) -> query_rope; int8: dequant q_nope
               -> set F_Q                                        -> ws_qn -> set F_QN
      (int8: wait F_QN) mm3 q_nope @ W_uk[h] -> query
    The cache path of the AIVs runs while the AICs do mm2, the q rope while they do mm3: that is the overlap.
    ``signal`` is a GM counter (atomic add once the pipe's writes are visible): every AIC/AIV takes part.
    """
    if ctx.is_aic:
        yield from _prolog_aic(ctx, p, g, stages, sync)
    else:
        yield from _prolog_aiv(ctx, p, g, stages, sync)


def _prolog_aic(ctx, p, g, stages, sync):
    cube = CubeTiles(ctx)
    me, n_aic = ctx.block_idx, ctx.block_num
    x_align = 32 if p.x_int8 else 16
    if "mm1" in stages:
        # one pass over x for both down-projections (x is re-read per AIC: keep it to once)
        q0, q1 = split(p.hcq, n_aic, x_align)[me]
        k0, k1 = split(p.hckv + p.dr, n_aic, x_align)[me]
        yield from cube.matmul_multi(g.token_x, [
            (Weight(g.weight_dq, p.he, p.hcq), q0, q1, lambda m0, m1, c0, c1: g.ws_cq[m0:m1, c0:c1]),
            (Weight(g.weight_dkv_kr, p.he, p.hckv + p.dr), k0, k1,
             lambda m0, m1, c0, c1: g.ws_kv[m0:m1, c0:c1])])
        if sync:
            yield ctx.atomic_add(g.sync[0:1], 1, after="FIXP")
    h0, h1 = split(p.n, n_aic)[me]
    if "mm2" in stages:
        if sync:
            yield ctx.wait_gm(g.sync[16:17], "ge", 2 * n_aic)
        if h1 > h0:
            yield from cube.matmul(g.ws_cqn, Weight(g.weight_uq_qr, p.hcq, p.n * p.dqr),
                                   [(h0 * p.dqr, h1 * p.dqr)], lambda m0, m1, c0, c1: g.ws_q[m0:m1, c0:c1])
        if sync:
            yield ctx.cross_core_set(F_Q)
    if "mm3" in stages:
        if sync and p.q_int8:
            yield ctx.cross_core_wait(F_QN)
        query = g.query
        for h in range(h0, h1):
            if p.q_int8:
                a = g.ws_qn[:, h, :]
            else:
                a = g.ws_q.reshape(p.t, p.n, p.dqr)[:, h, :p.d]
            yield from cube.matmul(a, Weight(g.weight_uk[h], p.d, p.hckv), [(0, p.hckv)],
                                   lambda m0, m1, c0, c1, h=h: query[m0:m1, h, c0:c1])


UB_PHASE_BYTES = 160 * KiB


def _prolog_aiv(ctx, p, g, stages, sync):
    n_aic = ctx.block_num // 2
    ctx.carve = Carve(ctx.ub, UB_PHASE_BYTES, "phase")      # tiles of each phase, reused phase to phase
    ctx.index_tile = ctx.ub.alloc((_pad8(ROWS_AIV),), "int32", phantom=False, name="cache_index")  # control data
    if "norm" in stages:
        if sync:
            yield ctx.wait_gm(g.sync[0:1], "ge", n_aic)
        r0, r1 = split(p.t, ctx.block_num)[ctx.block_idx]
        if r1 > r0:
            yield from _norm_cq(ctx, p, g, r0, r1)
        if sync:
            yield ctx.atomic_add(g.sync[16:17], 1, after="MTE3")
    if "kv" in stages:
        r0, r1 = split(p.t, ctx.block_num)[ctx.block_idx]
        if r1 > r0:
            yield from _kv_path(ctx, p, g, r0, r1)
    if "rope" in stages:
        if sync:
            yield ctx.cross_core_wait(F_Q)
        h0, h1 = split(p.n, n_aic)[ctx.group_idx]
        a, b = split(h1 - h0, 2)[ctx.sub_block_idx]
        if b > a:
            yield from _q_rope(ctx, p, g, h0 + a, h0 + b)
        if sync and p.q_int8:
            yield ctx.cross_core_set(F_QN)


def _rows_for(bytes_per_row: int, limit: int = ROWS_AIV) -> int:
    """Token rows per chunk so that a phase's tiles fit its UB region (checked again by ``Carve.take``)."""
    rows = (UB_PHASE_BYTES - 16 * KiB) // bytes_per_row
    if rows < 1:
        raise CapacityError(f"one token row needs {bytes_per_row} bytes of UB; the phase region has "
                            f"{UB_PHASE_BYTES - 16 * KiB}")
    return min(limit, rows)


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _load_fp32_row(ctx, dst_f32, src_gm, stage):
    """A GM vector (bf16 or fp32) -> fp32 UB tile (through ``stage``, a bf16 tile, when it is bf16)."""
    if src_gm.dtype == dst_f32.dtype:
        yield ctx.copy_gm_to_ub(dst_f32, src_gm, pad=True)
    else:
        yield ctx.copy_gm_to_ub(stage, src_gm, pad=True)
        yield ctx.vec.cast(dst_f32, stage)


def _rmsnorm(ctx, x, sq, ss, gamma, eps: float):
    """x[R, H] (fp32, in place) = x * rsqrt(mean(x^2) + eps) * gamma; sq [R, H] and ss [R] scratch."""
    r, h = x.shape
    v = ctx.vec
    yield v.mul(sq, x, x)
    yield v.reduce_sum(ss, sq)
    yield v.muls(ss, ss, 1.0 / h)
    yield v.adds(ss, ss, eps)
    yield v.rsqrt(ss, ss)
    yield v.mul(x, x, ss.reshape(r, 1))
    yield v.mul(x, x, gamma)


def _rope_halves(ctx, out, x, sin, cos, rot):
    """out = x * cos + rotate_half(x) * sin, all fp32 [R, Dr] (the library's RoPE, kernels/rope.py)."""
    h = x.shape[-1] // 2
    v = ctx.vec
    yield v.neg(rot[:, :h], x[:, h:])
    yield v.copy(rot[:, h:], x[:, :h])
    yield v.mul(rot, rot, sin)
    yield v.mul(out, x, cos)
    yield v.add(out, out, rot)


def _dequant_rows(ctx, p, g, xf, raw, xs, col_scale, r0, rn):
    """ws rows -> fp32: int32 accumulators * per-token x scale * per-channel weight scale, or a plain copy."""
    if raw.dtype == np.int32:
        yield ctx.copy_gm_to_ub(xs[:rn], g.dequant_scale_x[r0:r0 + rn], pad=True)
        yield ctx.vec.dequant_int8(xf, raw, xs[:rn], col_scale)


def _norm_cq(ctx, p, g, r0, r1):
    ub = ctx.carve.reset()
    h = p.hcq
    ws = g.ws_cq
    ROWS = _rows_for(h * (12 + (4 if p.x_int8 else 0)))
    raw = ub.take((ROWS, h), ws.dtype, name="cq_in")
    xf = raw if ws.dtype == np.float32 else ub.take((ROWS, h), "fp32", name="cq_f32")
    sq = ub.take((ROWS, h), "fp32", name="cq_sq")
    ss = ub.take((_pad8(ROWS),), "fp32", name="cq_ss")
    gamma = ub.take((h,), "fp32", name="gamma_cq")
    stage = ub.take((h,), "bf16", name="gamma_bf16")
    yield from _load_fp32_row(ctx, gamma, g.rmsnorm_gamma_cq, stage)
    xs = wcol = smooth = None
    if p.x_int8:
        xs = ub.take((_pad8(ROWS),), "fp32", name="x_scale")
        wcol = ub.take((h,), "fp32", name="w_dq_scale")
        yield ctx.copy_gm_to_ub(wcol, g.dequant_scale_w_dq, pad=True)
    if p.q_int8:
        out = ub.take((ROWS, h), "int8", name="cq_i8")
        qs = ub.take((_pad8(ROWS),), "fp32", name="cq_scale")
        if p.smooth:
            smooth = ub.take((h,), "fp32", name="smooth")
            yield ctx.copy_gm_to_ub(smooth, g.smooth_scales_cq, pad=True)
    else:
        out = ub.take((ROWS, h), "bf16", name="cq_bf16")
    for r in range(r0, r1, ROWS):
        rn = min(ROWS, r1 - r)
        yield ctx.copy_gm_to_ub(raw[:rn], ws[r:r + rn])
        yield from _dequant_rows(ctx, p, g, xf[:rn], raw[:rn], xs, wcol, r, rn)
        yield from _rmsnorm(ctx, xf[:rn], sq[:rn], ss[:rn], gamma, p.eps_cq)
        if p.q_int8:
            yield ctx.vec.quant_int8(out[:rn], qs[:rn], xf[:rn], smooth)
            yield ctx.copy_ub_to_gm(g.ws_cqs[r:r + rn], qs[:rn], pad=True)
        else:
            yield ctx.vec.cast(out[:rn], xf[:rn])
        yield ctx.copy_ub_to_gm(g.ws_cqn[r:r + rn], out[:rn], pad=True)


def _kv_path(ctx, p, g, r0, r1):
    ub = ctx.carve.reset()
    hc, dr = p.hckv, p.dr
    ws = g.ws_kv
    R = _rows_for(hc * 14 + dr * 40)
    k_raw = ub.take((R, hc), ws.dtype, name="kc_in")
    kf = k_raw if ws.dtype == np.float32 else ub.take((R, hc), "fp32", name="kc_f32")
    r_raw = ub.take((R, dr), ws.dtype, name="kr_in")
    rf = r_raw if ws.dtype == np.float32 else ub.take((R, dr), "fp32", name="kr_f32")
    sq = ub.take((R, hc), "fp32", name="kc_sq")
    ss = ub.take((_pad8(R),), "fp32", name="kc_ss")
    gamma = ub.take((hc,), "fp32", name="gamma_ckv")
    stage = ub.take((hc,), "bf16", name="gamma_bf16")
    yield from _load_fp32_row(ctx, gamma, g.rmsnorm_gamma_ckv, stage)
    sin_b = ub.take((R, dr), "bf16", name="sin_bf16")
    cos_b = ub.take((R, dr), "bf16", name="cos_bf16")
    sin = ub.take((R, dr), "fp32", name="sin")
    cos = ub.take((R, dr), "fp32", name="cos")
    rot = ub.take((R, dr), "fp32", name="rot")
    ro = ub.take((R, dr), "fp32", name="kr_rot")
    kr_out = ub.take((R, dr), "bf16", name="kr_out")
    kv_out = ub.take((R, hc), "int8" if p.kv_cache_quant_mode else "bf16", name="kc_out")
    idx = ctx.index_tile
    xs = wk = wr = qsc = None
    if p.x_int8:
        xs = ub.take((_pad8(R),), "fp32", name="x_scale")
        wk = ub.take((hc,), "fp32", name="w_dkv_scale")
        wr = ub.take((dr,), "fp32", name="w_kr_scale")
        yield ctx.copy_gm_to_ub(wk, g.dequant_scale_w_dkv_kr[:hc], pad=True)
        yield ctx.copy_gm_to_ub(wr, g.dequant_scale_w_dkv_kr[hc:], pad=True)
    if p.kv_cache_quant_mode:
        qsc = ub.take((hc,), "fp32", name="quant_scale_ckv")
        yield ctx.copy_gm_to_ub(qsc, g.quant_scale_ckv, pad=True)
    for r in range(r0, r1, R):
        rn = min(R, r1 - r)
        yield ctx.copy_gm_to_ub(idx[:rn], g.cache_index[r:r + rn], pad=True)
        yield ctx.copy_gm_to_ub(k_raw[:rn], ws[r:r + rn, :hc], pad=True)
        yield ctx.copy_gm_to_ub(r_raw[:rn], ws[r:r + rn, hc:], pad=True)
        yield ctx.copy_gm_to_ub(sin_b[:rn], g.rope_sin[r:r + rn])
        yield ctx.copy_gm_to_ub(cos_b[:rn], g.rope_cos[r:r + rn])
        if p.x_int8:
            yield ctx.copy_gm_to_ub(xs[:rn], g.dequant_scale_x[r:r + rn], pad=True)
            yield ctx.vec.dequant_int8(kf[:rn], k_raw[:rn], xs[:rn], wk)
            yield ctx.vec.dequant_int8(rf[:rn], r_raw[:rn], xs[:rn], wr)
        yield from _rmsnorm(ctx, kf[:rn], sq[:rn], ss[:rn], gamma, p.eps_ckv)
        if p.kv_cache_quant_mode:
            yield ctx.vec.mul(kf[:rn], kf[:rn], qsc)
            yield ctx.vec.cast(kv_out[:rn], kf[:rn], "rint")          # saturating
        else:
            yield ctx.vec.cast(kv_out[:rn], kf[:rn])
        yield ctx.vec.cast(sin[:rn], sin_b[:rn])
        yield ctx.vec.cast(cos[:rn], cos_b[:rn])
        yield from _rope_halves(ctx, ro[:rn], rf[:rn], sin[:rn], cos[:rn], rot[:rn])
        yield ctx.vec.cast(kr_out[:rn], ro[:rn])
        yield from _scatter_cache(ctx, p, g, kv_out[:rn], kr_out[:rn], idx[:rn])


def _scatter_cache(ctx, p, g, kv_rows, kr_rows, idx):
    """Write rows to their ``cache_index`` slots: PA_BSND one row scatter per cache; PA_NZ one strided store
    per token and cache (the token's row is spread over the fractal columns of its block)."""
    if p.cache_mode == "PA_BSND":
        yield ctx.scatter_ub_to_gm(g.kv_rows, kv_rows, idx)
        yield ctx.scatter_ub_to_gm(g.kr_rows, kr_rows, idx)
        return
    kv, kr = g.kv_cache, g.kr_cache
    for i in range(kv_rows.shape[0]):
        slot = yield ctx.get_value(idx, i)
        blk, off = divmod(int(slot), p.block_size)
        n0 = kv.shape[-1]
        yield ctx.copy_ub_to_gm(kv[blk, 0, :, off, :], kv_rows[i].reshape(p.hckv // n0, n0))
        yield ctx.copy_ub_to_gm(kr[blk, 0, :, off, :], kr_rows[i].reshape(p.dr // 16, 16))


def _q_rope(ctx, p, g, h0, h1):
    """Heads [h0, h1): RoPE of the query rope part (and, int8, dequantise q_nope for mm3)."""
    ub = ctx.carve.reset()
    d, dr = p.d, p.dr
    R = min(_rows_for(p.d * 10 + p.dr * 30, ROWS_ROPE), p.t)
    ws4 = g.ws_q.reshape(p.t, p.n, p.dqr)
    sin_b = ub.take((R, dr), "bf16", name="sin_bf16")
    cos_b = ub.take((R, dr), "bf16", name="cos_bf16")
    sin = ub.take((R, dr), "fp32", name="sin")
    cos = ub.take((R, dr), "fp32", name="cos")
    raw = ub.take((R, dr), ws4.dtype, name="qr_in")
    rf = ub.take((R, dr), "fp32", name="qr_f32")
    rot = ub.take((R, dr), "fp32", name="rot")
    ro = ub.take((R, dr), "fp32", name="qr_rot")
    rb = ub.take((R, dr), "bf16", name="qr_out")
    if p.q_int8:
        qs = ub.take((_pad8(R),), "fp32", name="cq_scale")
        wsc = ub.take((dr,), "fp32", name="w_qr_scale")
        nraw = ub.take((R, d), "int32", name="qn_in")
        nf = ub.take((R, d), "fp32", name="qn_f32")
        nb = ub.take((R, d), "bf16", name="qn_out")
        nsc = ub.take((d,), "fp32", name="w_uq_scale")
        wscale = g.dequant_scale_w_uq_qr.reshape(p.n, p.dqr)
    for t0 in range(0, p.t, R):
        rn = min(R, p.t - t0)
        yield ctx.copy_gm_to_ub(sin_b[:rn], g.rope_sin[t0:t0 + rn])
        yield ctx.copy_gm_to_ub(cos_b[:rn], g.rope_cos[t0:t0 + rn])
        yield ctx.vec.cast(sin[:rn], sin_b[:rn])
        yield ctx.vec.cast(cos[:rn], cos_b[:rn])
        if p.q_int8:
            yield ctx.copy_gm_to_ub(qs[:rn], g.ws_cqs[t0:t0 + rn], pad=True)
        for h in range(h0, h1):
            yield ctx.copy_gm_to_ub(raw[:rn], ws4[t0:t0 + rn, h, d:])
            if p.q_int8:
                yield ctx.copy_gm_to_ub(wsc, wscale[h, d:], pad=True)
                yield ctx.vec.dequant_int8(rf[:rn], raw[:rn], qs[:rn], wsc)
            else:
                yield ctx.vec.cast(rf[:rn], raw[:rn])
            yield from _rope_halves(ctx, ro[:rn], rf[:rn], sin[:rn], cos[:rn], rot[:rn])
            yield ctx.vec.cast(rb[:rn], ro[:rn])
            yield ctx.copy_ub_to_gm(g.query_rope[t0:t0 + rn, h, :], rb[:rn])
            if p.q_int8:
                yield ctx.copy_gm_to_ub(nraw[:rn], ws4[t0:t0 + rn, h, :d])
                yield ctx.copy_gm_to_ub(nsc, wscale[h, :d], pad=True)
                yield ctx.vec.dequant_int8(nf[:rn], nraw[:rn], qs[:rn], nsc)
                yield ctx.vec.cast(nb[:rn], nf[:rn])
                yield ctx.copy_ub_to_gm(g.ws_qn[t0:t0 + rn, h, :], nb[:rn])


# ============================================================================================ host side
@dataclass
class MlaPrologResult:
    """torch_npu's npu_mla_prolog_v3 outputs plus the run. ``query`` [T, N, Hckv] bf16, ``query_rope``
    [T, N, Dr] bf16 (torch tensors; None in timing-only runs). ``dequant_scale_q_nope``, ``query_norm`` and
    ``dequant_scale_q_norm`` are always None here (query stays bf16; query_norm_flag is not supported).
    ``stage_runs``: the per-stage runs of a staged (non-fused) execution, else empty."""
    query: object
    query_rope: object
    dequant_scale_q_nope: object
    query_norm: object
    dequant_scale_q_norm: object
    run: RunResult
    stage_runs: list = field(default_factory=list)

    @property
    def kernel_us(self) -> float:
        """Modeled kernel time: the fused kernel, or the sum of the stages run one after the other."""
        if self.stage_runs:
            return sum(r.kernel_us for r in self.stage_runs)
        return self.run.kernel_us


STAGE_GROUPS = (frozenset({"mm1"}), frozenset({"norm", "kv"}), frozenset({"mm2"}), frozenset({"rope"}),
                frozenset({"mm3"}))


def _nd_shape(w, k: int, n: int, name: str):
    """Accept ND [K, N] or NZ (N1, K1, 16, N0); raise with the expected shapes otherwise."""
    shape = tuple(w.shape)
    nz = nz_shape((k, n), _np_dtype(w))
    if shape != (k, n) and shape != tuple(nz):
        raise ShapeError(f"{name} has shape {shape}; expected ND {(k, n)} or NZ {tuple(nz)}")


def _np_dtype(t):
    if hasattr(t, "store"):
        return t.dtype
    import torch
    return {torch.bfloat16: np.dtype(bf16), torch.int8: np.dtype(np.int8), torch.float32: np.dtype(np.float32),
            torch.float16: np.dtype(np.float16)}[t.dtype]


def _run_prolog(pod: Pod, die: int, p: PrologPlan, g: dict, numeric: bool, staged: bool, stream=None, after=()):
    """Allocate the workspaces and outputs, launch (or, given the caller's ``stream``, queue: returns a
    ``Pending``) and return the result."""
    ph = not numeric
    t = p.t
    acc = "int32" if p.x_int8 else "fp32"
    g["ws_cq"] = pod.alloc(die, (t, p.hcq), acc, phantom=ph, name="ws_cq")
    g["ws_kv"] = pod.alloc(die, (t, p.hckv + p.dr), acc, phantom=ph, name="ws_kv")
    g["ws_cqn"] = pod.alloc(die, (t, p.hcq), "int8" if p.q_int8 else "bf16", phantom=ph, name="ws_cqn")
    g["ws_cqs"] = pod.alloc(die, (t,), "fp32", phantom=ph, name="ws_cq_scale")
    g["ws_q"] = pod.alloc(die, (t, p.n * p.dqr), "int32" if p.q_int8 else "bf16", phantom=ph, name="ws_q")
    g["ws_qn"] = pod.alloc(die, (t, p.n, p.d), "bf16", phantom=ph, name="ws_qn")
    g["query"] = pod.alloc(die, (t, p.n, p.hckv), "bf16", phantom=ph, name="query")
    g["query_rope"] = pod.alloc(die, (t, p.n, p.dr), "bf16", phantom=ph, name="query_rope")
    if p.cache_mode == "PA_BSND":
        g["kv_rows"] = g["kv_cache"].reshape(-1, p.hckv)
        g["kr_rows"] = g["kr_cache"].reshape(-1, p.dr)
    def launch(args, name):
        if stream is not None:
            return stream.launch(mla_prolog_kernel, args, numeric=numeric, name=name, after=list(after))
        return pod.launch(mla_prolog_kernel, die=die, aic=p.aic, args=args, numeric=numeric, name=name)

    if staged:
        runs = [launch((p, PrologTensors(**g), st, False), f"mla_prolog[{'+'.join(sorted(st))}]")
                for st in STAGE_GROUPS]
        run = runs[-1]
    else:
        g["sync"] = pod.alloc(die, (24,), "int32", name="prolog_sync")     # control data: always real
        run = launch((p, PrologTensors(**g), frozenset(STAGES), True), "mla_prolog")
        runs = []

    def finish(run, runs):
        q = qr = None
        if numeric:
            q = _to_torch(g["query"].numpy())
            qr = _to_torch(g["query_rope"].numpy())
        return MlaPrologResult(q, qr, None, None, None, run, runs)
    if stream is not None:
        return Pending(runs or [run], lambda pod_run: finish(pod_run, []))
    return finish(run, runs)


def _to_torch(a: np.ndarray):
    import torch
    if a.dtype == np.dtype(bf16):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
               rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index, dequant_scale_x=None,
               dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None, dequant_scale_w_dkv_kr=None,
               quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None, rmsnorm_epsilon_cq=1e-5,
               rmsnorm_epsilon_ckv=1e-5, cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0,
               kv_cache_quant_mode=0, pod: Pod | None = None, die: int = 0, aic: int = 24,
               staged: bool = False, numeric: bool = True, stream=None, after=()) -> MlaPrologResult:
    """MLAProlog (torch_npu ``npu_mla_prolog_v3`` names and order) on one die, numeric mode (torch inputs).

    token_x [T, He] (or [B, S, He]) bf16, or int8 with ``dequant_scale_x`` [T, 1] fp32 (weight_quant_mode 2).
    weight_dq [He, Hcq], weight_uq_qr [Hcq, N*(D+Dr)], weight_dkv_kr [He, Hckv+Dr]: bf16, or int8 with per-channel
    ``dequant_scale_w_*`` [1, cols] fp32 (mode 1: weight_uq_qr only; mode 2: all three); ND or NZ
    (``ascend_emu.nd_to_nz``). Per head, weight_uq_qr columns are [D nope | Dr rope]; the rope columns (and the
    last Dr of weight_dkv_kr) are in the library's even/odd order (``kernels.rope``). weight_uk [N, D, Hckv] bf16.
    rmsnorm_gamma_cq [Hcq], rmsnorm_gamma_ckv [Hckv] bf16; rope_sin / rope_cos [T, Dr] bf16, cat(f, f).
    kv_cache: PA_BSND [blocks, block_size, 1, Hckv] (bf16; int8 with kv_cache_quant_mode 1 and
    ``quant_scale_ckv`` [Hckv] fp32: stored = rint(k_c * quant_scale_ckv) saturated); PA_NZ
    [blocks, 1, Hckv/N0, block_size, N0] (N0 = 16 bf16, 32 int8). kr_cache likewise with Dr, always bf16.
    cache_index [T] int: flat slot (block * block_size + offset) per token; no sentinel (every token is
    written). The caches are updated in place; every other slot stays bit-identical.
    ``smooth_scales_cq`` [Hcq] fp32: SmoothQuant factor applied before re-quantising c_q (modes 1, 2).

    Returns ``MlaPrologResult`` (query [T, N, Hckv], query_rope [T, N, Dr], ..., run). ``staged=True`` runs the
    five stages as separate launches (no overlap) for comparison. ``numeric=False``: timing only (the tensors may be
    meta tensors; cache_index stays real; outputs None). ``stream`` (a ``Stream`` on one die) / ``after``: queue on
    the caller's stream (its AICs) instead of running and return a ``kernels.ranks.Pending`` whose ``collect``
    gives the result; the caches, given as CPU tensors, are then GM aliases of them (``pod.to_gm(copy=False)``), so
    the kernel's cache writes land in them when it runs.
    """
    import torch
    if quant_scale_ckr is not None:
        raise ArgumentError("quant_scale_ckr: the rope cache stays bf16 here (int8 applies to kv_cache only)")
    if query_norm_flag:
        raise ArgumentError("query_norm_flag=True is not supported (query_norm is not produced)")
    x = token_x.reshape(-1, token_x.shape[-1])
    t, he = x.shape
    hcq = rmsnorm_gamma_cq.numel()
    hckv = rmsnorm_gamma_ckv.numel()
    n, d = weight_uk.shape[0], weight_uk.shape[1]
    dr = rope_sin.shape[-1]
    if kv_cache_quant_mode not in (0, 1):
        raise ArgumentError(f"kv_cache_quant_mode={kv_cache_quant_mode}: use 0 (bf16) or 1 (int8, per-channel "
                            f"quant_scale_ckv)")
    block_size = check_caches(kv_cache, kr_cache, hckv, dr, cache_mode, bool(kv_cache_quant_mode))
    p = PrologPlan(t, he, hcq, hckv, n, d, dr, block_size, cache_mode, weight_quant_mode, kv_cache_quant_mode,
                   float(rmsnorm_epsilon_cq), float(rmsnorm_epsilon_ckv), aic, smooth_scales_cq is not None)
    _check_plan(p)
    _nd_shape(weight_dq, he, hcq, "weight_dq")
    _nd_shape(weight_uq_qr, hcq, n * (d + dr), "weight_uq_qr")
    _nd_shape(weight_dkv_kr, he, hckv + dr, "weight_dkv_kr")
    if tuple(weight_uk.shape) != (n, d, hckv):
        raise ShapeError(f"weight_uk has shape {tuple(weight_uk.shape)}; expected (N, D, Hckv) = {(n, d, hckv)}")
    need = {"dequant_scale_x": (p.x_int8, dequant_scale_x), "dequant_scale_w_dq": (p.x_int8, dequant_scale_w_dq),
            "dequant_scale_w_dkv_kr": (p.x_int8, dequant_scale_w_dkv_kr),
            "dequant_scale_w_uq_qr": (p.q_int8, dequant_scale_w_uq_qr),
            "quant_scale_ckv": (bool(kv_cache_quant_mode), quant_scale_ckv)}
    for name, (required, v) in need.items():
        if required and v is None:
            raise ArgumentError(f"{name} is required with weight_quant_mode={weight_quant_mode}, "
                                f"kv_cache_quant_mode={kv_cache_quant_mode}")
    idx = torch.as_tensor(integer_array(cache_index, "cache_index")).reshape(-1)
    slots = kv_cache.shape[0] * block_size
    if idx.numel() != t or (t and (idx.min() < 0 or idx.max() >= slots)):
        raise ArgumentError(f"cache_index needs {t} slots in 0..{slots - 1}, got {idx.tolist()}")
    if stream is not None:
        pod, (die,), aic, _ = caller_streams(stream, 1, "aic", aic, "aic")
        if aic != p.aic:
            p = replace(p, aic=aic)
    pod = pod or Pod(cloudmatrix384(dies=1), trace=False)

    def gm(v, name, cache=False):
        if cache and numeric:       # queued: the kernel's writes land in the caller's tensor; else ``finish`` copies
            return pod.to_gm(die, v, name=name, copy=stream is None)     # them back once the run has succeeded
        return to_gm(pod, die, v, name, numeric)       # inputs the kernel only reads: aliased when they can be
    g = {"token_x": gm(x, "token_x"), "weight_dq": gm(weight_dq, "weight_dq"),
         "weight_uq_qr": gm(weight_uq_qr, "weight_uq_qr"), "weight_uk": gm(weight_uk, "weight_uk"),
         "weight_dkv_kr": gm(weight_dkv_kr, "weight_dkv_kr"),
         "rmsnorm_gamma_cq": gm(rmsnorm_gamma_cq.reshape(-1), "rmsnorm_gamma_cq"),
         "rmsnorm_gamma_ckv": gm(rmsnorm_gamma_ckv.reshape(-1), "rmsnorm_gamma_ckv"),
         "rope_sin": gm(rope_sin.reshape(t, dr), "rope_sin"), "rope_cos": gm(rope_cos.reshape(t, dr), "rope_cos"),
         "kv_cache": gm(kv_cache, "kv_cache", True), "kr_cache": gm(kr_cache, "kr_cache", True),
         "cache_index": pod.to_gm(die, idx.to(torch.int32), name="cache_index")}      # control data: always real
    for name, v in (("dequant_scale_x", dequant_scale_x), ("dequant_scale_w_dq", dequant_scale_w_dq),
                    ("dequant_scale_w_uq_qr", dequant_scale_w_uq_qr),
                    ("dequant_scale_w_dkv_kr", dequant_scale_w_dkv_kr), ("quant_scale_ckv", quant_scale_ckv),
                    ("smooth_scales_cq", smooth_scales_cq)):
        if v is not None:
            g[name] = gm(v.reshape(-1).float(), name)

    def finish(res):
        if numeric and stream is None:
            kv_cache.copy_(_to_torch(g["kv_cache"].numpy()).reshape(kv_cache.shape))     # in place, as on the NPU
            kr_cache.copy_(_to_torch(g["kr_cache"].numpy()).reshape(kr_cache.shape))
        if numeric and token_x.dim() == 3:
            b, s = token_x.shape[:2]
            res.query = res.query.reshape(b, s, n, hckv)
            res.query_rope = res.query_rope.reshape(b, s, n, dr)
        return res
    res = _run_prolog(pod, die, p, g, numeric, staged, stream, after)
    if stream is not None:
        return Pending(res.launches, lambda run: finish(res.collect(run)))
    return finish(res)


def mla_prolog_timing(tokens: int = 96, *, he: int = 7168, hcq: int = 1536, hckv: int = 512, n: int = 128,
                      d: int = 128, dr: int = 64, block_size: int = 128, cache_mode: str = "PA_NZ",
                      weight_quant_mode: int = 0, kv_cache_quant_mode: int = 0, nz: bool = True,
                      aic: int | None = None, staged: bool = False, pod: Pod | None = None, die: int = 0,
                      trace: bool = False, stream=None, after=()):
    """Timing-only MLAProlog at any shape (default: DeepSeek-V3, one decode step of ``tokens`` tokens): GM is
    phantom except the control data (cache_index, sync counters). ``aic``: AICs (default 24). ``stream`` (a
    ``Stream`` on one die) / ``after``: queue on the caller's stream (its AICs) instead of running, and return a
    ``kernels.ranks.Pending``."""
    if stream is not None:
        pod, (die,), aic, _ = caller_streams(stream, 1, "aic", aic, "aic")
    aic = 24 if aic is None else aic
    p = PrologPlan(tokens, he, hcq, hckv, n, d, dr, block_size, cache_mode, weight_quant_mode,
                   kv_cache_quant_mode, 1e-6, 1e-6, aic, False)
    _check_plan(p)
    pod = pod or Pod(cloudmatrix384(dies=1), trace=trace)
    xdt = "int8" if p.x_int8 else "bf16"
    qdt = "int8" if p.q_int8 else "bf16"
    kvdt = "int8" if kv_cache_quant_mode else "bf16"

    def w(k, cols, dt, name):
        shape = nz_shape((k, cols), np.dtype(np.int8) if dt == "int8" else np.dtype(bf16)) if nz else (k, cols)
        return pod.alloc(die, shape, dt, phantom=True, name=name)

    blocks = -(-tokens // block_size) + 1
    kv_shape, kr_shape = cache_shapes(blocks, block_size, hckv, dr, cache_mode, bool(kv_cache_quant_mode))
    kv = pod.alloc(die, kv_shape, kvdt, phantom=True, name="kv_cache")
    kr = pod.alloc(die, kr_shape, "bf16", phantom=True, name="kr_cache")
    g = {"token_x": pod.alloc(die, (tokens, he), xdt, phantom=True, name="token_x"),
         "weight_dq": w(he, hcq, xdt, "weight_dq"), "weight_uq_qr": w(hcq, n * (d + dr), qdt, "weight_uq_qr"),
         "weight_dkv_kr": w(he, hckv + dr, xdt, "weight_dkv_kr"),
         "weight_uk": pod.alloc(die, (n, d, hckv), "bf16", phantom=True, name="weight_uk"),
         "rmsnorm_gamma_cq": pod.alloc(die, (hcq,), "bf16", phantom=True),
         "rmsnorm_gamma_ckv": pod.alloc(die, (hckv,), "bf16", phantom=True),
         "rope_sin": pod.alloc(die, (tokens, dr), "bf16", phantom=True),
         "rope_cos": pod.alloc(die, (tokens, dr), "bf16", phantom=True),
         "kv_cache": kv, "kr_cache": kr,
         "cache_index": pod.to_gm(die, np.arange(tokens, dtype=np.int32), name="cache_index"),
         "dequant_scale_x": pod.alloc(die, (tokens,), "fp32", phantom=True),
         "dequant_scale_w_dq": pod.alloc(die, (hcq,), "fp32", phantom=True),
         "dequant_scale_w_dkv_kr": pod.alloc(die, (hckv + dr,), "fp32", phantom=True),
         "dequant_scale_w_uq_qr": pod.alloc(die, (n * (d + dr),), "fp32", phantom=True),
         "quant_scale_ckv": pod.alloc(die, (hckv,), "fp32", phantom=True)}
    return _run_prolog(pod, die, p, g, False, staged, stream, after)


def prolog_flops(p_or_shape) -> float:
    """Cube FLOPs of one prolog: 2 * T * (He*(Hcq + Hckv + Dr) + Hcq*N*(D+Dr) + N*D*Hckv)."""
    t, he, hcq, hckv, n, d, dr = p_or_shape
    return 2.0 * t * (he * (hcq + hckv + dr) + hcq * n * (d + dr) + n * d * hckv)


# ============================================================================================ references
def prolog_weights_from_deepseek(wq_a, wq_b, wkv_a, wkv_b, n_heads: int, d_nope: int, d_rope: int,
                                 d_v: int | None = None) -> dict:
    """DeepSeek-V3 ``nn.Linear`` weights ([out, in]) -> npu_mla_prolog weights ([in, out], rope columns in the
    library's even/odd order, ``kernels.rope``): weight_dq, weight_uq_qr, weight_dkv_kr, weight_uk [N, D, Hckv]."""
    from .rope import deinterleave_rope_columns
    hckv = wkv_b.shape[1]
    d_v = d_nope if d_v is None else d_v
    return {"weight_dq": wq_a.t().contiguous(),
            "weight_uq_qr": deinterleave_rope_columns(wq_b.t(), d_nope + d_rope, d_rope).contiguous(),
            "weight_dkv_kr": deinterleave_rope_columns(wkv_a.t(), hckv + d_rope, d_rope).contiguous(),
            "weight_uk": wkv_b.reshape(n_heads, d_nope + d_v, hckv)[:, :d_nope].contiguous()}


def deepseek_mla_reference(x, wq_a, q_norm_w, wq_b, wkv_a, kv_norm_w, wkv_b, theta, n_heads: int, d_nope: int,
                           d_rope: int, eps: float = 1e-6, dtype=None) -> dict:
    """DeepSeek-V3 ``inference/model.py`` MLA, absorb mode, prolog part, in ``dtype`` (torch.bfloat16 = the
    model's own precision, torch.float32 / float64 = the accuracy yardstick). Linear weights are [out, in].

    Returns q_absorbed [T, N, Hckv] (q_nope . W_uk per head), q_pe [T, N, Dr] and k_pe [T, Dr] (interleaved-pair
    RoPE by ``theta`` [T, Dr/2]), kv [T, Hckv] (the normalised latent written to the cache); all fp32."""
    import torch
    dt = dtype or torch.float32
    hckv = kv_norm_w.numel()

    def lin(a, w):
        return (a.to(dt) @ w.to(dt).t()).to(dt)

    def norm(a, w):
        af = a.float() if dt != torch.float64 else a
        r = af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)
        return (r * w.to(r.dtype)).to(dt)

    def rope(a):
        from .rope import rope_interleaved
        th = theta.reshape(theta.shape[0], *([1] * (a.dim() - 2)), theta.shape[-1])
        if dt == torch.float64:
            ac = torch.view_as_complex(a.reshape(*a.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(ac * torch.polar(torch.ones_like(th), th)).flatten(-2)
        return rope_interleaved(a, th).to(dt)

    t = x.shape[0]
    q = lin(norm(lin(x, wq_a), q_norm_w), wq_b).reshape(t, n_heads, d_nope + d_rope)
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]
    kv = lin(x, wkv_a)
    kv_c, k_pe = kv[:, :hckv], kv[:, hckv:]
    w_uk = wkv_b.reshape(n_heads, -1, hckv)[:, :d_nope].to(dt)
    q_abs = torch.einsum("thd,hdc->thc", q_nope, w_uk).to(dt)
    return {"q_absorbed": q_abs.float(), "q_pe": rope(q_pe).float(), "kv": norm(kv_c, kv_norm_w).float(),
            "k_pe": rope(k_pe).float()}


def mla_prolog_reference(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                         rmsnorm_gamma_ckv, rope_sin, rope_cos, *, dequant_scale_x=None, dequant_scale_w_dq=None,
                         dequant_scale_w_uq_qr=None, dequant_scale_w_dkv_kr=None, quant_scale_ckv=None,
                         smooth_scales_cq=None, rmsnorm_epsilon_cq=1e-5, rmsnorm_epsilon_ckv=1e-5,
                         weight_quant_mode=0, kv_cache_quant_mode=0) -> dict:
    """fp32 torch model of the kernel's algorithm in every quant mode (ND weights, library RoPE order): exact
    integer GEMMs, dequant, RMSNorm, per-token int8 re-quantisation of c_q, RoPE by halves. Returns query,
    query_rope [T, N, *] fp32, kv rows [T, Hckv] (int8 values when kv_cache_quant_mode=1) and kr rows [T, Dr]."""
    import torch
    from .rope import rope_rotate_half
    x = token_x.reshape(-1, token_x.shape[-1])
    t = x.shape[0]
    n, d, hckv = weight_uk.shape
    dr = rope_sin.shape[-1]

    def mm(a, w):
        if a.dtype == torch.int8:
            return (a.double() @ w.double()).float()
        return a.float() @ w.float()

    def norm(a, w, eps):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    cq = mm(x, weight_dq)
    kv = mm(x, weight_dkv_kr)
    if weight_quant_mode == 2:
        sx = dequant_scale_x.reshape(-1, 1).float()
        cq = cq * sx * dequant_scale_w_dq.reshape(1, -1).float()
        kv = kv * sx * dequant_scale_w_dkv_kr.reshape(1, -1).float()
    cq = norm(cq, rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
    if weight_quant_mode in (1, 2):
        c = cq * smooth_scales_cq.reshape(1, -1).float() if smooth_scales_cq is not None else cq
        s = c.abs().amax(-1, keepdim=True) / 127
        cq8 = torch.round(c / torch.where(s == 0, torch.ones_like(s), s)).clamp(-128, 127).to(torch.int8)
        q = mm(cq8, weight_uq_qr) * s * dequant_scale_w_uq_qr.reshape(1, -1).float()
    else:
        q = mm(cq.to(torch.bfloat16), weight_uq_qr)
    q = q.to(torch.bfloat16).float().reshape(t, n, d + dr) if weight_quant_mode == 0 else q.reshape(t, n, d + dr)
    q_nope = q[..., :d].to(torch.bfloat16).float()
    query = torch.einsum("thd,hdc->thc", q_nope, weight_uk.float())
    sin, cos = rope_sin.reshape(t, 1, dr), rope_cos.reshape(t, 1, dr)
    query_rope = rope_rotate_half(q[..., d:], sin, cos)
    kc = norm(kv[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    if kv_cache_quant_mode:
        kc = torch.round(kc * quant_scale_ckv.reshape(1, -1).float()).clamp(-128, 127)
    kr = rope_rotate_half(kv[:, hckv:], rope_sin.reshape(t, dr), rope_cos.reshape(t, dr))
    return {"query": query, "query_rope": query_rope, "kv": kc, "kr": kr}
