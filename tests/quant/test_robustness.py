"""Robustness sweep over quant's public entry points (per-token and per-channel INT8, the W8A8 GEMM, SmoothQuant
scales, GPTQ, clip search, KV-cache INT8): dtypes, ranks, sizes that do not match, NaN/inf, non-contiguous inputs.

The only allowed outcomes: a ``QuantError`` naming an argument the case made invalid, or a result equal to an
independent numpy reference of the documented math (bitwise). Each case runs in a child process
(``tests.isolation``): a crash or a hang fails the case, not the run.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.isolation import check, child  # noqa: F401 (child: the module's worker fixture)

SWEEP = settings(max_examples=10, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
SPECIAL = (None, float("nan"), float("inf"), -float("inf"))
F32 = np.float32


def _x(shape, dtype, seed, noncontig, special, scale=3.0):
    import torch
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, generator=g) * scale).to(getattr(torch, dtype))
    if special is not None and t.numel():
        t.view(-1)[t.numel() // 2] = special
    return t.t().contiguous().t() if noncontig and t.ndim == 2 else t


def _rne_q(v, scale, lo, hi):
    return np.clip(np.rint(v / np.where(scale == 0, F32(1), scale)[:, None]), lo, hi).astype(np.int8)


# ---------------------------------------------------------------------------------------------- activations, GEMM
def w8a8_case(t, k, n, dtype, noncontig, special, where, smooth_kind, wrong_k, seed):
    import torch
    from quant import channel_scales, quantize_per_token, quantize_weight_rtn, w8a8_matmul
    x = _x((t, k), dtype, seed, noncontig, special if where == "x" else None)
    w = _x((n, k + wrong_k), "float32", seed + 1, False, special if where == "w" else None, 0.1)
    smooth = None if smooth_kind is None else (torch.rand(k if smooth_kind == "ok" else k + 1) + 0.5)
    q, scale = quantize_per_token(x, smooth)
    v = x.float().numpy() * (smooth.numpy() if smooth is not None else F32(1))
    rs = (np.abs(v).max(1) / F32(127)).astype(F32) if t else np.zeros(0, F32)
    assert np.array_equal(scale.numpy(), rs) and np.array_equal(q.numpy(), _rne_q(v, rs, -128, 127))
    ws = channel_scales(w)
    amax = np.abs(w.double().numpy()).max(1)
    rws = np.where(amax > 0, (amax / 127).astype(F32), F32(1))
    assert np.array_equal(ws.numpy(), rws)
    qw = quantize_weight_rtn(w, ws)
    assert np.array_equal(qw.numpy(), np.clip(np.rint(w.double().numpy() / rws[:, None].astype(np.float64)), -127,
                                               127).astype(np.int8))
    y = w8a8_matmul(x, qw, ws, smooth)
    acc = q.numpy().astype(np.int64) @ qw.numpy().astype(np.int64).T
    assert np.array_equal(y.numpy(), (acc.astype(F32) * rs[:, None]) * rws[None, :])
    _ = torch


@SWEEP
@given(t=st.integers(0, 12), k=st.sampled_from([1, 16, 33]), n=st.integers(1, 9),
       dtype=st.sampled_from(["float32", "bfloat16", "float16", "int32"]), noncontig=st.booleans(),
       special=st.sampled_from(SPECIAL), where=st.sampled_from(["x", "w"]),
       smooth_kind=st.sampled_from([None, "ok", "wrong_size"]), wrong_k=st.sampled_from([0, 0, 1]),
       seed=st.integers(0, 2 ** 16))
def test_per_token_per_channel_and_w8a8(child, t, k, n, dtype, noncontig, special, where, smooth_kind, wrong_k,
                                        seed):
    names = []
    if dtype == "int32":
        names.append("x is torch.int32")
        special = special if where == "w" else None
    if special is not None and (where == "w" or t):
        names.append("x" if where == "x" else "w")
    if smooth_kind == "wrong_size":
        names.append("smooth")
    if wrong_k:
        names.append("qweight")
    check(child, w8a8_case, t, k, n, dtype, noncontig, special, where, smooth_kind, wrong_k, seed,
          names=tuple(names))


def test_int8_gemm_is_exact_whatever_the_strides():
    """Before: a [N, 1] weight's transpose counted as contiguous with a stride torch's CPU _int_mm misreads, so K = 1
    gave garbage ([[127]] @ [[-127, -127]] came out as [1, 84])."""
    import torch
    from quant import int8_gemm
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 1, 2), (3, 1, 5), (1, 5, 1), (4, 7, 3)):
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        for x in (a, a.t().contiguous().t()):
            assert torch.equal(int8_gemm(x, b).long(), a.long() @ b.long().t())


@settings(max_examples=20, deadline=None, database=None, derandomize=True)
@given(m=st.integers(1, 9), n=st.integers(1, 9), chunks=st.integers(0, 3), extra=st.integers(0, 5),
       extreme=st.booleans())
def test_int8_gemm_is_exact_across_its_fp32_k_chunks(m, n, chunks, extra, extreme):
    """K spans several of the fp32 chunks (each exact below 2^24) and ends mid-chunk. The extreme operands (all -128
    but one odd product) reach the largest sums a chunk can hold: a longer chunk's sum would pass 2^24 with an odd
    part and round in fp32. Compared with an int64 product (no overflow at these K)."""
    import torch
    from quant import int8_gemm
    from quant.int8 import EXACT_F32_K
    k = chunks * EXACT_F32_K + extra
    g = torch.Generator().manual_seed(m * 100 + n * 10 + k)
    if extreme:
        a = torch.full((m, k), -128, dtype=torch.int8)
        b = torch.full((n, k), -128, dtype=torch.int8)
        a[:, k - 1:], b[:, k - 1:] = 127, 127
    else:
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    got = int8_gemm(a, b)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got.long(), a.long() @ b.long().t())


# ---------------------------------------------------------------------------------------------- SmoothQuant scales
def smooth_case(k, alpha, absmax_special, w_special, negative, seed):
    import torch
    from quant import smooth_scales
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(k, generator=g) * 10
    a[0] = 0.0
    if absmax_special is not None:
        a[-1] = absmax_special
    if negative:
        a[1 % k] = -1.0
    ws = [torch.randn(4, k, generator=g), torch.randn(2, k, generator=g)]
    if w_special is not None:
        ws[1][0, -1] = w_special
    s = smooth_scales(a, ws, alpha)
    an = a.double().numpy()
    wmax = np.maximum(np.abs(ws[0].double().numpy()).max(0), np.abs(ws[1].double().numpy()).max(0))
    ok = (an > 0) & (wmax > 0)
    ref = np.ones(k)
    ref[ok] = an[ok] ** alpha / wmax[ok] ** (1 - alpha)
    assert np.array_equal(s.numpy(), np.clip(ref, 1e-5, 1e5).astype(F32))


@SWEEP
@given(k=st.integers(1, 20), alpha=st.sampled_from([0.0, 0.5, 0.85, 1.0, -0.1, 1.5]),
       absmax_special=st.sampled_from(SPECIAL), w_special=st.sampled_from(SPECIAL), negative=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_smooth_scales(child, k, alpha, absmax_special, w_special, negative, seed):
    names = []
    if not 0 <= alpha <= 1:
        names.append("alpha")
    if absmax_special is not None or (negative and k > 1):
        names.append("act_absmax")
    if w_special is not None:
        names.append("weights[1]")
    check(child, smooth_case, k, alpha, absmax_special, w_special, negative, seed, names=tuple(names))


# ---------------------------------------------------------------------------------------------- GPTQ, clip search
def gptq_case(n, k, dead, special, where, act_order, seed):
    import torch
    from quant import channel_scales, gptq_quantize, quantize_weight_rtn, search_clip
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    d = torch.rand(k, generator=g) + 0.1
    d[:dead] = 0.0                                        # input channels no calibration token touched
    h = torch.diag(d).double()
    if special is not None:
        (w if where == "w" else h)[0, 0] = special
    res = gptq_quantize(w, h, act_order=act_order, block_size=4)
    # a diagonal Hessian couples no columns: GPTQ is round-to-nearest, bit for bit
    assert torch.equal(res.qweight, quantize_weight_rtn(w, channel_scales(w))) and res.dead_columns == dead
    scale, factors = search_clip(w, h.float(), block_rows=2)
    assert set(factors.tolist()) <= {float(np.float32(c)) for c in (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75)}
    assert torch.equal(scale, channel_scales(w, factors.repeat_interleave(2)[:n]))


@SWEEP
@given(n=st.integers(1, 6), k=st.integers(1, 12), dead=st.integers(0, 3), special=st.sampled_from(SPECIAL),
       where=st.sampled_from(["w", "hessian"]), act_order=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_gptq_and_clip_search(child, n, k, dead, special, where, act_order, seed):
    dead = min(dead, k)
    names = (where,) if special is not None else ()
    check(child, gptq_case, n, k, dead, special, where, act_order, seed, names=names)


# ---------------------------------------------------------------------------------------------- KV-cache INT8
def kv_case(shape, rope_dim, mode, special, scale_kind, seed):
    import torch
    from quant import quantize_kv, quantize_per_token
    kv = _x(shape, "float32", seed, False, special)
    c = max(1, shape[-1] - (rope_dim if isinstance(rope_dim, int) else 0))
    qs = None if scale_kind is None else torch.full((c if scale_kind == "ok" else c + 1,), 5.0)
    if scale_kind == "zero":
        qs = torch.zeros(c)
    lat, rope = quantize_kv(kv, rope_dim, mode, qs)
    latent = kv[..., :c]
    assert torch.equal(rope, kv[..., c:].to(torch.bfloat16))
    if mode == "token":
        q, s = quantize_per_token(latent.reshape(-1, c))
        assert torch.equal(lat.q, q.reshape(latent.shape)) and torch.equal(lat.scale, s.reshape(latent.shape[:-1]))
    else:
        m = qs.numpy() if qs is not None else np.where(np.abs(latent.numpy()).reshape(-1, c).max(0) > 0,
                                                       F32(127) / np.abs(latent.numpy()).reshape(-1, c).max(0), 1)
        ref = np.clip(np.rint(latent.numpy() * m.astype(F32)), -128, 127).astype(np.int8)
        assert np.array_equal(lat.q.numpy(), ref)


@SWEEP
@given(shape=st.sampled_from([(4, 24), (2, 3, 40), (1, 16), (5, 8)]), rope_dim=st.sampled_from([0, 8, 1.5, 40]),
       mode=st.sampled_from(["token", "channel", "block"]), special=st.sampled_from(SPECIAL),
       scale_kind=st.sampled_from([None, "ok", "wrong_size", "zero"]), seed=st.integers(0, 2 ** 16))
def test_kv_cache_int8(child, shape, rope_dim, mode, special, scale_kind, seed):
    names = []                                   # every invalid argument: the error may name any of them
    if not isinstance(rope_dim, int) or not 0 <= rope_dim < shape[-1]:
        names.append("rope_dim")
    if mode not in ("token", "channel"):
        names.append("mode")
    if special is not None:
        names += ["kv", "latent", "calib_latent"]
    if mode == "channel" and scale_kind in ("wrong_size", "zero"):
        names.append("quant_scale")
    if mode != "channel":
        scale_kind = None
    check(child, kv_case, shape, rope_dim, mode, special, scale_kind, seed, names=tuple(names))
