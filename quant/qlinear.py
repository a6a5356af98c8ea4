"""QuantLinear: a W8A8 (or weight-only W8A16) drop-in for nn.Linear.

forward(x [..., K]) with act_quant (W8A8): per-token dynamic INT8 of ``x * smooth`` (``quant.int8``), exact INT8
GEMM with ``qweight`` [N, K] -> int32, dequant ``(fp32(acc) * x_scale) * w_scale`` -> rounded to ``out_dtype``
(bf16 by default, as the NPU's grouped_matmul writes it) -> returned in x's dtype (+ bias).
backend "torch" runs that in torch; "emulator" runs ``kernels.dynamic_quant`` and ``kernels.grouped_matmul`` on an
emulated die (imported lazily; needs K and N multiples of 32). Both give bitwise the same int8 activations, int32
accumulators and bf16 outputs.
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import QuantError
from .int8 import dequantize_weight, int8_gemm, quantize_per_token

BACKENDS = ("torch", "emulator")


class QuantLinear(nn.Module):
    """Buffers: qweight int8 [N, K]; w_scale fp32 [N]; smooth fp32 [K] or None (1/s of SmoothQuant when no norm
    absorbs it); bias fp32 [N] or None."""

    def __init__(self, qweight: torch.Tensor, w_scale: torch.Tensor, smooth: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, act_quant: bool = True, out_dtype=torch.bfloat16,
                 backend: str = "torch"):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.ndim != 2:
            raise QuantError(f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
        n, k = qweight.shape
        if tuple(w_scale.shape) != (n,):
            raise QuantError(f"w_scale shape {tuple(w_scale.shape)} must be [N] = [{n}]")
        if smooth is not None and tuple(smooth.shape) != (k,):
            raise QuantError(f"smooth shape {tuple(smooth.shape)} must be [K] = [{k}]")
        self.in_features, self.out_features = int(k), int(n)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("w_scale", w_scale.float().contiguous())
        self.register_buffer("smooth", None if smooth is None else smooth.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.act_quant = bool(act_quant)
        self.out_dtype = out_dtype
        self.backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise QuantError(f"backend={value!r}: use one of {BACKENDS}")
        self._backend = value

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{'w8a8' if self.act_quant else 'w8a16'}, smooth={self.smooth is not None}, backend={self.backend}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not self.act_quant:
            y = x2.float() @ dequantize_weight(self.qweight, self.w_scale).t()
        elif self.backend == "emulator":
            y = self.forward_emulator(x2)
        else:
            xq, xs = quantize_per_token(x2, self.smooth)
            y = self.dequant(int8_gemm(xq, self.qweight), xs)
        if self.out_dtype is not None:
            y = y.to(self.out_dtype)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def dequant(self, acc: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """int32 acc [T, N], x_scale fp32 [T] -> fp32 [T, N] = (fp32(acc) * x_scale) * w_scale."""
        return (acc.float() * x_scale[:, None]) * self.w_scale[None, :]

    def forward_emulator(self, x2: torch.Tensor, raw: bool = False):
        """x2 [T, K] -> fp32 [T, N] from the emulator's bf16 output (or, raw=True, the tuple (int8 x, x scale,
        int32 accumulators) from ``kernels.dynamic_quant`` + ``kernels.grouped_matmul(output_dtype=int32)``)."""
        from kernels.dynamic_quant import dynamic_quant
        from kernels.grouped_matmul import grouped_matmul
        t = x2.shape[0]
        dq = dynamic_quant(x2.float().contiguous(), smooth_scales=self.smooth, trace=False)
        w = self.qweight.t().contiguous()[None]                     # [E=1, K, N]
        if raw:
            acc = grouped_matmul(dq.y, w, group_list=[t], output_dtype=torch.int32, trace=False).y
            return dq.y, dq.scale, acc
        y = grouped_matmul(dq.y, w, group_list=[t], scale=self.w_scale[None], per_token_scale=dq.scale,
                           trace=False).y
        return y.float()

    @classmethod
    def from_linear(cls, linear: nn.Linear, qweight: torch.Tensor, w_scale: torch.Tensor, **kw) -> "QuantLinear":
        """Wrap ``linear``'s bias with the given int8 weight and scales."""
        return cls(qweight, w_scale, bias=linear.bias, **kw)
