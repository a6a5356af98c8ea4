"""The worked examples behind ``ascend-emu demo`` and the issue-2 ``ascend-emu model`` ops.

1. ``quantize_rows``: double-buffered GM -> UB load, per-row dynamic INT8 quantisation, store, over all 48 AIVs.
2. ``int8_gemm``: a MIX kernel. Each AIC walks its output tiles: A and B tiles GM -> L1 (MTE2), L1 -> L0A/L0B (MTE1),
   int8 mmad accumulating over K in L0C, fixpipe the int32 tile to a GM workspace, then a cross-core flag to its two
   AIVs, which dequantise their half of the tile (per-token x per-channel scale) to bf16 and store it.

Each runner checks the numbers against a torch reference and returns a dict of figures.
"""
from __future__ import annotations

import numpy as np

from .kernel import kernel
from .pod import Pod
from .profile import cloudmatrix384


# ------------------------------------------------------------------------------------------- 1. quantize rows
@kernel(cores="aiv")
def quantize_rows(ctx, x_gm, y_gm, scale_gm, rows_per_core: int, tile_rows: int):
    """x_gm [T, H] bf16 -> y_gm [T, H] int8, scale_gm [T] fp32; core b owns rows [b*rows_per_core, ...)."""
    h = x_gm.shape[1]
    r_tile = tile_rows
    x_t = ctx.ub.alloc((2, r_tile, h), "bf16", name="x")      # two slots: load i+1 while quantising i
    y_t = ctx.ub.alloc((2, r_tile, h), "int8", name="y")
    s_pad = -(-r_tile // 8) * 8                                # each slot must start 32-byte aligned
    s_t = ctx.ub.alloc((2, s_pad), "fp32", name="scale")
    lo = ctx.block_idx * rows_per_core
    for i, r in enumerate(range(lo, lo + rows_per_core, r_tile)):
        k = i % 2
        yield ctx.copy_gm_to_ub(x_t[k], x_gm[r:r + r_tile])
        yield ctx.vec.quant_int8(y_t[k], s_t[k, :r_tile], x_t[k])
        yield ctx.copy_ub_to_gm(y_gm[r:r + r_tile], y_t[k])
        yield ctx.copy_ub_to_gm(scale_gm[r:r + r_tile], s_t[k, :r_tile], pad=True)   # 4 B per row: DataCopyPad


def quantize_reference(x):
    """torch reference: scale = rowmax|x| / 127 (fp32), q = round-half-even(x / scale) saturated."""
    import torch
    xf = x.float()
    s = xf.abs().amax(-1) / 127
    q = torch.round(xf / torch.where(s == 0, torch.ones_like(s), s)[:, None]).clamp(-128, 127).to(torch.int8)
    return q, s


def run_quantize(tokens: int = 48 * 64, hidden: int = 1024, cores: int = 48, tile_rows: int = 8,
                 numeric: bool = True, seed: int = 0, pod: Pod | None = None, trace: bool = True) -> dict:
    if tokens % (cores * tile_rows):
        raise ValueError(f"tokens={tokens} must be a multiple of cores x tile_rows = {cores * tile_rows}")
    pod = pod or Pod(cloudmatrix384(dies=1), trace=trace)
    if numeric:
        import torch
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(tokens, hidden, generator=g) * 3).to(torch.bfloat16)
        x_gm = pod.to_gm(0, x, name="x")
    else:
        x_gm = pod.alloc(0, (tokens, hidden), "bf16", phantom=True, name="x")
    y_gm = pod.alloc(0, (tokens, hidden), "int8", phantom=not numeric, name="y")
    s_gm = pod.alloc(0, (tokens,), "fp32", phantom=not numeric, name="scale")
    run = pod.launch(quantize_rows, die=0, aiv=cores, args=(x_gm, y_gm, s_gm, tokens // cores, tile_rows),
                     numeric=numeric)
    out = {"run": run, "tokens": tokens, "hidden": hidden, "cores": cores}
    if numeric:
        q_ref, s_ref = quantize_reference(x)
        out["q_mismatches"] = int((y_gm.numpy() != q_ref.numpy()).sum())
        out["max_abs_err"] = float(np.abs(s_gm.numpy() - s_ref.numpy()).max()) + out["q_mismatches"]
    return out


# ------------------------------------------------------------------------------------------- 2. int8 GEMM (MIX)
BASE_M, BASE_N, BASE_K = 128, 128, 128   # L0A/L0B tiles 16 KiB each (x2 slots), L0C 64 KiB per slot


@kernel(cores="mix")
def int8_gemm(ctx, a_gm, b_gm, tok_scale_gm, ch_scale_gm, ws_gm, c_gm):
    """a [M, K] int8 @ b [K, N] int8 -> int32 (AIC) -> * tok_scale[M] * ch_scale[N] -> c [M, N] bf16 (AIV)."""
    m, k = a_gm.shape
    n = b_gm.shape[1]
    tiles_n = n // BASE_N
    tiles = [t for t in range((m // BASE_M) * tiles_n) if t % ctx.block_num == ctx.group_idx]
    if ctx.is_aic:
        a_l1 = ctx.l1.alloc((2, BASE_M, BASE_K), "int8", name="a_l1")
        b_l1 = ctx.l1.alloc((2, BASE_K, BASE_N), "int8", name="b_l1")
        a_l0 = ctx.l0a.alloc((2, BASE_M, BASE_K), "int8", name="a_l0")
        b_l0 = ctx.l0b.alloc((2, BASE_K, BASE_N), "int8", name="b_l0")
        c_l0 = ctx.l0c.alloc((2, BASE_M, BASE_N), "int32", name="acc")
        step = 0
        for j, t in enumerate(tiles):
            m0, n0 = (t // tiles_n) * BASE_M, (t % tiles_n) * BASE_N
            acc = c_l0[j % 2]
            for kk in range(k // BASE_K):
                s = step % 2
                step += 1
                k0 = kk * BASE_K
                yield ctx.copy_gm_to_l1(a_l1[s], a_gm[m0:m0 + BASE_M, k0:k0 + BASE_K])
                yield ctx.copy_gm_to_l1(b_l1[s], b_gm[k0:k0 + BASE_K, n0:n0 + BASE_N])
                yield ctx.copy_l1_to_l0a(a_l0[s], a_l1[s])
                yield ctx.copy_l1_to_l0b(b_l0[s], b_l1[s])
                yield ctx.mmad(acc, a_l0[s], b_l0[s], accumulate=kk > 0)
            yield ctx.copy_l0c_to_gm(ws_gm[t], acc)
            yield ctx.cross_core_set(0)          # fires once the fixpipe write is visible
    else:
        half = BASE_M // 2
        q_t = ctx.ub.alloc((half, BASE_N), "int32", name="acc")
        f_t = ctx.ub.alloc((half, BASE_N), "fp32", name="deq")
        o_t = ctx.ub.alloc((half, BASE_N), "bf16", name="out")
        ts_t = ctx.ub.alloc((half,), "fp32", name="tok_scale")
        cs_t = ctx.ub.alloc((BASE_N,), "fp32", name="ch_scale")
        for t in tiles:
            m0, n0 = (t // tiles_n) * BASE_M, (t % tiles_n) * BASE_N
            r0 = ctx.sub_block_idx * half
            yield ctx.cross_core_wait(0)
            yield ctx.copy_gm_to_ub(q_t, ws_gm[t, r0:r0 + half])
            yield ctx.copy_gm_to_ub(ts_t, tok_scale_gm[m0 + r0:m0 + r0 + half])
            yield ctx.copy_gm_to_ub(cs_t, ch_scale_gm[n0:n0 + BASE_N])
            yield ctx.vec.dequant_int8(f_t, q_t, ts_t, cs_t)
            yield ctx.vec.cast(o_t, f_t)
            yield ctx.copy_ub_to_gm(c_gm[m0 + r0:m0 + r0 + half, n0:n0 + BASE_N], o_t)


def gemm_reference(a, b, tok_scale, ch_scale):
    """torch reference: exact int32 accumulation, then fp32 (acc * tok_scale) * ch_scale, RNE to bf16."""
    import torch
    acc = (a.to(torch.int64) @ b.to(torch.int64))
    if acc.abs().max() >= 2 ** 24:
        raise ValueError("accumulators beyond 2^24 do not convert to fp32 exactly; use a smaller K")
    return ((acc.to(torch.float32) * tok_scale[:, None]) * ch_scale[None, :]).to(torch.bfloat16), acc


def run_gemm(m: int = 256, n: int = 512, k: int = 512, aic: int = 8, numeric: bool = True, seed: int = 0,
             pod: Pod | None = None, trace: bool = True) -> dict:
    for name, v, base in (("m", m, BASE_M), ("n", n, BASE_N), ("k", k, BASE_K)):
        if v % base:
            raise ValueError(f"{name}={v} must be a multiple of the {base} tile")
    pod = pod or Pod(cloudmatrix384(dies=1), trace=trace)
    tiles = (m // BASE_M) * (n // BASE_N)
    if numeric:
        import torch
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8)
        ts = torch.rand(m, generator=g) * 0.02 + 1e-3
        cs = torch.rand(n, generator=g) * 0.02 + 1e-3
        a_gm, b_gm = pod.to_gm(0, a, name="a"), pod.to_gm(0, b, name="b")
        ts_gm, cs_gm = pod.to_gm(0, ts, name="tok_scale"), pod.to_gm(0, cs, name="ch_scale")
    else:
        a_gm = pod.alloc(0, (m, k), "int8", phantom=True, name="a")
        b_gm = pod.alloc(0, (k, n), "int8", phantom=True, name="b")
        ts_gm = pod.alloc(0, (m,), "fp32", phantom=True, name="tok_scale")
        cs_gm = pod.alloc(0, (n,), "fp32", phantom=True, name="ch_scale")
    ws_gm = pod.alloc(0, (tiles, BASE_M, BASE_N), "int32", phantom=not numeric, name="workspace")
    c_gm = pod.alloc(0, (m, n), "bf16", phantom=not numeric, name="c")
    run = pod.launch(int8_gemm, die=0, aic=min(aic, tiles), args=(a_gm, b_gm, ts_gm, cs_gm, ws_gm, c_gm),
                     numeric=numeric)
    out = {"run": run, "m": m, "n": n, "k": k, "aic": min(aic, tiles)}
    if numeric:
        ref, acc = gemm_reference(a, b, ts, cs)
        got = c_gm.numpy().astype(np.float32)
        out["max_abs_err"] = float(np.abs(got - ref.float().numpy()).max())
        ws = ws_gm.numpy()
        acc_np = acc.numpy()
        tn = n // BASE_N
        out["int32_exact"] = all(
            np.array_equal(ws[t], acc_np[(t // tn) * BASE_M:(t // tn + 1) * BASE_M,
                                         (t % tn) * BASE_N:(t % tn + 1) * BASE_N]) for t in range(tiles))
    ops = 2.0 * m * n * k
    out["cube_utilization"] = ops / (run.kernel_us * 1e-6) / (pod.profile.peak_cube_tflops("int8") * 1e12)
    return out


# ------------------------------------------------------------------------------------------- 3. bandwidth copy
@kernel(cores="aiv")
def stream_copy(ctx, src_gm, dst_gm, chunk_rows: int):
    """src_gm [rows, W] -> dst_gm (any die) through UB, ping-pong; core b copies rows b, b + n, b + 2n, ..."""
    rows, w = src_gm.shape
    t = ctx.ub.alloc((2, chunk_rows, w), src_gm.dtype, name="stage")
    mine = range(ctx.block_idx * chunk_rows, rows, ctx.block_num * chunk_rows)
    for i, r in enumerate(mine):
        k = i % 2
        yield ctx.copy_gm_to_ub(t[k], src_gm[r:r + chunk_rows])
        yield ctx.copy_ub_to_gm(dst_gm[r:r + chunk_rows], t[k])


def copy_roofline_gbps(pod: Pod, cores: int, src_die: int, dst_die: int) -> float:
    """The bound (GB/s of payload) of a copy of cold GM data (every source byte misses the L2; the copy's
    destination stays in the L2): the tightest of the source die's HBM, the L2s, the cores' movers at their
    per-source rates, and across dies the fabric port and the outstanding-bytes limit of the writing cores."""
    prof = pod.profile
    clk = prof.clock_ghz
    bounds = [prof.hbm_gbps, cores * prof.hbm_read_bytes_per_cycle * clk, cores * prof.ub_to_l2_bytes_per_cycle * clk]
    if dst_die == src_die:
        bounds.append(prof.l2_gbps / 2)           # each byte is read from and written into one L2
    else:
        route = pod.engine.paths.path("MTE3", src_die, None, dst_die)
        bounds += [prof.l2_gbps, min(s.bw for s in route.links) * 1000, cores * route.remote_rate * 1000]
    return min(bounds)


def run_copy(nbytes: int, cores: int = 48, dst_die: int = 0, src_die: int = 0, chunk_bytes: int = 64 * 1024,
             trace: bool = False, pod: Pod | None = None) -> dict:
    """Timing-only copy of ``nbytes`` from ``src_die`` to ``dst_die`` by ``cores`` AIVs of ``src_die``."""
    width = 4096                                  # bytes per row (uint8)
    chunk_rows = max(1, chunk_bytes // width)
    rows = -(-nbytes // width)
    rows = -(-rows // (chunk_rows * cores)) * chunk_rows * cores
    pod = pod or Pod(cloudmatrix384(dies=max(dst_die, src_die) + 1), trace=trace)
    src = pod.alloc(src_die, (rows, width), "uint8", phantom=True, name="src")
    dst = pod.alloc(dst_die, (rows, width), "uint8", phantom=True, name="dst")
    run = pod.launch(stream_copy, die=src_die, aiv=cores, args=(src, dst, chunk_rows), numeric=False)
    moved = rows * width
    peak = copy_roofline_gbps(pod, cores, src_die, dst_die)
    gbps = moved / (run.kernel_us * 1e3)
    return {"op": "copy", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us, "bytes_moved": run.bytes_moved,
            "payload_bytes": moved, "achieved_gbps": gbps, "peak_gbps": peak,
            "utilization": min(1.0, gbps / peak), "run": run}
