"""Decode attention over the MLA latent cache against a naive fp32 softmax reference.

Tolerance (bf16): the kernel rounds P to bf16 for the P.V matmul (relative 2^-9 per weight) and the output to bf16
once (2^-9 of |o|); both are bounded by 2^-9 max|v|, so |o - o_ref| <= 2^-8 max|v| plus fp32 noise. Tests allow
2^-7 max|v| (2x margin). Naive- and absorb-mode references (fp64 vs fp32) agree to 1e-4 relative.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import ArgumentError, ShapeError
from kernels.attention import (attention_reference, attention_reference_naive, gather_pages, mla_decode_attention,
                               mla_decode_attention_timing, plan_units)

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


@pytest.mark.slow
def test_v3_decode_attention_timing_only():
    r = mla_decode_attention_timing(96, 4096, heads=128)
    assert r.run.servers["hbm0"]["utilization"] > 0.8
