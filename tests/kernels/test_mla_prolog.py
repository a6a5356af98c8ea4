"""mla_prolog (npu_mla_prolog_v3) against DeepSeek-V3's absorb-mode MLA and against an fp32 model of its int8 modes.

Tolerances:
- bf16 mode: judged against an fp64 DeepSeek-V3 reference (interleaved RoPE, compared after the library's even/odd
  de-interleave, kernels/rope.py). The kernel's max error on each output must be within 2x the error of DeepSeek's
  own bf16 computation (same reference run in bf16) plus 2^-8 of the output's max magnitude (one bf16 ulp at the
  top of the range: both round their outputs to bf16 once).
- int8 modes: against ``mla_prolog_reference`` (same quantisation algorithm in fp32): max error <= 2^-6 x max|ref|
  (bf16 outputs and c_q rounding differences that flip an int8 step of c_q now and then).
- Untouched cache slots: bitwise.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import ArgumentError, DTypeError, Pod, ShapeError, cloudmatrix384, nd_to_nz, nz_to_nd
from kernels.mla import (deepseek_mla_reference, mla_prolog, mla_prolog_reference, mla_prolog_timing,
                         prolog_weights_from_deepseek)
from kernels.rope import deinterleave, rope_angles, rope_sin_cos

HYP = settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def make_model(seed, t, he, hcq, hckv, n, d, dr):
    g = torch.Generator().manual_seed(seed)

    def r(*s, sc=1.0):
        return torch.randn(*s, generator=g) * sc
    m = {"x": r(t, he).bfloat16(), "wq_a": r(hcq, he, sc=he ** -0.5).bfloat16(),
         "wq_b": r(n * (d + dr), hcq, sc=hcq ** -0.5).bfloat16(),
         "wkv_a": r(hckv + dr, he, sc=he ** -0.5).bfloat16(), "wkv_b": r(n * 2 * d, hckv, sc=hckv ** -0.5).bfloat16(),
         "q_norm": (1 + 0.1 * r(hcq)).bfloat16(), "kv_norm": (1 + 0.1 * r(hckv)).bfloat16()}
    m["theta"] = rope_angles(torch.arange(t) * 7 + 3, dr)
    m["sin"], m["cos"] = rope_sin_cos(m["theta"])
    m.update(prolog_weights_from_deepseek(m["wq_a"], m["wq_b"], m["wkv_a"], m["wkv_b"], n, d, dr))
    return m


def to_nz_cache(c):
    """[blocks, bs, 1, H] -> PA_NZ [blocks, 1, H/N0, bs, N0]."""
    nz = torch.from_numpy(nd_to_nz(c[:, :, 0].view(torch.int16).numpy() if c.dtype == torch.bfloat16
                                   else c[:, :, 0].numpy()))
    nz = nz.view(torch.bfloat16) if c.dtype == torch.bfloat16 else nz
    blocks, bs, _, h = c.shape
    n0 = nz.shape[-1]
    return nz.reshape(blocks, 1, h // n0, bs, n0).contiguous()     # (N1, M1, 16, N0) with M1 x 16 = block_size


def from_nz_cache(nz, bs, h):
    blocks, n0 = nz.shape[0], nz.shape[-1]
    nz = nz.reshape(blocks, h // n0, bs // 16, 16, n0)
    a = nz.view(torch.int16).numpy() if nz.dtype == torch.bfloat16 else nz.numpy()
    nd = torch.from_numpy(nz_to_nd(a, (nz.shape[0], bs, h)))
    return (nd.view(torch.bfloat16) if nz.dtype == torch.bfloat16 else nd).unsqueeze(2)


def weight_nz(w):
    return torch.from_numpy(nd_to_nz(w.view(torch.int16).numpy())).view(torch.bfloat16) if w.dtype == torch.bfloat16 \
        else torch.from_numpy(nd_to_nz(w.numpy()))


def maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


@HYP
@given(seed=st.integers(0, 2 ** 16), t=st.integers(4, 16), he=st.sampled_from([256, 384, 512]),
       hcq=st.sampled_from([128, 256, 384]), hckv=st.sampled_from([64, 128]), n=st.sampled_from([2, 3, 4]),
       d=st.sampled_from([32, 64]), dr=st.sampled_from([16, 32]), bs=st.sampled_from([16, 32]),
       mode=st.sampled_from(["PA_BSND", "PA_NZ"]), nz=st.booleans(), aic=st.sampled_from([1, 2, 3]))
def test_prolog_matches_deepseek_absorb_mla(seed, t, he, hcq, hckv, n, d, dr, bs, mode, nz, aic):
    m = make_model(seed, t, he, hcq, hckv, n, d, dr)
    blocks = -(-t // bs) + 2
    g = torch.Generator().manual_seed(seed + 1)
    kv0 = torch.randn(blocks, bs, 1, hckv, generator=g).bfloat16()
    kr0 = torch.randn(blocks, bs, 1, dr, generator=g).bfloat16()
    idx = torch.randperm(blocks * bs, generator=g)[:t]
    kv = to_nz_cache(kv0) if mode == "PA_NZ" else kv0.clone()
    kr = to_nz_cache(kr0) if mode == "PA_NZ" else kr0.clone()
    w = {k: (weight_nz(m[k]) if nz else m[k]) for k in ("weight_dq", "weight_uq_qr", "weight_dkv_kr")}
    res = mla_prolog(m["x"], w["weight_dq"], w["weight_uq_qr"], m["weight_uk"], w["weight_dkv_kr"], m["q_norm"],
                     m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=idx, rmsnorm_epsilon_cq=1e-6,
                     rmsnorm_epsilon_ckv=1e-6, cache_mode=mode, aic=aic)
    if mode == "PA_NZ":
        kv, kr = from_nz_cache(kv, bs, hckv), from_nz_cache(kr, bs, dr)
    args = (m["x"], m["wq_a"], m["q_norm"], m["wq_b"], m["wkv_a"], m["kv_norm"], m["wkv_b"], m["theta"], n, d, dr,
            1e-6)
    exact = deepseek_mla_reference(*args, dtype=torch.float64)
    model = deepseek_mla_reference(*args, dtype=torch.bfloat16)
    got = {"q_absorbed": res.query, "q_pe": res.query_rope, "kv": kv.reshape(-1, hckv)[idx],
           "k_pe": kr.reshape(-1, dr)[idx]}
    for name in got:
        ref, bf = exact[name], model[name]
        if name in ("q_pe", "k_pe"):
            ref, bf = deinterleave(ref), deinterleave(bf)
        tol = 2 * maxerr(bf, ref) + ref.abs().max().item() * 2 ** -8
        assert maxerr(got[name], ref) <= tol, (name, maxerr(got[name], ref), tol)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(kv.reshape(-1, hckv)[untouched].view(torch.int16),
                       kv0.reshape(-1, hckv)[untouched].view(torch.int16))
    assert torch.equal(kr.reshape(-1, dr)[untouched].view(torch.int16),
                       kr0.reshape(-1, dr)[untouched].view(torch.int16))


def quantize_cols(w):
    s = w.float().abs().amax(0, keepdim=True) / 127
    return torch.round(w.float() / s).clamp(-127, 127).to(torch.int8), s


@pytest.mark.parametrize("weight_quant_mode,kv_quant,smooth", [(1, 0, False), (2, 1, True), (2, 0, False)])
def test_prolog_int8_modes_match_fp32_model(weight_quant_mode, kv_quant, smooth):
    t, he, hcq, hckv, n, d, dr, bs = 8, 256, 128, 64, 2, 64, 32, 16
    m = make_model(3, t, he, hcq, hckv, n, d, dr)
    kw = {}
    wuq = m["weight_uq_qr"].float()
    if smooth:      # SmoothQuant: c_q * s on the activation side, W / s on the weight side
        kw["smooth_scales_cq"] = 0.5 + torch.rand(1, hcq, generator=torch.Generator().manual_seed(5))
        wuq = wuq / kw["smooth_scales_cq"].reshape(-1, 1)
    wuq, kw["dequant_scale_w_uq_qr"] = quantize_cols(wuq)
    x, wdq, wdkv = m["x"], m["weight_dq"], m["weight_dkv_kr"]
    if weight_quant_mode == 2:
        sx = x.float().abs().amax(-1, keepdim=True) / 127
        x = torch.round(x.float() / sx).clamp(-127, 127).to(torch.int8)
        kw["dequant_scale_x"] = sx
        wdq, kw["dequant_scale_w_dq"] = quantize_cols(wdq)
        wdkv, kw["dequant_scale_w_dkv_kr"] = quantize_cols(wdkv)
    blocks = 2
    kv = torch.zeros(blocks, bs, 1, hckv, dtype=torch.int8 if kv_quant else torch.bfloat16)
    kr = torch.zeros(blocks, bs, 1, dr, dtype=torch.bfloat16)
    if kv_quant:
        kw["quant_scale_ckv"] = torch.full((hckv,), 40.0)
    idx = torch.arange(t) * 3
    res = mla_prolog(x, weight_nz(wdq), weight_nz(wuq), m["weight_uk"], weight_nz(wdkv), m["q_norm"], m["kv_norm"],
                     m["sin"], m["cos"], kv, kr, cache_index=idx, weight_quant_mode=weight_quant_mode,
                     kv_cache_quant_mode=kv_quant, rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6, aic=2, **kw)
    ref = mla_prolog_reference(x, wdq, wuq, m["weight_uk"], wdkv, m["q_norm"], m["kv_norm"], m["sin"], m["cos"],
                               weight_quant_mode=weight_quant_mode, kv_cache_quant_mode=kv_quant,
                               rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6, **kw)
    for name, got in (("query", res.query), ("query_rope", res.query_rope), ("kr", kr.reshape(-1, dr)[idx])):
        assert maxerr(got, ref[name]) <= ref[name].abs().max().item() * 2 ** -6, name
    kv_rows = kv.reshape(-1, hckv)[idx].float()
    if kv_quant:       # int8 steps: at most one step off where fp32 rounding lands on a .5 boundary
        assert (kv_rows - ref["kv"]).abs().max().item() <= 1
        assert (kv_rows != ref["kv"]).float().mean().item() < 0.02
    else:
        assert maxerr(kv_rows, ref["kv"]) <= ref["kv"].abs().max().item() * 2 ** -7
    # the quantised model stays close to the bf16 model: int8 error budget of a few per cent
    exact = deepseek_mla_reference(m["x"], m["wq_a"], m["q_norm"], m["wq_b"], m["wkv_a"], m["kv_norm"], m["wkv_b"],
                                   m["theta"], n, d, dr, 1e-6, dtype=torch.float64)
    rel = maxerr(res.query, exact["q_absorbed"]) / exact["q_absorbed"].abs().max().item()
    assert rel < 0.08


def test_fused_prolog_overlaps_and_beats_staged():
    t, he, hcq, hckv, n, d, dr = 16, 512, 384, 128, 4, 64, 32
    m = make_model(11, t, he, hcq, hckv, n, d, dr)
    outs = []
    for staged in (False, True):
        kv = torch.zeros(2, 16, 1, hckv).bfloat16()
        kr = torch.zeros(2, 16, 1, dr).bfloat16()
        r = mla_prolog(m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                       m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=torch.arange(t), aic=4, staged=staged)
        outs.append((r, kv))
    fused, staged = outs[0][0], outs[1][0]
    assert torch.equal(fused.query.view(torch.int16), staged.query.view(torch.int16))
    assert torch.equal(outs[0][1].view(torch.int16), outs[1][1].view(torch.int16))
    assert len(staged.stage_runs) == 5
    assert fused.kernel_us < staged.kernel_us, (fused.kernel_us, staged.kernel_us)
    # overlap: the AIVs' busy time runs while the AICs compute, not after
    busy = fused.run.busy_by_pipe()
    assert busy["VECTOR"] > 0 and busy["CUBE"] > 0


def test_prolog_errors_name_the_argument():
    m = make_model(0, 4, 256, 128, 64, 2, 32, 16)
    base = (m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"], m["kv_norm"],
            m["sin"], m["cos"], torch.zeros(1, 16, 1, 64).bfloat16(), torch.zeros(1, 16, 1, 16).bfloat16())
    with pytest.raises(ArgumentError, match="cache_mode"):
        mla_prolog(*base, cache_index=torch.arange(4), cache_mode="PA_BNSD")
    with pytest.raises(ShapeError, match=r"D \+ Dr = 48 must be a multiple of 32"):
        mla_prolog(*base, cache_index=torch.arange(4), weight_quant_mode=1)
    m8 = make_model(0, 4, 256, 128, 64, 2, 48, 16)
    base8 = (m8["x"], m8["weight_dq"], m8["weight_uq_qr"], m8["weight_uk"], m8["weight_dkv_kr"], m8["q_norm"],
             m8["kv_norm"], m8["sin"], m8["cos"], torch.zeros(1, 16, 1, 64).bfloat16(),
             torch.zeros(1, 16, 1, 16).bfloat16())
    with pytest.raises(ArgumentError, match="dequant_scale_w_uq_qr"):
        mla_prolog(*base8, cache_index=torch.arange(4), weight_quant_mode=1)
    with pytest.raises(ArgumentError, match="cache_index"):
        mla_prolog(*base, cache_index=torch.tensor([0, 1, 2, 16]))
    bad = list(base)
    bad[1] = m["weight_dq"][:, :64]
    with pytest.raises(ShapeError, match="weight_dq"):
        mla_prolog(*bad, cache_index=torch.arange(4))


@pytest.mark.parametrize("case, error, match", [
    ("bsnd_as_nz", ShapeError, r"kv_cache has shape \(1, 16, 1, 64\); cache_mode=PA_NZ needs 5 dims"),
    ("nz_as_bsnd", ShapeError, r"kv_cache has shape \(1, 1, 4, 16, 16\); cache_mode=PA_BSND needs 4 dims"),
    ("kr_blocks", ShapeError, r"kr_cache has shape \(2, 16, 1, 16\); cache_mode=PA_BSND needs \(1, 16, 1, 16\)"),
    ("kv_width", ShapeError, r"kv_cache has shape \(1, 16, 1, 32\); cache_mode=PA_BSND needs \(1, 16, 1, 64\)"),
    ("int8_without_quant_mode", DTypeError, r"kv_cache is torch.int8: expected torch.bfloat16"),
    ("float_cache_index", DTypeError, r"cache_index is torch.float32"),
])
def test_cache_shapes_are_checked_against_cache_mode_before_launch(case, error, match):
    """Before: the layout was taken on trust (block_size read from whatever dim cache_mode names) and a mismatch
    failed inside the kernel with an AddressError, or an IndexError on the host."""
    m = make_model(0, 4, 256, 128, 64, 2, 32, 16)
    kv, kr, kw = torch.zeros(1, 16, 1, 64).bfloat16(), torch.zeros(1, 16, 1, 16).bfloat16(), {}
    idx = torch.arange(4)
    if case == "bsnd_as_nz":
        kw["cache_mode"] = "PA_NZ"
    elif case == "nz_as_bsnd":
        kv = to_nz_cache(kv)
    elif case == "kr_blocks":
        kr = torch.zeros(2, 16, 1, 16).bfloat16()
    elif case == "kv_width":
        kv = torch.zeros(1, 16, 1, 32).bfloat16()
    elif case == "int8_without_quant_mode":
        kv = torch.zeros(1, 16, 1, 64, dtype=torch.int8)
    else:
        idx = idx.float()
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    with pytest.raises(error, match=match):
        mla_prolog(m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                   m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=idx, pod=pod, **kw)
    assert pod.synchronize().instructions == 0                  # nothing was launched


@pytest.mark.slow
def test_v3_prolog_timing_only_fused_beats_staged():
    fused = mla_prolog_timing(96)
    staged = mla_prolog_timing(96, staged=True)
    assert fused.kernel_us < staged.kernel_us
    # V3 weights (bf16) are read from HBM once; the stages' intermediates stay in the L2
    weights = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 128 * 128 * 512) * 2
    assert weights <= fused.run.hbm_bytes() <= 1.15 * (weights + 96 * 7168 * 2)
