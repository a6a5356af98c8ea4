"""ND <-> NZ (fractal) layout helpers.

NZ stores an (M, N) matrix padded to (M1*16, N1*N0) as an array of shape (N1, M1, 16, N0), with N0 = 32 bytes /
element size (16 for fp16/bf16, 32 for int8, 8 for fp32): column blocks of N0 elements, each a column of 16-row
fractals. This is the layout the cube unit reads, and the layout weights are often shipped in (``FRACTAL_NZ``).
Padding is zero. Leading batch dimensions (e.g. experts) are kept.
"""
from __future__ import annotations

import numpy as np

from .errors import ShapeError

M0 = 16


def n0_of(dtype) -> int:
    """Elements per 32-byte fractal row for ``dtype``."""
    return 32 // np.dtype(dtype).itemsize


def nz_shape(shape, dtype) -> tuple:
    """NZ shape of an ND array of ``shape`` (..., M, N)."""
    if len(shape) < 2:
        raise ShapeError(f"NZ layout needs a matrix, got shape {tuple(shape)}")
    *batch, m, n = shape
    n0 = n0_of(dtype)
    return (*batch, -(-n // n0), -(-m // M0), M0, n0)


def nd_to_nz(a: np.ndarray) -> np.ndarray:
    """(..., M, N) -> (..., N1, M1, 16, N0), zero padded."""
    a = np.asarray(a)
    *batch, m, n = a.shape
    n1, m1, _, n0 = nz_shape(a.shape, a.dtype)[-4:]
    padded = np.zeros((*batch, m1 * M0, n1 * n0), dtype=a.dtype)
    padded[..., :m, :n] = a
    nb = len(batch)
    blocks = padded.reshape(*batch, m1, M0, n1, n0)
    order = tuple(range(nb)) + (nb + 2, nb, nb + 1, nb + 3)
    return np.ascontiguousarray(blocks.transpose(order))


def nz_to_nd(nz: np.ndarray, shape) -> np.ndarray:
    """(..., N1, M1, 16, N0) -> (..., M, N) with ``shape`` the original (..., M, N)."""
    nz = np.asarray(nz)
    *batch, m, n = shape
    expect = nz_shape(shape, nz.dtype)
    if tuple(nz.shape) != tuple(expect):
        raise ShapeError(f"NZ array of shape {tuple(nz.shape)} does not hold an ND {tuple(shape)} "
                         f"{nz.dtype} matrix (expected {expect})")
    nb = len(batch)
    n1, m1, _, n0 = expect[-4:]
    order = tuple(range(nb)) + (nb + 1, nb + 2, nb, nb + 3)
    full = nz.transpose(order).reshape(*batch, m1 * M0, n1 * n0)
    return np.ascontiguousarray(full[..., :m, :n])
