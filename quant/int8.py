"""The INT8 grid shared by every quantiser here (DESIGN.md 3.4): symmetric, no zero point.

- activations, per token (dynamic): ``scale = max|x * smooth| / 127`` (fp32), ``q = round_half_even(v / scale)``
  saturated to [-128, 127]; a zero row has scale 0 and q 0. Bitwise what ``kernels.dynamic_quant`` computes.
- weights, per output channel: ``scale = clip * max|w_i| / 127`` (fp32), ``q`` in [-127, 127] (symmetric grid: -w
  quantises to -q). A zero row gets scale 1 so q = 0 without dividing by zero.
- GEMM: the int32 accumulator is exact; ``y = (fp32(acc) * x_scale[row]) * w_scale[col]`` in fp32, the order of
  ``kernels.grouped_matmul``'s epilogue.
"""
from __future__ import annotations

import torch

from .checks import check_size, check_tensor
from .errors import QuantError

QMAX = 127
# fp32 holds every integer below 2^24 exactly: that many int8 products (|a * b| <= 2^14) sum exactly
EXACT_F32_K = 2 ** 24 // (128 * 128)


def _check_scale(w: torch.Tensor, scale: torch.Tensor, name: str = "scale") -> None:
    """Per-output-channel scales: [N] finite and > 0 (a zero or NaN scale divides into garbage)."""
    check_size(check_tensor(scale, name, 1), name, 0, w.shape[0], "one per output channel")
    if scale.numel() and not bool((scale > 0).all()):
        raise QuantError(f"{name} holds {float(scale.min())}: per-channel scales must be > 0")


def quantize_per_token(x: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float) -> (q int8 [T, K], scale fp32 [T]). smooth: None or [K], multiplied in fp32 first."""
    check_tensor(x, "x", 2)
    xf = x.float()
    if smooth is not None:
        check_tensor(smooth, "smooth", 1)
        check_size(smooth, "smooth", 0, x.shape[1], "x's K")
        xf = xf * smooth.float()
        check_tensor(xf, "x * smooth", 2)
    scale = xf.abs().amax(-1) / QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / safe[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def channel_scales(w: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """w [N, K] -> fp32 per-output-channel scales [N] = clip * max|w_i| / 127 (1.0 for an all-zero row).
    clip: a float or [N] (each in (0, 1])."""
    check_tensor(w, "w", 2)
    c = clip if torch.is_tensor(clip) else torch.tensor(float(clip))
    if c.ndim > 1 or (c.ndim == 1 and c.numel() != w.shape[0]) or not bool(((c > 0) & (c <= 1)).all()):
        raise QuantError(f"clip: a factor in (0, 1] or one per output channel ([N] = [{w.shape[0]}]), got "
                         f"{tuple(c.shape) if c.ndim else float(c)}")
    amax = w.detach().abs().amax(-1).double() * (clip.double() if torch.is_tensor(clip) else float(clip))
    scale = (amax / QMAX).float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_weight_rtn(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round to nearest: w [N, K], scale [N] fp32 -> int8 [N, K] in [-127, 127]."""
    _check_scale(check_tensor(w, "w", 2), scale)
    return torch.round(w.double() / scale.double()[:, None]).clamp(-QMAX, QMAX).to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K], scale [N] -> fp32 [N, K]."""
    _check_scale(check_tensor(q, "q", 2, kind="int8"), scale)
    return q.float() * scale.float()[:, None]


def int8_gemm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact a [M, K] int8 @ b_t.T ([N, K] int8) -> int32 [M, N], wrapping modulo 2^32 like ``torch._int_mm``.

    fp32 BLAS over K chunks of ``EXACT_F32_K``: every partial sum of a chunk is an integer below 2^24, exact in any
    summation order, and the chunks add as int32. ``torch._int_mm`` gives the same values but runs 30-60x slower on a
    CPU without int8 dot-product instructions."""
    check_tensor(a, "a", 2, kind="int8")
    check_size(check_tensor(b_t, "b_t", 2, kind="int8"), "b_t", 1, a.shape[1], "a's K")
    fa, fb = a.float(), b_t.float()
    out = torch.zeros((a.shape[0], b_t.shape[0]), dtype=torch.int32)
    for k0 in range(0, a.shape[1], EXACT_F32_K):
        out.add_((fa[:, k0:k0 + EXACT_F32_K] @ fb[:, k0:k0 + EXACT_F32_K].t()).to(torch.int32))
    return out


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                smooth: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token dynamic quant of x [T, K], exact INT8 GEMM with qweight [N, K], dequant -> fp32 [T, N]."""
    check_size(check_tensor(qweight, "qweight", 2, kind="int8"), "qweight", 1, check_tensor(x, "x", 2).shape[1],
               "x's K")
    _check_scale(qweight, w_scale, "w_scale")
    xq, xs = quantize_per_token(x, smooth)
    acc = int8_gemm(xq, qweight)
    return (acc.float() * xs[:, None]) * w_scale.float()[None, :]
