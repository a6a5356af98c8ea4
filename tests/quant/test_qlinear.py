"""QuantLinear: torch path vs the emulator's kernels.dynamic_quant + kernels.grouped_matmul.

Bitwise: int8 activations, per-token scales, int32 accumulators and the bf16 outputs (both compute
bf16((fp32(acc) * x_scale) * w_scale) with round-to-nearest-even). The torch path with fp32 output
(out_dtype=None) is within bf16 rounding of the emulator's: |d| <= 2^-8 |y|.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import quant
from quant.errors import QuantError


def layer(seed, k=96, n=64, smooth=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    sc = quant.channel_scales(lin.weight)
    q = quant.quantize_weight_rtn(lin.weight, sc)
    sm = (torch.rand(k, generator=g) + 0.5) if smooth else None
    x = torch.randn(3, 7, k, generator=g) * 2
    x[0, 0] = 0                                                   # a zero row: scale 0, output 0 (+ bias)
    return lin, quant.QuantLinear.from_linear(lin, q, sc, smooth=sm), x


@pytest.mark.parametrize("smooth", [False, True])
def test_emulator_equals_torch_bitwise(smooth):
    lin, ql, x = layer(0, smooth=smooth)
    x2 = x.reshape(-1, 96)
    xq, xs = quant.quantize_per_token(x2, ql.smooth)
    eq, es, acc = ql.forward_emulator(x2, raw=True)
    assert torch.equal(eq, xq) and torch.equal(es.view(torch.int32), xs.view(torch.int32))
    assert acc.dtype == torch.int32 and torch.equal(acc, quant.int8_gemm(xq, ql.qweight))
    assert torch.equal(acc.long(), xq.long() @ ql.qweight.long().t())           # exact integer GEMM
    y_torch = ql(x)
    ql.backend = "emulator"
    y_emu = ql(x)
    assert y_emu.dtype == x.dtype == torch.float32
    assert torch.equal(y_emu, y_torch)
    assert not y_torch[0, 0].any()
    ql.backend, ql.out_dtype = "torch", None                                     # fp32 dequant, no bf16 rounding
    y32 = ql(x)
    assert not torch.equal(y32, y_emu)
    assert ((y32 - y_emu).abs() <= 2 ** -8 * y32.abs()).all()


def test_quantlinear_close_to_linear_and_bias_and_w8a16():
    lin, ql, x = layer(1, smooth=False, bias=True)
    with torch.no_grad():
        ref = lin(x)
    y = ql(x)
    assert float((y - ref).norm() / ref.norm()) < 0.02
    assert torch.allclose(y[0, 0], lin.bias)                                    # zero row: just the bias
    w16 = quant.QuantLinear.from_linear(lin, ql.qweight, ql.w_scale, act_quant=False, out_dtype=None)
    exp = x @ quant.dequantize_weight(ql.qweight, ql.w_scale).t() + lin.bias
    assert torch.allclose(w16(x), exp, rtol=1e-5, atol=1e-5)


def test_quantlinear_argument_errors():
    lin, ql, _ = layer(2)
    with pytest.raises(QuantError, match="backend='npu'"):
        ql.backend = "npu"
    with pytest.raises(QuantError, match=r"w_scale shape \(3,\) must be \[N\] = \[64\]"):
        quant.QuantLinear(ql.qweight, torch.ones(3))
    with pytest.raises(QuantError, match="int8"):
        quant.QuantLinear(ql.qweight.float(), ql.w_scale)
