"""SmoothQuant: the fold preserves the fp32 function; smoothing lowers W8A8 error on layers with activation
outliers; the per-group alpha search includes "no smoothing"."""
from __future__ import annotations

import copy

import pytest
import torch

import quant
from quant.errors import QuantError
from quant.toy import ToyLM, random_batches


def outlier_rows(seed: int, rows: int = 512, k: int = 128, hot: int = 4, gain: float = 60.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, :hot] *= gain                                  # a few channels carry most of the magnitude (LLM outliers)
    ws = [torch.randn(n, k, generator=g) / k ** 0.5 for n in (96, 32)]
    return x, ws


def test_smoothing_lowers_w8a8_error_with_outliers():
    x, ws = outlier_rows(0)
    amax = x.abs().amax(0)
    plain = quant.w8a8_error(x, ws, None)
    smooth = quant.w8a8_error(x, ws, quant.smooth_scales(amax, ws, 0.5))
    assert smooth < 0.5 * plain, (smooth, plain)
    res = quant.search_smooth_scale(x, ws, amax)
    assert None in res.errors and res.alpha is not None
    assert res.errors[res.alpha] == min(res.errors.values()) < plain


def test_search_keeps_no_smoothing_when_it_wins():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)                           # no outliers at all
    ws = [torch.randn(48, 64, generator=g)]
    ws[0][:, 0] *= 30                                               # but an outlier weight column
    res = quant.search_smooth_scale(x, ws, x.abs().amax(0), alphas=(None, 0.0))   # alpha 0 moves it into x
    assert res.alpha is None and torch.equal(res.s, torch.ones(64))
    assert res.errors[None] < res.errors[0.0]


def test_smooth_scales_formula_and_guards():
    amax = torch.tensor([4.0, 0.0, 9.0])
    w = torch.tensor([[1.0, 2.0, -0.25], [-2.0, 1.0, 0.5]])
    s = quant.smooth_scales(amax, [w], 0.5)
    assert torch.allclose(s, torch.tensor([(4 / 2) ** 0.5, 1.0, (9 / 0.5) ** 0.5]))
    with pytest.raises(QuantError, match="alpha=1.5"):
        quant.smooth_scales(amax, [w], 1.5)


def test_fold_preserves_fp32_function():
    model = ToyLM(seed=3)
    batches = random_batches(3, seed=3)
    ids = random_batches(1, seed=99)[0]
    with torch.no_grad():
        ref = model(ids).logits
    folded = copy.deepcopy(model)
    layers = quant.linear_layers(folded)
    cal = quant.calibrate(folded, batches, layers)
    n_folded = 0
    mods = dict(folded.named_modules())
    for st in cal.groups:
        if st.norm is None:
            continue
        ws = [layers[n].weight.detach() for n in st.layers]
        s = quant.smooth_scales(st.absmax, ws, 0.8)
        quant.fold_into_norm(mods[st.norm], s)
        for n in st.layers:
            layers[n].weight.data = (layers[n].weight.data.double() * s.double()).float()
        n_folded += 1
    assert n_folded == 4                                             # 2 blocks x (attention norm, MLP norm)
    with torch.no_grad():
        out = folded(ids).logits
    assert not torch.equal(model.layers[0].input_layernorm.weight, folded.layers[0].input_layernorm.weight)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 2e-5, err                                           # fp32 rounding of the rescaled products only
