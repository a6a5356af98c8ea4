"""Decode attention over the MLA latent cache against a naive fp32 softmax reference.

Tolerance (bf16): the kernel rounds P to bf16 for the P.V matmul (relative 2^-9 per weight) and the output to bf16
once (2^-9 of |o|); both are bounded by 2^-9 max|v|, so |o - o_ref| <= 2^-8 max|v| plus fp32 noise. Tests allow
2^-7 max|v| (2x margin). Naive- and absorb-mode references (fp64 vs fp32) agree to 1e-4 relative.

INT8 latent cache (k8 = rint(k / d) per channel, d = key_antiquant_scale, |k8| <= 127): the kernel dequantises each
tile to bf16(k8 * d) and then runs the bf16 path, so
- bitwise: attention(int8 cache, d) == attention(bf16 cache holding bf16(k8 * d)) (same tiles, same math order);
- vs the fp32 reference on the dequantised cache k8 * d: the bf16 bound above, 2^-7 max|v| (the extra rounding of
  k8 * d to bf16 is 2^-9 relative, inside the margin);
- vs the unquantised latent k (total error): every cache element is off by at most eps_c = d_c / 2 (rounding) +
  2^-9 * 127 d_c (bf16 of the dequantised value). The output moves by at most max eps (V) plus
  (e^(2 Delta) - 1) max|k| (softmax weights; Delta = softmax_scale * max over rows of sum_c |q_c| eps_c bounds the
  score change, and each weight changes by a factor within e^(+-2 Delta)), plus the kernel's 2^-7 max|v|. That worst
  case is loose (it adds |q_c| eps_c with one sign); the tight check is against a same-precision baseline: the
  kernel's total error may exceed the fp32 reference's own quantisation error (reference on k8 * d vs on k) by at
  most the bf16 bound 2^-7 max|v|.
- PA_NZ vs PA_BSND: the L0 tiles hold the same values in the same order, so outputs are bitwise equal.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import ArgumentError, ShapeError
from kernels.mla import mla_prolog
from kernels.attention import (attention_reference, attention_reference_naive, gather_pages, mla_decode_attention,
                               mla_decode_attention_timing, plan_units)
from tests.kernels.test_mla_prolog import from_nz_cache, make_model, to_nz_cache

HYP = settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SCALE = 0.135234


def make_case(seed, lens, s, n, hckv, dr, bs):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    maxb = max(-(-L // bs) for L in lens)
    nblocks = batch * maxb + 3
    bt = torch.randperm(nblocks, generator=g)[:batch * maxb].reshape(batch, maxb).int()
    q = torch.randn(batch, s, n, hckv, generator=g).bfloat16()
    qr = torch.randn(batch, s, n, dr, generator=g).bfloat16()
    kv = torch.randn(nblocks, bs, 1, hckv, generator=g).bfloat16()
    kr = torch.randn(nblocks, bs, 1, dr, generator=g).bfloat16()
    return q, qr, kv, kr, bt


@HYP
@given(seed=st.integers(0, 2 ** 16), lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
       s=st.integers(1, 4), n=st.sampled_from([2, 4]), hckv=st.sampled_from([64, 128]), dr=st.sampled_from([16, 32]),
       bs=st.sampled_from([16, 128]), tiling=st.sampled_from(["balanced", "batch"]), aic=st.sampled_from([1, 3, 4]))
def test_attention_matches_naive_softmax(seed, lens, s, n, hckv, dr, bs, tiling, aic):
    lens = [max(L, s) for L in lens]
    q, qr, kv, kr, bt = make_case(seed, lens, s, n, hckv, dr, bs)
    res = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, tiling=tiling, aic=aic)
    ref = attention_reference(q, qr, kv, kr, bt, lens, SCALE)
    vmax = kv.float().abs().max().item()
    err = (res.attention_out.float() - ref).abs().max().item()
    assert err <= 2 ** -7 * vmax, (err, vmax)
    assert res.attention_out.shape == q.shape


def poison_unused_slots(cache, bt, lens, value):
    """Every PA_BSND cache slot past each sequence's length in its pages, and every page no sequence uses, set to
    ``value``: what a reused page or a stale write leaves behind."""
    out = torch.full_like(cache, value)
    bs = cache.shape[1]
    for b, L in enumerate(lens):
        for i in range(-(-L // bs)):
            n = min(bs, L - i * bs)
            out[bt[b, i], :n] = cache[bt[b, i], :n]
    return out


@settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), s=st.integers(1, 3),
       bs=st.sampled_from([16, 64]), value=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       cache_mode=st.sampled_from(["PA_BSND", "PA_NZ"]), tiling=st.sampled_from(["balanced", "batch"]))
def test_unused_cache_slots_never_contribute_whatever_they_hold(seed, lens, s, bs, value, cache_mode, tiling):
    """Before: the slots of a sequence's last page past its length were read as the cube's 16-row padding,
    weighted 0, and multiplied in: one NaN or inf there made the whole output NaN."""
    lens = [max(L, s) for L in lens]
    q, qr, kv, kr, bt = make_case(seed, lens, s, 2, 64, 16, bs)
    kv_bad, kr_bad = poison_unused_slots(kv, bt, lens, value), poison_unused_slots(kr, bt, lens, value)
    if cache_mode == "PA_NZ":
        kv_in, kr_in = to_nz_cache(kv_bad), to_nz_cache(kr_bad)
    else:
        kv_in, kr_in = kv_bad, kr_bad
    got = mla_decode_attention(q, qr, kv_in, kr_in, bt, lens, softmax_scale=SCALE, cache_mode=cache_mode,
                               tiling=tiling, aic=3).attention_out
    clean = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, tiling=tiling, aic=3).attention_out
    assert torch.isfinite(got.float()).all()
    assert torch.equal(bits(got), bits(clean))               # the unused slots change nothing at all
    ref = attention_reference(q, qr, kv_bad, kr_bad, bt, lens, SCALE)
    assert (got.float() - ref).abs().max().item() <= 2 ** -7 * kv.float().abs().max().item()


def test_mtp_causal_offsets_are_applied():
    """S=3 queries of a sequence see L-2, L-1, L tokens: each output differs, and equals a reference that
    is given only the visible prefix."""
    lens = [150, 40]
    q, qr, kv, kr, bt = make_case(1, lens, 3, 2, 64, 16, 16)
    out = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, aic=2).attention_out.float()
    for b, L in enumerate(lens):
        for s in range(3):
            one = attention_reference(q[b:b + 1, s:s + 1], qr[b:b + 1, s:s + 1], kv, kr, bt[b:b + 1],
                                      [L - 2 + s], SCALE)
            assert (out[b, s] - one[0, 0]).abs().max().item() <= 2 ** -7 * kv.float().abs().max().item()


def test_naive_and_absorb_references_agree():
    g = torch.Generator().manual_seed(2)
    s, n, d, dv, hckv, dr, L = 2, 3, 32, 32, 64, 16, 70
    w_uk = torch.randn(n, d, hckv, generator=g) * hckv ** -0.5
    w_uv = torch.randn(n, dv, hckv, generator=g) * hckv ** -0.5
    q_nope = torch.randn(s, n, d, generator=g)
    q_pe = torch.randn(s, n, dr, generator=g)
    kv_c = torch.randn(L, hckv, generator=g)
    k_pe = torch.randn(L, dr, generator=g)
    naive = attention_reference_naive(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, SCALE, s)
    bs = 16
    blocks = -(-L // bs)
    kv = torch.zeros(blocks * bs, hckv)
    kv[:L] = kv_c
    kr = torch.zeros(blocks * bs, dr)
    kr[:L] = k_pe
    q_abs = torch.einsum("snd,ndc->snc", q_nope, w_uk)
    o = attention_reference(q_abs[None], q_pe[None], kv.reshape(blocks, bs, 1, hckv), kr.reshape(blocks, bs, 1, dr),
                            torch.arange(blocks)[None], [L], SCALE)[0]
    absorbed = torch.einsum("snc,nvc->snv", o.double(), w_uv.double())
    assert ((absorbed - naive).abs().max() / naive.abs().max()).item() < 1e-4
    assert torch.equal(gather_pages(kv.reshape(blocks, bs, 1, hckv), torch.arange(blocks)[None], L, 0), kv_c)


def test_balanced_tiling_beats_batch_tiling_on_ragged_mtp():
    lens = [900, 40, 60, 30, 500, 20]
    q, qr, kv, kr, bt = make_case(4, lens, 3, 4, 64, 16, 16)
    runs = {t: mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, tiling=t, aic=4)
            for t in ("balanced", "batch")}
    a, b = runs["balanced"].attention_out, runs["batch"].attention_out
    assert (a.float() - b.float()).abs().max().item() <= 2 ** -7 * kv.float().abs().max().item()
    assert runs["balanced"].run.kernel_us < 0.75 * runs["batch"].run.kernel_us, \
        (runs["balanced"].run.kernel_us, runs["batch"].run.kernel_us)


def test_plan_covers_every_kv_token_once():
    lens = [1000, 7, 300, 129]
    for tiling in ("balanced", "batch"):
        units, n_items, _ = plan_units(lens, 2, 128, 5, tiling)
        seen = {}
        for core in units:
            for u in core:
                seen.setdefault((u.b, u.r0), []).append((u.k0, u.k1))
        assert len(seen) == n_items == 4 * 2
        for (b, _), ranges in seen.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == lens[b]
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))


def test_attention_errors_name_the_argument():
    q, qr, kv, kr, bt = make_case(0, [20], 1, 2, 64, 16, 16)
    with pytest.raises(ShapeError, match="actual_seq_lengths_kv"):
        mla_decode_attention(q, qr, kv, kr, bt, [20, 20], softmax_scale=SCALE)
    with pytest.raises(ShapeError, match="actual_seq_lengths_kv"):
        mla_decode_attention(q, qr, kv, kr, bt, [999], softmax_scale=SCALE)
    with pytest.raises(ArgumentError, match="tiling"):
        mla_decode_attention(q, qr, kv, kr, bt, [20], softmax_scale=SCALE, tiling="heads")


def quantize_cache(kv):
    """Per-channel int8 of a bf16 latent cache: k8 = rint(k / d), d = max|k_c| / 127 (key_antiquant_scale)."""
    d = kv.float().abs().amax((0, 1, 2)) / 127
    return torch.round(kv.float() / d).clamp(-127, 127).to(torch.int8), d


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("cache_mode", ["PA_BSND", "PA_NZ"])
def test_int8_cache_is_the_bf16_path_on_dequantised_values(cache_mode):
    lens = [150, 40, 300]
    q, qr, kv, kr, bt = make_case(1, lens, 2, 4, 128, 32, 16)
    k8, d = quantize_cache(kv)
    kv_bar = (k8.float() * d).bfloat16()
    nz = (lambda c: to_nz_cache(c)) if cache_mode == "PA_NZ" else (lambda c: c)
    got = mla_decode_attention(q, qr, nz(k8), nz(kr), bt, lens, softmax_scale=SCALE, key_antiquant_scale=d,
                               cache_mode=cache_mode, aic=3).attention_out
    same = mla_decode_attention(q, qr, kv_bar, kr, bt, lens, softmax_scale=SCALE, aic=3).attention_out
    assert torch.equal(bits(got), bits(same))
    ref = attention_reference(q, qr, k8, kr, bt, lens, SCALE, kv_dequant_scale=d)
    vmax = (k8.float() * d).abs().max().item()
    assert (got.float() - ref).abs().max().item() <= 2 ** -7 * vmax
    # a wrong scale (one channel's scale off by 2x) is caught
    d_bad = d.clone()
    d_bad[5] *= 2
    bad = mla_decode_attention(q, qr, k8, kr, bt, lens, softmax_scale=SCALE, key_antiquant_scale=d_bad, aic=3)
    assert (bad.attention_out.float() - ref).abs().max().item() > 2 ** -7 * vmax


def test_int8_cache_error_against_the_unquantised_latent():
    lens = [260, 33, 128]
    q, qr, kv, kr, bt = make_case(7, lens, 2, 4, 128, 32, 16)
    k8, d = quantize_cache(kv)
    got = mla_decode_attention(q, qr, k8, kr, bt, lens, softmax_scale=SCALE, key_antiquant_scale=d,
                               aic=4).attention_out.float()
    true = attention_reference(q, qr, kv, kr, bt, lens, SCALE)
    quant_only = attention_reference(q, qr, k8, kr, bt, lens, SCALE, kv_dequant_scale=d)
    kmax = kv.float().abs().max().item()
    err = (got - true).abs().max().item()
    base = (quant_only - true).abs().max().item()
    assert err <= base + 2 ** -7 * kmax, (err, base)          # tight: no more than bf16 noise on top of int8's own
    eps = d / 2 + 2 ** -9 * 127 * d                            # per channel
    delta = SCALE * (q.float().abs() * eps).sum(-1).max().item()
    bound = eps.max().item() + (torch.exp(torch.tensor(2 * delta)).item() - 1) * kmax + 2 ** -7 * kmax
    assert base <= err <= bound, (err, bound)
    assert (kv.float() - k8.float() * d).abs().max().item() <= d.max().item() / 2 + 1e-7


HYP_NZ = settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@HYP_NZ
@given(seed=st.integers(0, 2 ** 16), lens=st.lists(st.integers(1, 300), min_size=1, max_size=3),
       s=st.integers(1, 3), bs=st.sampled_from([16, 64, 128]), int8=st.booleans(),
       tiling=st.sampled_from(["balanced", "batch"]))
def test_pa_nz_cache_gives_bitwise_the_bsnd_output(seed, lens, s, bs, int8, tiling):
    lens = [max(L, s) for L in lens]
    q, qr, kv, kr, bt = make_case(seed, lens, s, 2, 128, 32, bs)
    kw = {}
    if int8:
        kv, kw["key_antiquant_scale"] = quantize_cache(kv)
    a = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, tiling=tiling, aic=3, **kw)
    b = mla_decode_attention(q, qr, to_nz_cache(kv), to_nz_cache(kr), bt, lens, softmax_scale=SCALE, tiling=tiling,
                             cache_mode="PA_NZ", aic=3, **kw)
    assert torch.equal(bits(a.attention_out), bits(b.attention_out))


def test_prolog_int8_nz_cache_feeds_attention():
    """mla_prolog writes an int8 PA_NZ latent cache (quant_scale_ckv); attention reads it with
    key_antiquant_scale = 1 / quant_scale_ckv, bitwise as from the same cache in PA_BSND, and within the bf16
    bound of the fp32 reference on the dequantised cache."""
    t, he, hcq, hckv, n, d, dr, bs = 12, 256, 128, 128, 2, 32, 32, 16
    m = make_model(21, t, he, hcq, hckv, n, d, dr)
    kv = to_nz_cache(torch.zeros(2, bs, 1, hckv, dtype=torch.int8))
    kr = to_nz_cache(torch.zeros(2, bs, 1, dr).bfloat16())
    qscale = torch.full((hckv,), 40.0)
    res = mla_prolog(m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                     m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=torch.arange(t), cache_mode="PA_NZ",
                     kv_cache_quant_mode=1, quant_scale_ckv=qscale, aic=2)
    lens = [t]
    q = res.query.reshape(1, t, n, hckv)[:, -2:]                # the last 2 tokens query the 12 cached ones
    qr = res.query_rope.reshape(1, t, n, dr)[:, -2:]
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    deq = 1 / qscale
    got = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, key_antiquant_scale=deq,
                               cache_mode="PA_NZ", aic=2).attention_out
    kv_nd, kr_nd = from_nz_cache(kv, bs, hckv), from_nz_cache(kr, bs, dr)
    nd = mla_decode_attention(q, qr, kv_nd, kr_nd, bt, lens, softmax_scale=SCALE, key_antiquant_scale=deq,
                              aic=2).attention_out
    assert torch.equal(bits(got), bits(nd))
    ref = attention_reference(q, qr, kv_nd, kr_nd, bt, lens, SCALE, kv_dequant_scale=deq)
    vmax = (kv_nd.float() * deq).abs().max().item()
    assert kv_nd.reshape(-1, hckv)[:t].abs().max().item() > 0      # the prolog did write the slots
    assert (got.float() - ref).abs().max().item() <= 2 ** -7 * vmax


def test_int8_cache_moves_fewer_bytes_at_little_cost():
    """Timing-only, 16 sequences x 1K, V3 head shapes: the int8 cache halves the latent's bytes, read from HBM once;
    the cube-side dequant costs cube/fixpipe time but no GM traffic. At this size the kernel is not HBM-bound (the
    L2 serves its workspace round trips), so the saving does not show in time and the dequant costs little."""
    runs = {i: mla_decode_attention_timing(16, 1024, heads=128, kv_int8=i, aic=24).run for i in (False, True)}
    saved = runs[False].bytes_moved - runs[True].bytes_moved
    # one byte per latent element, less each AIC's one-off reads of the identity (64x64 int8) and the scales
    assert saved == 16 * 1024 * 512 - 24 * (64 * 64 + 512 * 4)
    assert runs[False].hbm_bytes() - runs[True].hbm_bytes() >= 0.9 * 16 * 1024 * 512
    assert runs[True].kernel_us <= 1.02 * runs[False].kernel_us, (runs[True].kernel_us, runs[False].kernel_us)


def test_int8_and_layout_errors_name_the_argument():
    q, qr, kv, kr, bt = make_case(0, [20], 1, 2, 64, 16, 16)
    k8, d = quantize_cache(kv)
    with pytest.raises(ArgumentError, match="key_antiquant_scale"):
        mla_decode_attention(q, qr, k8, kr, bt, [20], softmax_scale=SCALE)
    with pytest.raises(ArgumentError, match="key_antiquant_scale"):
        mla_decode_attention(q, qr, kv, kr, bt, [20], softmax_scale=SCALE, key_antiquant_scale=d)
    with pytest.raises(ArgumentError, match="key_antiquant_mode"):
        mla_decode_attention(q, qr, k8, kr, bt, [20], softmax_scale=SCALE, key_antiquant_scale=d,
                             key_antiquant_mode=1)
    with pytest.raises(ShapeError, match="key_antiquant_scale"):
        mla_decode_attention(q, qr, k8, kr, bt, [20], softmax_scale=SCALE, key_antiquant_scale=d[:32])
    with pytest.raises(ArgumentError, match="cache_mode"):
        mla_decode_attention(q, qr, kv, kr, bt, [20], softmax_scale=SCALE, cache_mode="PA_BNSD")
    with pytest.raises(ShapeError, match="kv_cache"):                 # a BSND cache passed as PA_NZ
        mla_decode_attention(q, qr, kv, kr, bt, [20], softmax_scale=SCALE, cache_mode="PA_NZ")
    with pytest.raises(ShapeError, match="kr_cache"):
        mla_decode_attention(q, qr, to_nz_cache(kv), kr, bt, [20], softmax_scale=SCALE, cache_mode="PA_NZ")
    q2, qr2, kv2, kr2, bt2 = make_case(0, [20], 1, 2, 96, 16, 16)  # Hckv 96: not a multiple of the dequant chunk
    k82, d2 = quantize_cache(kv2)
    with pytest.raises(ShapeError, match="Hckv"):
        mla_decode_attention(q2, qr2, k82, kr2, bt2, [20], softmax_scale=SCALE, key_antiquant_scale=d2)


@pytest.mark.slow
def test_v3_decode_attention_timing_only():
    """96 x 4K: the latent cache (453 MB, over twice the L2) is read from HBM once; the cube <-> vector workspace
    round trips stay in the L2."""
    from kernels.attention import attention_bytes
    r = mla_decode_attention_timing(96, 4096, heads=128)
    need = attention_bytes([4096] * 96, 1, 128, 512, 64)
    assert r.run.hbm_bytes() <= 1.2 * need
    assert r.run.servers["l2.0"]["bytes"] > 2 * need


@pytest.mark.parametrize("b,s,n,hckv,dr,lens", [(3, 1, 4, 64, 16, [5, 20, 33]), (2, 3, 8, 512, 64, [130, 300]),
                                                  (1, 6, 4, 64, 16, [6])])
def test_flash_reference_is_the_batch_tiled_kernel_bit_for_bit(b, s, n, hckv, dr, lens):
    """attention_flash_reference replays the kernel's algorithm (kv steps of 128 padded to 16 rows, bf16
    probabilities, fp32 online softmax): with tiling="batch" the outputs are identical, bit for bit."""
    from kernels.attention import attention_flash_reference
    g = torch.Generator().manual_seed(sum(lens))
    bs = 16
    nb = sum(-(-L // bs) for L in lens) + 2
    kv = torch.randn(nb, bs, 1, hckv, generator=g).to(torch.bfloat16)
    kr = torch.randn(nb, bs, 1, dr, generator=g).to(torch.bfloat16)
    bt = torch.zeros(b, max(-(-L // bs) for L in lens), dtype=torch.int32)
    nxt = 0
    for i, L in enumerate(lens):
        k = -(-L // bs)
        bt[i, :k] = torch.arange(nxt, nxt + k)
        nxt += k
    q = torch.randn(b, s, n, hckv, generator=g).to(torch.bfloat16)
    qr = torch.randn(b, s, n, dr, generator=g).to(torch.bfloat16)
    got = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=0.1, tiling="batch").attention_out
    assert torch.equal(bits(got), bits(attention_flash_reference(q, qr, kv, kr, bt, lens, 0.1)))


def test_mtp_row_tiles_of_a_sequence_run_side_by_side():
    """S x N = 2 x 128 rows: two row tiles per sequence. With an even AIC count, AICs 2v and 2v + 1 take the same
    (sequence, kv range) pieces in the same order, one row tile each; with an odd count the plan shares the (row tile,
    kv tile) pairs directly. Either way every row tile sees every kv token once."""
    lens = [1000, 7, 300, 129]
    units, n_items, _ = plan_units(lens, 2, 128, 4)
    for lane in range(2):
        left, right = units[2 * lane], units[2 * lane + 1]
        assert [(u.b, u.k0, u.k1) for u in left] == [(u.b, u.k0, u.k1) for u in right]
        assert {u.r0 for u in left} == {0} and {u.r0 for u in right} == {128}
    for aic in (4, 5):
        units, n_items, _ = plan_units(lens, 2, 128, aic)
        seen: dict = {}
        for core in units:
            for u in core:
                seen.setdefault((u.b, u.r0), []).append((u.k0, u.k1))
        assert len(seen) == n_items == 8
        for (b, _), ranges in seen.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == lens[b]
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("aic", [2, 4])
def test_mtp_side_by_side_row_tiles_match_the_reference(aic):
    lens = [300, 90, 2]
    q, qr, kv, kr, bt = make_case(11, lens, 2, 128, 64, 16, 16)
    res = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=SCALE, aic=aic)
    ref = attention_reference(q, qr, kv, kr, bt, lens, SCALE)
    vmax = kv.float().abs().max().item()
    err = (res.attention_out.float() - ref).abs().max().item()
    assert err <= 2 ** -7 * vmax, (err, vmax)


def test_mtp_reads_each_kv_byte_from_hbm_about_once():
    """16 x 4K, MTP 1 (S x N = 256 rows, two row tiles per sequence) on a die whose L2 is cut to 48 MiB (the cache is
    75 MB): the hbm0 server's bytes against the compulsory bytes. Before, a sequence's two row tiles read its cache
    at different times and the second read missed the L2 (2.04x); side by side, the second read hits it."""
    import dataclasses

    from ascend_emu import Pod, cloudmatrix384
    from kernels.attention import attention_bytes
    prof = dataclasses.replace(cloudmatrix384(dies=1), l2_bytes=48 << 20)
    r = mla_decode_attention_timing(16, 4096, heads=128, mtp=1, pod=Pod(prof, trace=False))
    need = attention_bytes([4096] * 16, 2, 128, 512, 64)
    assert r.run.servers["hbm0"]["bytes"] <= 1.2 * need, r.run.servers["hbm0"]["bytes"] / need
    assert r.run.servers["l2.0"]["bytes"] > 2 * need            # the row tiles still each read the tile (L2 hits)
