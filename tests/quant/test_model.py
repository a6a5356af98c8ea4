"""quantize_model on the seeded toy Llama-style model: in-place swap, folding, report, schemes, errors."""
from __future__ import annotations

import copy

import pytest
import torch

import quant
from quant.errors import QuantError
from quant.toy import ToyLM, random_batches


def kl_top1(ref, model, ids):
    with torch.no_grad():
        lr, lq = ref(ids).logits.double(), model(ids).logits.double()
    pr, pq = lr.log_softmax(-1), lq.log_softmax(-1)
    return float((pr.exp() * (pr - pq)).sum(-1).mean()), float((lr.argmax(-1) == lq.argmax(-1)).double().mean())


@pytest.fixture(scope="module")
def toy():
    return ToyLM(d=128, f=256, layers=2, seed=5, outliers=40.0), random_batches(6, seq_len=64, seed=5), \
        random_batches(4, seq_len=64, seed=55)


def test_quantize_model_in_place_with_report(toy):
    ref, calib, held = toy
    model = copy.deepcopy(ref)
    rep = quant.quantize_model(model, calib)
    qls = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    assert len(qls) == 14 and isinstance(model.lm_head, torch.nn.Linear)
    assert not any(type(m) is torch.nn.Linear for n, m in model.named_modules() if n != "lm_head")
    assert [lr.name for lr in rep.layers][:3] == ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                                                  "layers.0.self_attn.v_proj"]
    assert rep.calib_batches == 6 and rep.calib_tokens == 384 and rep.seconds["total"] > 0
    for lr in rep.layers:
        assert lr.method == "gptq" and lr.weight_err < lr.rtn_weight_err, lr
        assert 0 < lr.w8a8_err < 0.1
    qkv = rep.layer("layers.0.self_attn.q_proj")
    if qkv.alpha is not None:                    # folded: the norm changed, no explicit smooth vector
        assert qkv.smooth == "norm:layers.0.input_layernorm" and model.layers[0].self_attn.q_proj.smooth is None
        assert not torch.equal(model.layers[0].input_layernorm.weight, ref.layers[0].input_layernorm.weight)
    o = rep.layer("layers.0.self_attn.o_proj")
    assert o.smooth in ("explicit", "none")
    assert (model.layers[0].self_attn.o_proj.smooth is not None) == (o.smooth == "explicit")
    assert sum(g.alpha is not None for g in rep.groups) >= 4         # outlier norms: smoothing is chosen
    d = rep.to_dict()
    assert d["layers"][0]["name"] == "layers.0.self_attn.q_proj" and "None" in d["groups"][0]["search_errors"]
    kl, top1 = kl_top1(ref, model, torch.cat(held))
    rtn = copy.deepcopy(ref)
    quant.quantize_model(rtn, calib, smooth=False, gptq=False)
    kl_rtn, _ = kl_top1(ref, rtn, torch.cat(held))
    assert kl < 0.7 * kl_rtn, (kl, kl_rtn)
    assert top1 > 0.9
    again = copy.deepcopy(ref)
    quant.quantize_model(again, calib)
    assert all(torch.equal(a.qweight, b.qweight) for a, b in zip(qls, [m for m in again.modules()
                                                                     if isinstance(m, quant.QuantLinear)]))


def test_fixed_alpha_w8a16_and_emulator_backend(toy):
    ref, calib, held = toy
    m = copy.deepcopy(ref)
    rep = quant.quantize_model(m, calib[:2], smooth_alpha=0.5, gptq=False, clip=True)
    assert {g.alpha for g in rep.groups} == {0.5} and all(lr.method == "rtn" for lr in rep.layers)
    ids = held[0][:, :8]
    with torch.no_grad():
        y_torch = m(ids).logits
        assert quant.set_backend(m, "emulator") == 14
        y_emu = m(ids).logits
    assert torch.equal(y_torch, y_emu)
    w16 = copy.deepcopy(ref)
    rep16 = quant.quantize_model(w16, calib[:2], scheme="w8a16")
    assert all(lr.alpha is None and lr.w8a8_err is None for lr in rep16.layers)
    assert not any(isinstance(m, quant.QuantLinear) and m.act_quant for m in w16.modules())


def logit_error(ref, model, ids):
    with torch.no_grad():
        a, b = ref(ids).logits.double(), model(ids).logits.double()
    return float((a - b).norm() / a.norm())


@pytest.mark.parametrize("kw", [dict(smooth_alpha=0.5, gptq=False), dict()], ids=["alpha0.5-rtn", "search-gptq"])
def test_a_norm_feeding_two_groups_is_smoothed_jointly(toy, kw):
    """One RMSNorm module called before attention and before the MLP feeds two linear groups. Before: each group
    folded its own scale into it (the norm divided by both), 135 % relative logit error. Now one joint scale is
    folded once; the report says which groups share it, and smoothing helps as it does with separate norms."""
    ref, calib, held = toy
    ref = copy.deepcopy(ref)
    for blk in ref.layers:
        blk.post_attention_layernorm = blk.input_layernorm
    ids = torch.cat(held)
    model = copy.deepcopy(ref)
    rep = quant.quantize_model(model, calib, **kw)
    plain = copy.deepcopy(ref)
    quant.quantize_model(plain, calib, smooth=False, gptq=kw.get("gptq", True))
    err, err_plain = logit_error(ref, model, ids), logit_error(ref, plain, ids)
    assert err < 0.75 * err_plain and err < 0.25, (err, err_plain)
    shared = [g for g in rep.groups if g.norm == "layers.0.input_layernorm"]
    assert [len(g.layers) for g in shared] == [3, 2] and all(g.shared_norm_groups == 2 for g in shared)
    assert shared[0].alpha == shared[1].alpha and shared[0].search_errors == shared[1].search_errors
    assert rep.layer("layers.0.mlp.gate_proj").smooth == "norm:layers.0.input_layernorm"
    assert all(g.shared_norm_groups == 1 for g in rep.groups if g.norm is None)


def test_quantize_model_argument_errors(toy):
    ref, calib, _ = toy
    with pytest.raises(QuantError, match="scheme='w4a8'"):
        quant.quantize_model(copy.deepcopy(ref), calib, scheme="w4a8")
    with pytest.raises(QuantError, match="smooth_alpha=2"):
        quant.quantize_model(copy.deepcopy(ref), calib, smooth_alpha=2)
    with pytest.raises(QuantError, match="no nn.Linear"):
        quant.quantize_model(torch.nn.Sequential(torch.nn.ReLU()), calib)
