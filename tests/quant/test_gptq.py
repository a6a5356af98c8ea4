"""GPTQ (INT8, symmetric, per output channel) against round-to-nearest on the same grid.

Output error is measured directly, ||X W^T - X W_q^T||_F / ||X W^T||_F with the calibration rows X, and through the
Hessian (quant.output_error); the two must agree to fp32 precision.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import quant
from quant.errors import CholeskyError, QuantError


def correlated(seed: int, n: int, k: int, rows: int = 1024):
    """Rows with correlated channels and a few large ones (what makes GPTQ's error feedback pay off)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k))
    x[:, :4] *= 8
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w, 2.0 / rows * x.double().t() @ x.double()


def rel_err(x, w, wq):
    y = x.double() @ w.double().t()
    return float((x.double() @ wq.double().t() - y).norm() / y.norm())


@pytest.mark.parametrize("seed, n, k, act_order", [(0, 96, 64, False), (1, 64, 200, False), (2, 256, 128, True),
                                                   (3, 32, 320, True)])
def test_gptq_beats_rtn_on_random_layers(seed, n, k, act_order):
    x, w, h = correlated(seed, n, k)
    res = quant.gptq_quantize(w, h, act_order=act_order, block_size=48)
    rtn = quant.quantize_weight_rtn(w, res.scale)
    e_gptq = rel_err(x, w, quant.dequantize_weight(res.qweight, res.scale))
    e_rtn = rel_err(x, w, quant.dequantize_weight(rtn, res.scale))
    assert e_gptq < 0.9 * e_rtn, (e_gptq, e_rtn)
    e_hessian = quant.output_error(w, quant.dequantize_weight(res.qweight, res.scale), h)
    assert abs(e_hessian - e_gptq) < 1e-4 * e_gptq + 1e-7
    assert res.qweight.dtype == torch.int8 and res.scale.dtype == torch.float32
    assert int(res.qweight.min()) >= -127 and int(res.qweight.max()) <= 127
    assert int(res.qweight.abs().max()) == 127                    # the grid is used to its edge
    assert torch.equal(res.scale, quant.channel_scales(w))       # scale = max|w_i| / 127 (no clipping)


def test_gptq_deterministic_and_block_size_invariant_in_quality():
    x, w, h = correlated(4, 80, 96)
    a = quant.gptq_quantize(w, h)
    b = quant.gptq_quantize(w, h)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
    c = quant.gptq_quantize(w, h, block_size=7)                   # lazy batching changes only rounding of the updates
    assert (a.qweight.int() - c.qweight.int()).abs().max() <= 1
    assert (a.qweight != c.qweight).float().mean() < 0.01


def test_stacked_layers_equal_separate_calls():
    x, w, h = correlated(5, 64, 64)
    w2 = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    both = quant.gptq_quantize(torch.cat([w, w2]), h)
    assert torch.equal(both.qweight[:64], quant.gptq_quantize(w, h).qweight)
    assert torch.equal(both.qweight[64:], quant.gptq_quantize(w2, h).qweight)


def test_dead_columns_are_rounded_not_zeroed():
    x, w, h = correlated(6, 48, 64)
    x[:, [3, 17]] = 0                                             # channels calibration never saw
    h = 2.0 / x.shape[0] * x.double().t() @ x.double()
    res = quant.gptq_quantize(w, h)
    assert res.dead_columns == 2
    rtn = quant.quantize_weight_rtn(w, res.scale)
    assert torch.equal(res.qweight[:, [3, 17]], rtn[:, [3, 17]])
    assert res.qweight[:, [3, 17]].abs().sum() > 0
    all_dead = quant.gptq_quantize(w, torch.zeros(64, 64, dtype=torch.float64))
    assert torch.equal(all_dead.qweight, rtn) and all_dead.dead_columns == 64


def test_damping_escalation_is_reported():
    _, w, _ = correlated(7, 16, 32)
    h = torch.eye(32, dtype=torch.float64)
    h[0, 0] = -0.5                                                # indefinite: fails at 1 % and 10 % damping
    with pytest.warns(RuntimeWarning, match="Cholesky failed"):
        res = quant.gptq_quantize(w, h)
    assert res.escalations == [0.01, pytest.approx(0.1)]
    assert res.damp == pytest.approx(1.0)
    with pytest.raises(CholeskyError, match="max_escalations=1"):
        quant.gptq_quantize(w, h, max_escalations=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                            # a healthy Hessian: no warning at all
        assert quant.gptq_quantize(w, torch.eye(32, dtype=torch.float64)).escalations == []


def test_argument_errors_name_the_argument():
    _, w, h = correlated(8, 16, 32)
    with pytest.raises(QuantError, match="block_size=0"):
        quant.gptq_quantize(w, h, block_size=0)
    with pytest.raises(QuantError, match=r"\[K, K\] = \[32, 32\]"):
        quant.gptq_quantize(w, h[:16, :16])
    with pytest.raises(QuantError, match="damp=0"):
        quant.gptq_quantize(w, h, damp=0)
    assert issubclass(QuantError, ValueError)
