"""SmoothQuant (Xiao et al. 2022): migrate activation outliers into the weights, per input channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha),     X' = X diag(s)^-1,    W' = W diag(s)

max|W_j| is over every linear layer that reads X (q/k/v share one s). The division is folded into the preceding
RMSNorm/LayerNorm weight (and bias), so the fp32 function is unchanged; with no norm in front, QuantLinear keeps
``smooth = 1/s`` and ``dynamic_quant`` multiplies it in before quantising (its ``smooth_scales``).
"""
from __future__ import annotations

import torch
from torch import nn

from .checks import check_size, check_tensor
from .errors import QuantError

S_MIN, S_MAX = 1e-5, 1e5


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """act_absmax [K], weights: [N_i, K] each, alpha in [0, 1] -> s [K] fp32 (1 where a channel is all zero)."""
    if not 0.0 <= alpha <= 1.0:
        raise QuantError(f"alpha={alpha}: must be within [0, 1]")
    check_tensor(act_absmax, "act_absmax", 1)
    if act_absmax.numel() and float(act_absmax.min()) < 0:
        raise QuantError(f"act_absmax holds {float(act_absmax.min())}: absolute maxima are >= 0")
    if not weights:
        raise QuantError("weights: give the linear layers that read the input (at least one [N, K] weight)")
    for i, w in enumerate(weights):
        check_size(check_tensor(w.detach(), f"weights[{i}]", 2), f"weights[{i}]", 1, act_absmax.numel(),
                   "act_absmax's K")
    a = act_absmax.double()
    wmax = torch.stack([w.detach().abs().amax(0).double() for w in weights]).amax(0)
    if wmax.shape != a.shape:
        raise QuantError(f"act_absmax has {a.numel()} channels, weights have {wmax.numel()}")
    ok = (a > 0) & (wmax > 0)
    s = torch.ones_like(a)
    s[ok] = a[ok].pow(alpha) / wmax[ok].pow(1.0 - alpha)
    return s.clamp(S_MIN, S_MAX).float()


def fold_into_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """norm.weight /= s (and norm.bias /= s): the norm's output becomes X diag(s)^-1. In place, exact per element
    up to one fp32 rounding."""
    w = getattr(norm, "weight", None)
    if w is None or tuple(w.shape) != tuple(s.shape):
        raise QuantError(f"cannot fold a [{s.numel()}] smooth scale into {type(norm).__name__} with weight "
                         f"{None if w is None else tuple(w.shape)}")
    with torch.no_grad():
        norm.weight.data = (norm.weight.data.double() / s.double()).to(norm.weight.dtype)
        b = getattr(norm, "bias", None)
        if isinstance(b, torch.Tensor):
            norm.bias.data = (b.data.double() / s.double()).to(b.dtype)


def scale_weight(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W diag(s): [N, K] * [K] (a new fp32 tensor; the module's own weight is left alone, it may be tied)."""
    return (w.detach().double() * s.double()[None, :]).float()


def smooth_hessian(h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The Hessian of X diag(s)^-1: diag(1/s) H diag(1/s)."""
    r = 1.0 / s.double()
    return h * r[:, None] * r[None, :]
