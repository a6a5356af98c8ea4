"""The library's RoPE convention, and torch helpers to produce and check it.

Convention (used by every kernel in ``kernels``: mla_prolog writes it, attention reads it)
-----------------------------------------------------------------------------------------
DeepSeek-V3's reference rotates *interleaved pairs*: element pair ``(x[2i], x[2i+1])`` turns by angle
``theta_i = pos * base^(-2i/Dr)`` (``torch.view_as_complex`` over the last dimension).

The MLA prolog (as torch_npu's ``npu_mla_prolog_v3``) instead stores the rope dimensions *de-interleaved*: even
elements first, then odd elements, ``x' = cat(x[0::2], x[1::2])``, and rotates halves::

    out' = x' * cos + rotate_half(x') * sin,   rotate_half(x') = cat(-x'[h:], x'[:h]),   h = Dr / 2
    sin = cat(sin(theta), sin(theta)),  cos = cat(cos(theta), cos(theta))          # rope_sin / rope_cos [T, Dr]

so ``out' == deinterleave(reference_out)``: the same numbers in even/odd order. The de-interleave itself is done
once, offline, on the weight columns that produce the rope dimensions (``deinterleave_rope_columns``), exactly as
deployments of torch_npu's fused op permute DeepSeek checkpoints; the kernel only rotates halves. Queries and keys
are both in this order, so q_rope . k_rope (attention scores) is unchanged by it.
"""
from __future__ import annotations

import torch


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Last dim: interleaved pairs -> evens then odds (``cat(x[..., 0::2], x[..., 1::2])``)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def interleave(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``deinterleave``."""
    h = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., :h]
    out[..., 1::2] = x[..., h:]
    return out


def rope_angles(positions, rope_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta [T, Dr/2] (fp64) for integer ``positions`` [T]: pos * base^(-2i/Dr). (DeepSeek-V3 applies YaRN
    correction to these frequencies; any angles work with the kernels, so tests use the plain ones.)"""
    pos = torch.as_tensor(positions, dtype=torch.float64).reshape(-1, 1)
    inv = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    return pos * inv[None, :]


def rope_sin_cos(theta: torch.Tensor, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_sin, rope_cos [T, Dr] = cat(f, f) in ``dtype`` (the prolog's inputs)."""
    s, c = torch.sin(theta), torch.cos(theta)
    return torch.cat([s, s], -1).to(dtype), torch.cat([c, c], -1).to(dtype)


def rope_rotate_half(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The prolog's rotation (fp32 math) of de-interleaved ``x`` [..., Dr] with cat(f, f) ``sin``/``cos``
    broadcast against it."""
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return xf * cos.float() + rot * sin.float()


def rope_interleaved(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 reference rotation (complex pairs, fp32), ``theta`` broadcast to [..., Dr/2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    f = torch.polar(torch.ones_like(theta, dtype=torch.float32), theta.float())
    return torch.view_as_real(xc * f).flatten(-2)


def deinterleave_rope_columns(w: torch.Tensor, group: int, rope_dim: int) -> torch.Tensor:
    """Permute the output columns of a weight [K, groups * group] so that, in every group of ``group`` columns,
    the last ``rope_dim`` ones (the rope dimensions) come out even-then-odd. ``group`` = D + Dr for
    weight_uq_qr (per head), Hckv + Dr for weight_dkv_kr (one group)."""
    k, n = w.shape
    if n % group or rope_dim > group or rope_dim % 2:
        raise ValueError(f"weight with {n} columns does not split into groups of {group} ending in an even "
                         f"rope_dim {rope_dim}")
    g = w.reshape(k, n // group, group)
    rope = deinterleave(g[..., group - rope_dim:])
    return torch.cat([g[..., :group - rope_dim], rope], -1).reshape(k, n)
