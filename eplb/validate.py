"""Input checks at eplb's API boundary. Every public entry runs its arguments through these before any numba code
sees them: numba kernels index without bounds checks, so an out-of-range id or a short array would read or write
outside its buffer (a segfault or a corrupted heap) instead of failing. Each check raises ``EplbError`` naming the
argument and the limit it broke.
"""
from __future__ import annotations

import numbers

import numpy as np

from .errors import EplbError


def _host_array(value, name: str) -> np.ndarray:
    if hasattr(value, "detach"):                       # a torch tensor (any device, any grad state)
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:               # ragged nested lists and the like
        raise EplbError(f"{name} is not an array ({e})") from None


def integer(value, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """A Python int in [low, high] (bools and non-integral numbers are rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EplbError(f"{name}={value!r} must be an int")
    value = int(value)
    if low is not None and value < low:
        raise EplbError(f"{name}={value} must be >= {low}")
    if high is not None and value > high:
        raise EplbError(f"{name}={value} must be <= {high}")
    return value


def positive(value, name: str) -> int:
    return integer(value, name, low=1)


def finite_float(value, name: str, *, low: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(float(value)):
        raise EplbError(f"{name}={value!r} must be a finite number")
    value = float(value)
    if low is not None and value < low:
        raise EplbError(f"{name}={value} must be >= {low}")
    return value


def int_array(value, name: str, *, ndim: int | tuple | None = None, low: int | None = None,
              high: int | None = None) -> np.ndarray:
    """int64 copy of an integer-valued array (floats must hold whole numbers) with values in [low, high]."""
    a = _host_array(value, name)
    if a.dtype.kind == "b" or a.dtype.kind not in "iuf":
        raise EplbError(f"{name} must hold integers, got dtype {a.dtype}")
    if ndim is not None and a.ndim not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise EplbError(f"{name} must have {ndim} dims, got shape {a.shape}")
    if a.dtype.kind == "f":
        if a.size and not (np.isfinite(a).all() and (a == np.round(a)).all()):
            raise EplbError(f"{name} must hold whole numbers, got non-integral values")
        if a.size and np.abs(a).max() >= 2.0 ** 62:
            raise EplbError(f"{name} holds values beyond the int64 range")
    out = a.astype(np.int64)
    if out.size and low is not None and out.min() < low:
        raise EplbError(f"{name} holds {out.min()}, below the smallest allowed value {low}")
    if out.size and high is not None and out.max() > high:
        raise EplbError(f"{name} holds {out.max()}, above the largest allowed value {high}")
    return out


def loads(weight, name: str = "weight") -> np.ndarray:
    """[layers, experts] or [slices, layers, experts] (numpy, torch, lists) -> float64 [slices, layers, experts],
    finite and >= 0, at least one layer and one expert."""
    w = _host_array(weight, name)
    if w.dtype.kind not in "iuf" or w.dtype.kind == "b":
        raise EplbError(f"{name} must hold numbers, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise EplbError(f"{name} must be [layers, experts] or [slices, layers, experts], got shape {w.shape}")
    if 0 in w.shape:
        raise EplbError(f"{name} has an empty dimension, shape {w.shape}")
    if not np.isfinite(w).all():
        raise EplbError(f"{name} holds NaN or inf")
    if w.min() < 0:
        raise EplbError(f"{name} holds a negative load ({w.min()}); loads are token counts >= 0")
    return w


def layout(phy2log, name: str, *, num_experts: int | None = None, num_layers: int | None = None,
           num_slots: int | None = None) -> np.ndarray:
    """phy2log-like [layers, slots] int64: the logical expert of each slot, -1 = empty; ids below ``num_experts``."""
    a = int_array(phy2log, name, ndim=2)
    bad = (a < -1) if num_experts is None else ((a < -1) | (a >= num_experts))
    if bad.any():
        layer, slot = np.argwhere(bad)[0]
        limit = "" if num_experts is None else f"..{num_experts - 1} ({num_experts} logical experts)"
        raise EplbError(f"{name}[{layer}, {slot}] holds expert id {a[layer, slot]}; ids must lie in -1{limit} "
                        f"(-1 = empty slot)")
    if num_layers is not None and a.shape[0] != num_layers:
        raise EplbError(f"{name} has {a.shape[0]} layers, expected {num_layers} (shape {a.shape})")
    if num_slots is not None and a.shape[1] != num_slots:
        raise EplbError(f"{name} has {a.shape[1]} slots, expected {num_slots} (shape {a.shape})")
    if a.shape[1] == 0:
        raise EplbError(f"{name} has no slots (shape {a.shape})")
    return a
