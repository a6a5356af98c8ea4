"""Argument checks at quant's API boundary: tensor type, rank, dtype kind, matching sizes and finite values.

Every quantiser here derives a scale from a max: one NaN or inf makes the whole row's (or channel's) scale NaN/inf and
its INT8 values meaningless, so non-finite inputs raise ``QuantError`` naming the argument and the first position
instead of quantising to garbage.
"""
from __future__ import annotations

import torch

from .errors import QuantError


def check_tensor(t, name: str, ndim: int | None = None, kind: str = "float", finite: bool = True) -> torch.Tensor:
    """``t`` must be a torch tensor of ``ndim`` dims (None: any), of a floating dtype (``kind="float"``) or int8
    (``kind="int8"``), holding only finite values when ``finite``. Returns it unchanged."""
    if not isinstance(t, torch.Tensor):
        raise QuantError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise QuantError(f"{name} has shape {tuple(t.shape)}: expected {ndim} dims")
    if kind == "float" and not t.dtype.is_floating_point:
        raise QuantError(f"{name} is {t.dtype}: expected a floating dtype")
    if kind == "int8" and t.dtype != torch.int8:
        raise QuantError(f"{name} is {t.dtype}: expected torch.int8")
    if finite and kind == "float" and t.numel():
        bad = ~torch.isfinite(t)
        if bad.any():
            at = tuple(int(i) for i in bad.nonzero()[0])
            raise QuantError(f"{name} holds {t[at].item()} at {at if len(at) != 1 else at[0]}: quantisation needs "
                             f"finite values (a max over a NaN or inf is no scale)")
    return t


def check_size(t: torch.Tensor, name: str, dim: int, size: int, what: str) -> None:
    """``t.shape[dim] == size``, else a QuantError naming ``name`` and ``what`` the size must match."""
    if t.shape[dim] != size:
        raise QuantError(f"{name} has shape {tuple(t.shape)}: dim {dim} must be {size} ({what})")
