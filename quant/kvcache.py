"""INT8 KV cache for the non-RoPE MLA latent (c_kv); the RoPE part (k_rope) stays in bf16.

Two granularities:
- per token (dynamic): scale [T] = max_c |k_c[t]| / 127, q = round_half_even(k_c / scale); computed as rows arrive.
- per channel (static): scale [C] = max_t |k_c[t, c]| / 127 over calibration tokens, stored as the multiplier
  ``quant_scale = 127 / max`` that ``kernels.mla_prolog`` takes as ``quant_scale_ckv`` (stored = rint(k_c *
  quant_scale) saturated); dequantise with ``1 / quant_scale``. Rows beyond the calibrated range saturate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_tensor
from .errors import QuantError
from .int8 import QMAX, quantize_per_token

MODES = ("token", "channel")


@dataclass
class KVQuant:
    """q int8 [..., C]; scale fp32 (the dequant factor): [...] per token or [C] per channel; mode 'token' /
    'channel'."""
    q: torch.Tensor
    scale: torch.Tensor
    mode: str

    def dequantize(self) -> torch.Tensor:
        """fp32 [..., C]."""
        s = self.scale[..., None] if self.mode == "token" else self.scale
        return self.q.float() * s


def channel_quant_scale(calib_latent: torch.Tensor) -> torch.Tensor:
    """calib_latent [..., C] -> quant_scale_ckv fp32 [C] = 127 / max |k_c| (1 for an all-zero channel)."""
    check_tensor(calib_latent, "calib_latent")
    amax = calib_latent.detach().float().reshape(-1, calib_latent.shape[-1]).abs().amax(0)
    return torch.where(amax > 0, QMAX / amax, torch.ones_like(amax))


def quantize_latent(latent: torch.Tensor, mode: str = "token", quant_scale: torch.Tensor | None = None) -> KVQuant:
    """latent [..., C] (the non-RoPE part only) -> KVQuant. mode 'token': dynamic per-token scales. mode 'channel':
    ``quant_scale`` [C] from ``channel_quant_scale`` (default: from ``latent`` itself)."""
    if mode not in MODES:
        raise QuantError(f"mode={mode!r}: use one of {MODES}")
    if check_tensor(latent, "latent").ndim < 1:
        raise QuantError("latent must have a channel dim [..., C]")
    c = latent.shape[-1]
    if mode == "token":
        q, s = quantize_per_token(latent.reshape(-1, c))
        return KVQuant(q.reshape(latent.shape), s.reshape(latent.shape[:-1]), mode)
    qs = channel_quant_scale(latent) if quant_scale is None else check_tensor(quant_scale, "quant_scale").float()
    if tuple(qs.shape) != (c,):
        raise QuantError(f"quant_scale shape {tuple(qs.shape)} must be [C] = [{c}]")
    if c and not bool((qs > 0).all()):
        raise QuantError(f"quant_scale holds {float(qs.min())}: multipliers must be > 0")
    q = torch.round(latent.float() * qs).clamp(-128, 127).to(torch.int8)
    return KVQuant(q, (1.0 / qs.double()).float(), mode)


def quantize_kv(kv: torch.Tensor, rope_dim: int, mode: str = "token", quant_scale: torch.Tensor | None = None
                ) -> tuple[KVQuant, torch.Tensor]:
    """kv [..., C + rope_dim] = [latent | k_rope] -> (KVQuant of the latent, k_rope in bf16)."""
    if check_tensor(kv, "kv").ndim < 1:
        raise QuantError("kv must have a channel dim [..., C + rope_dim]")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 <= rope_dim < kv.shape[-1]:
        raise QuantError(f"rope_dim={rope_dim!r}: an integer in [0, {kv.shape[-1]}) for a last dim of {kv.shape[-1]}")
    c = kv.shape[-1] - rope_dim
    return quantize_latent(kv[..., :c], mode, quant_scale), kv[..., c:].to(torch.bfloat16)
