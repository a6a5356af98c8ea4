"""Calibration hooks: exact Hessian/absmax against explicitly captured inputs, input groups and norms, reservoir
sample, and MoE expert coverage with top-up."""
from __future__ import annotations

import pytest
import torch

import quant
from quant.errors import CalibrationError
from quant.toy import ToyLM, random_batches


def captured_inputs(model, batches, name):
    rows = []
    hook = lambda m, i: rows.append(i[0].detach().reshape(-1, i[0].shape[-1]))
    h = model.get_submodule(name).register_forward_pre_hook(hook)
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    return torch.cat(rows)


def test_stats_match_captured_inputs_and_groups():
    model = ToyLM(seed=1)
    batches = random_batches(4, seq_len=48, batch=2, seed=1)
    layers = quant.linear_layers(model)
    assert "lm_head" not in layers and len(layers) == 14
    cal = quant.calibrate(model, batches, layers, sample_rows=100)
    assert cal.num_batches == 4 and cal.num_tokens == 4 * 2 * 48
    st = cal.stats("layers.0.self_attn.k_proj")
    assert st.layers == ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]
    assert st.norm == "layers.0.input_layernorm"
    assert cal.stats("layers.1.mlp.up_proj").norm == "layers.1.post_attention_layernorm"
    assert cal.stats("layers.0.self_attn.o_proj").norm is None
    assert cal.stats("layers.0.mlp.down_proj").layers == ["layers.0.mlp.down_proj"]
    assert len(cal.groups) == 8
    x = captured_inputs(model, batches, "layers.1.self_attn.q_proj").double()
    h = 2.0 / x.shape[0] * x.t() @ x
    st_h = cal.stats("layers.1.self_attn.q_proj").hessian()
    assert torch.allclose(st_h, h, rtol=1e-5, atol=1e-6 * float(h.abs().max()))
    assert st_h.dtype == torch.float64
    assert torch.equal(cal.stats("layers.1.self_attn.q_proj").absmax, x.float().abs().amax(0))
    sample = cal.stats("layers.1.self_attn.q_proj").sample
    assert sample.shape == (100, x.shape[1])
    assert all(bool((x.float() == r).all(1).any()) for r in sample[:10])      # sampled rows are real rows
    again = quant.calibrate(model, batches, layers, sample_rows=100)
    assert torch.equal(again.stats("layers.1.self_attn.q_proj").sample, sample)   # seeded: deterministic


def moe_model():
    return ToyLM(d=64, f=64, layers=1, num_experts=6, skew=0.6, seed=2)


def test_moe_top_up_until_every_expert_has_min_tokens():
    model = moe_model()
    layers = quant.linear_layers(model, skip=("lm_head", "router"))
    pool = random_batches(60, seq_len=32, seed=2)
    base = quant.calibrate(model, pool, layers, num_batches=1)
    counts = base.expert_tokens
    assert sorted(counts) == [f"layers.0.mlp.experts.{i}" for i in range(6)]
    assert min(counts.values()) < 8, counts                           # the skewed router starves some expert
    cal = quant.calibrate(model, pool, layers, num_batches=1, min_expert_tokens=8)
    assert min(cal.expert_tokens.values()) >= 8, cal.expert_tokens
    assert 1 < cal.num_batches < 60                                        # topped up from the pool
    assert sum(cal.expert_tokens.values()) == cal.num_tokens          # top-1: every token goes to one expert


def test_moe_coverage_error_names_experts():
    model = moe_model()
    layers = quant.linear_layers(model, skip=("lm_head", "router"))
    msg = r"min_expert_tokens=100000: calibration data ran out after 3 batches with 6 expert\(s\).*experts\.5"
    with pytest.raises(CalibrationError, match=msg):
        quant.calibrate(model, random_batches(3, seq_len=32, seed=2), layers, num_batches=1,
                        min_expert_tokens=100000)
    cal = quant.calibrate(model, random_batches(3, seq_len=32, seed=2), layers, num_batches=1,
                          min_expert_tokens=100000, strict=False)
    assert cal.num_batches == 3


def test_uncovered_expert_is_rounded_to_nearest():
    model = moe_model()
    rep = quant.quantize_model(model, random_batches(1, seq_len=8, seed=2), skip=("lm_head", "router"))
    counts = rep.expert_tokens
    starved = [e for e, c in counts.items() if c == 0]
    assert starved, counts
    lr = rep.layer(starved[0] + ".gate_proj")
    assert lr.method == "rtn" and lr.calib_tokens == 0
    assert isinstance(model.get_submodule(starved[0] + ".gate_proj"), quant.QuantLinear)


def test_calibration_argument_errors():
    model = ToyLM(seed=1)
    layers = quant.linear_layers(model)
    with pytest.raises(CalibrationError, match="empty"):
        quant.calibrate(model, [], layers)
    with pytest.raises(CalibrationError, match="num_batches=0"):
        quant.calibrate(model, random_batches(1), layers, num_batches=0)
    with pytest.raises(CalibrationError, match="sample_rows=0"):
        quant.calibrate(model, random_batches(1), layers, sample_rows=0)
