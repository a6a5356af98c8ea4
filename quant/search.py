"""Offline searches: the SmoothQuant/AWQ-style migration scale and block-level weight clipping.

- ``search_smooth_scale``: s* = argmin_s sum_l ||Q(W_l s)(s^-1 X) - W_l X||^2 / ||W_l X||^2 over the family
  s(alpha) = max|X_j|^alpha / max|W_j|^(1-alpha) for alpha on a grid, *including no smoothing* (s = 1), with W8A8
  (per-token activations, per-channel RTN weights) measured on a sample of calibration rows. A per-layer alpha search;
  ``search_joint_smooth_scale`` is the same for several inputs that must share one s (one norm, several calls).
- ``search_clip``: per block of ``block_rows`` output channels, the clip factor c (scale = c max|w_i| / 127) from a
  grid minimising the block's output error tr(D H D^T), D = W - Q_c(W), H the layer's Hessian (no rows needed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_tensor
from .errors import QuantError
from .int8 import channel_scales, dequantize_weight, quantize_weight_rtn, w8a8_matmul
from .smoothquant import scale_weight, smooth_scales

DEFAULT_ALPHAS = (None, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
DEFAULT_CLIPS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75)


@dataclass
class ScaleSearch:
    """alpha: the winner (None = no smoothing); s: its [K] fp32 scale; errors: alpha -> summed relative error."""
    alpha: float | None
    s: torch.Tensor
    errors: dict


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor | None, refs: list | None = None
               ) -> float:
    """Sum over layers of ||Q(W s)(s^-1 X) - W X||^2 / ||W X||^2 on rows x [S, K] (RTN weights). refs: the fp32
    outputs x @ W^T per layer, if already computed."""
    total = 0.0
    xs = x if s is None else x / s[None, :]
    for i, w in enumerate(weights):
        ws = w.detach().float() if s is None else scale_weight(w, s)
        sc = channel_scales(ws)
        y = w8a8_matmul(xs, quantize_weight_rtn(ws, sc), sc)
        ref = refs[i] if refs is not None else x.float() @ w.detach().float().t()
        den = float((ref.double() ** 2).sum())
        total += float(((y - ref).double() ** 2).sum()) / den if den > 0 else 0.0
    return total


def search_smooth_scale(x: torch.Tensor, weights: list[torch.Tensor], act_absmax: torch.Tensor,
                        alphas=DEFAULT_ALPHAS) -> ScaleSearch:
    """x [S, K] calibration rows, weights [N_i, K] reading them, act_absmax [K] over all calibration tokens.
    Ties go to the earlier candidate (None first: smoothing must earn its place)."""
    return search_joint_smooth_scale([(x, weights)], act_absmax, alphas)


def search_joint_smooth_scale(inputs: list, act_absmax: torch.Tensor, alphas=DEFAULT_ALPHAS) -> ScaleSearch:
    """One scale for several inputs that must share it (the outputs of one norm module called more than once,
    each read by its own linear layers): ``inputs`` = [(x [S_i, K] rows, [W [N, K], ...] reading them), ...];
    ``act_absmax`` [K] over every input's tokens. s(alpha) takes the max over every input's weights; the error is
    summed over all inputs. Inputs without rows count for the scale, not the error."""
    alphas = tuple(alphas)
    if not alphas:
        raise QuantError("alphas is empty: give at least one candidate (None = no smoothing)")
    measured = [(x.float(), ws) for x, ws in inputs if x.shape[0]]
    if not measured:
        raise QuantError("search_smooth_scale: x has no rows")
    every = [w for _, ws in inputs for w in ws]
    refs = [[x @ w.detach().float().t() for w in ws] for x, ws in measured]
    errors, best = {}, None
    for a in alphas:
        s = None if a is None else smooth_scales(act_absmax, every, a)
        e = sum(w8a8_error(x, ws, s, r) for (x, ws), r in zip(measured, refs))
        errors[a] = e
        if best is None or e < best[0]:
            best = (e, a, s)
    _, a, s = best
    return ScaleSearch(a, torch.ones(act_absmax.numel()) if s is None else s, errors)


def search_clip(w: torch.Tensor, hessian: torch.Tensor, block_rows: int = 32, clips=DEFAULT_CLIPS
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K], hessian [K, K] -> (scale fp32 [N], clip factor per block fp32 [ceil(N / block_rows)]).
    Each block of rows takes the clip factor of ``clips`` with the lowest sum of row errors e_i = d_i H d_i^T."""
    if block_rows < 1:
        raise QuantError(f"block_rows={block_rows}: must be >= 1")
    check_tensor(w, "w", 2)
    check_tensor(hessian, "hessian", 2)
    if tuple(hessian.shape) != (w.shape[1],) * 2:
        raise QuantError(f"hessian shape {tuple(hessian.shape)} must be [K, K] = [{w.shape[1]}, {w.shape[1]}]")
    clips = tuple(float(c) for c in clips)
    if not clips or not all(0 < c <= 1 for c in clips):
        raise QuantError(f"clips={clips}: need at least one factor, each in (0, 1]")
    n = w.shape[0]
    H = hessian.float()
    wf = w.detach().float()
    nb = -(-n // block_rows)
    pad = nb * block_rows - n
    errs = []
    for c in clips:
        sc = channel_scales(wf, c)
        d = wf - dequantize_weight(quantize_weight_rtn(wf, sc), sc)
        row = ((d @ H) * d).sum(1).double()
        errs.append(torch.nn.functional.pad(row, (0, pad)).reshape(nb, block_rows).sum(1))
    pick = torch.stack(errs).argmin(0)                  # first minimum: prefers the larger clip on ties
    factor = torch.tensor(clips, dtype=torch.float32)[pick]
    per_row = factor.repeat_interleave(block_rows)[:n]
    return channel_scales(wf, per_row), factor
