"""GPTQ for INT8, symmetric, per output channel (Frantar et al. 2022), on the grid of ``quant.int8``.

Columns are quantised in order (optionally by descending Hessian diagonal: activation order) in blocks of
``block_size``; each column's rounding error is pushed onto the not-yet-quantised columns through the upper Cholesky
factor of the inverse Hessian, within the block at once and onto later blocks lazily (one matmul per block).
Dead columns (an input channel no calibration token touched: H_jj = 0) are kept and rounded to nearest — the reference
implementation zeroes them, which silently deletes weights of rarely-routed experts.
All arithmetic is fp64; the result is deterministic.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .checks import check_tensor
from .errors import CholeskyError, QuantError
from .int8 import QMAX, channel_scales, quantize_weight_rtn


@dataclass
class GPTQResult:
    """qweight int8 [N, K] in [-127, 127]; scale fp32 [N]; damp: the relative damping finally used (fraction of
    mean diag H); escalations: every relative damping that failed before it; dead_columns: count of H_jj == 0."""
    qweight: torch.Tensor
    scale: torch.Tensor
    damp: float
    escalations: list[float] = field(default_factory=list)
    dead_columns: int = 0


def inverse_hessian_cholesky(h: torch.Tensor, damp: float = 0.01, max_escalations: int = 6,
                             name: str = "") -> tuple[torch.Tensor, float, list[float]]:
    """h [K, K] fp64 (dead columns already set to 1 on the diagonal) -> (U upper [K, K] with U^T U = (H + d I)^-1,
    relative damping used, damping values that failed). Damping d = damp * mean(diag H), raised x10 per failure,
    each escalation reported with a warning; CholeskyError after ``max_escalations``."""
    if not damp > 0:
        raise QuantError(f"damp={damp}: must be > 0 (fraction of the mean Hessian diagonal)")
    mean_diag = float(torch.diagonal(h).mean())
    failed: list[float] = []
    rel = damp
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    for _ in range(max_escalations + 1):
        l, info = torch.linalg.cholesky_ex(h + rel * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            u, info2 = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info2) == 0 and torch.isfinite(u).all():
                if failed:
                    warnings.warn(f"GPTQ {name or 'layer'}: Cholesky failed at damp {failed}, used damp={rel:g}",
                                  RuntimeWarning, stacklevel=3)
                return u, rel, failed
        failed.append(rel)
        rel *= 10
    raise CholeskyError(f"GPTQ {name or 'layer'}: damped Hessian not positive definite after "
                        f"max_escalations={max_escalations} (damp tried {failed})")


@dataclass
class HessianFactor:
    """What GPTQ needs from a Hessian, computed once and shared by every layer reading the same input.
    u: upper Cholesky factor of (H + d I)^-1 [K, K] fp64 (numpy), in ``perm`` order; perm: column order (None =
    natural); damp / escalations / dead_columns as in GPTQResult."""
    u: np.ndarray
    perm: torch.Tensor | None
    damp: float
    escalations: list
    dead_columns: int
    all_dead: bool = False


def factor_hessian(hessian: torch.Tensor, *, damp: float = 0.01, act_order: bool = False, max_escalations: int = 6,
                   name: str = "") -> HessianFactor:
    """hessian [K, K] (2/n X^T X) -> HessianFactor. Dead columns (H_jj = 0) get H_jj = 1: their rows and columns
    of H are zero, so no error propagates to or from them and they end up rounded to nearest."""
    check_tensor(hessian, "hessian", 2)
    k = hessian.shape[0]
    if hessian.shape[1] != k:
        raise QuantError(f"hessian must be square [K, K], got {tuple(hessian.shape)}")
    H = hessian.detach().double().clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    if bool(dead.all()):
        return HessianFactor(np.eye(k), None, damp, [], k, True)
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        H = H[perm][:, perm]
    U, used, failed = inverse_hessian_cholesky(H, damp, max_escalations, name)
    return HessianFactor(U.numpy(), perm, used, failed, int(dead.sum()))


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor | None = None, *, scale: torch.Tensor | None = None,
                  block_size: int = 128, damp: float = 0.01, act_order: bool = False, max_escalations: int = 6,
                  name: str = "", factor: HessianFactor | None = None) -> GPTQResult:
    """w [N, K] float, hessian [K, K] (2/n X^T X of the layer's inputs) -> GPTQResult.

    scale: per-channel fp32 [N] (default max|w_i| / 127, i.e. no clipping; pass ``search.search_clip``'s to clip).
    block_size: columns per lazy-update block. act_order: process columns by descending H_jj.
    factor: a ``factor_hessian`` result to reuse instead of ``hessian`` (rows are independent given H, so layers
    sharing an input may also be stacked along N into one call)."""
    n, k = check_tensor(w, "w", 2).shape
    if block_size < 1:
        raise QuantError(f"block_size={block_size}: must be >= 1")
    if factor is None:
        if hessian is None:
            raise QuantError("gptq_quantize: pass hessian [K, K] or factor")
        if tuple(hessian.shape) != (k, k):
            raise QuantError(f"hessian shape {tuple(hessian.shape)} must be [K, K] = [{k}, {k}] for w [{n}, {k}]")
        factor = factor_hessian(hessian, damp=damp, act_order=act_order, max_escalations=max_escalations, name=name)
    elif factor.u.shape != (k, k):
        raise QuantError(f"factor is for K={factor.u.shape[0]}, w has K={k}")
    scale = channel_scales(w) if scale is None else check_tensor(scale, "scale", 1).float()
    if tuple(scale.shape) != (n,):
        raise QuantError(f"scale shape {tuple(scale.shape)} must be [N] = [{n}]")
    if n and not bool((scale > 0).all()):
        raise QuantError(f"scale holds {float(scale.min())}: per-channel scales must be > 0")
    if factor.all_dead:
        return GPTQResult(quantize_weight_rtn(w, scale), scale, factor.damp, [], factor.dead_columns)
    Wt = w.detach().double()
    if factor.perm is not None:
        Wt = Wt[:, factor.perm]
    Wt = Wt.t().contiguous().numpy().copy()            # [K, N]: a column of W is a contiguous row here
    U = factor.u
    sv = scale.double().numpy()
    Qt = np.empty((k, n), dtype=np.float64)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = Wt[i1:i2]                                  # a view: updated in place
        E1 = np.empty_like(W1)
        for i in range(i2 - i1):
            col = W1[i]
            q = np.clip(np.rint(col / sv), -QMAX, QMAX)
            Qt[i1 + i] = q
            err = (col - q * sv) / U[i1 + i, i1 + i]
            E1[i] = err
            if i + 1 < i2 - i1:
                W1[i + 1:] -= np.outer(U[i1 + i, i1 + i + 1:i2], err)
        if i2 < k:
            Wt[i2:] -= U[i1:i2, i2:].T @ E1            # lazy batch update of the later blocks
    q = torch.from_numpy(Qt.T.copy()).to(torch.int8)
    if factor.perm is not None:
        q = q[:, torch.argsort(factor.perm)]
    return GPTQResult(q.contiguous(), scale, factor.damp, list(factor.escalations), factor.dead_columns)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor, ref_energy: float | None = None
                 ) -> float:
    """Relative output error ||X W^T - X W_hat^T||_F / ||X W^T||_F from H ~ X^T X (any positive factor).
    fp32 products summed in fp64 (a relative metric: fp32 is plenty). ref_energy: tr(W H W^T) if already known."""
    H = hessian.float()
    D = w.float() - w_hat.float()
    num = float(((D @ H).double() * D.double()).sum())
    den = output_energy(w, H) if ref_energy is None else ref_energy
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0


def output_energy(w: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(W H W^T) = ||X W^T||_F^2 (up to H's factor)."""
    W = w.float()
    return float(((W @ hessian.float()).double() * W.double()).sum())
