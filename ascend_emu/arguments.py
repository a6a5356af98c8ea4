"""Checks of what users pass at the API boundary: integers, die lists, core lists, shapes.

One place for them, so every entry point (``Pod``, streams, communicators, kernel groups) accepts and rejects the same
things with the same words: a die id is an integer, never a float that happens to truncate to one, a bool or a
string; a die list names each die once. Errors name the argument and the limit.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .errors import AddressError, ArgumentError, ShapeError


def is_int(value) -> bool:
    """A Python or numpy integer (bools excluded: ``True`` is not a die id or a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value, arg: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``low..high`` (inclusive, each optional); ArgumentError naming ``arg`` otherwise."""
    if not is_int(value):
        raise ArgumentError(f"{arg}={value!r}: must be an integer, got {type(value).__name__}")
    v = int(value)
    if (low is not None and v < low) or (high is not None and v > high):
        lo = "" if low is None else f"{low}"
        hi = "" if high is None else f"{high}"
        raise ArgumentError(f"{arg}={v} out of range {lo}..{hi}")
    return v


def _sequence(value, arg: str, what: str = "a list of integers") -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Iterable, np.ndarray)):
        raise ArgumentError(f"{arg}={value!r}: must be {what}, got {type(value).__name__}")
    return list(np.asarray(value).reshape(-1).tolist() if isinstance(value, np.ndarray) else value)


def check_die(die, num_dies: int, arg: str = "die") -> int:
    """One die id of a pod of ``num_dies`` dies: AddressError when it does not exist."""
    if not is_int(die):
        raise AddressError(f"{arg}={die!r}: a die id is an integer, got {type(die).__name__}")
    if not 0 <= die < num_dies:
        raise AddressError(f"die {die} out of range: this pod has dies 0..{num_dies - 1}")
    return int(die)


def check_dies(dies, num_dies: int | None = None, arg: str = "dies") -> list[int]:
    """A non-empty list of distinct die ids (each in ``0..num_dies - 1`` when ``num_dies`` is given, else >= 0).

    ArgumentError for a non-list, a non-integer, an empty list or a die listed twice (two ranks on one die would
    share its cores and memory); AddressError for a die the pod does not have."""
    items = _sequence(dies, arg)
    if not items:
        raise ArgumentError(f"{arg}=[]: needs at least one die")
    out = []
    for d in items:
        if not is_int(d):
            raise ArgumentError(f"{arg}={items!r}: die ids are integers, got {d!r}")
        if num_dies is not None:
            out.append(check_die(d, num_dies, arg))
        elif d < 0:
            raise AddressError(f"{arg}={items!r}: die {d} is negative")
        else:
            out.append(int(d))
    if len(set(out)) != len(out):
        twice = next(d for d in out if out.count(d) > 1)
        raise ArgumentError(f"{arg}={out}: die {twice} is listed twice; each die may appear once")
    return out


def check_cores(spec, total: int, kind: str) -> list[int]:
    """Core indices of one kind on a die with ``total`` of them: None (all), a count ``0..total``, or a list of
    distinct indices ``0..total - 1``. AddressError names the kind and the limit."""
    if spec is None:
        return list(range(total))
    if is_int(spec):
        if not 0 <= spec <= total:
            raise AddressError(f"{kind}={spec}: a die has {total} {kind.upper()} cores")
        return list(range(int(spec)))
    items = _sequence(spec, kind, "a core count or a list of core indices (integers)")
    bad = [i for i in items if not is_int(i)]
    if bad:
        raise ArgumentError(f"{kind}={spec!r}: a core count or a list of core indices (integers), got {bad[0]!r}")
    idx = [int(i) for i in items]
    out = [i for i in idx if not 0 <= i < total]
    if out:
        raise AddressError(f"{kind} core {out[0]} out of range 0..{total - 1}")
    if len(set(idx)) != len(idx):
        raise AddressError(f"{kind} cores {idx} list a core twice")
    return idx


def check_shape(shape, arg: str = "shape") -> tuple[int, ...]:
    """A shape: an int or a sequence of non-negative ints (a float like 2.5 is refused, not truncated)."""
    if type(shape) is tuple:      # the common case, checked without the generic path's ABC test and copies
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    if is_int(shape):
        dims = [shape]
    else:
        if isinstance(shape, (str, bytes)) or not isinstance(shape, (Iterable, np.ndarray)):
            raise ShapeError(f"{arg}={shape!r}: a shape is an int or a sequence of ints")
        dims = list(shape)
    bad = [d for d in dims if not is_int(d)]
    if bad:
        raise ShapeError(f"{arg}={shape!r}: dimensions are integers, got {bad[0]!r}")
    if any(d < 0 for d in dims):
        raise AddressError(f"{arg} {tuple(int(d) for d in dims)} has a negative dimension")
    return tuple(int(d) for d in dims)


def check_us(value, arg: str, *, positive: bool = False, none_ok: bool = True) -> float | None:
    """A simulated time or duration in microseconds: a finite real number, >= 0 (``positive``: > 0); None when
    ``none_ok`` (no bound / now)."""
    if value is None and none_ok:
        return None
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{arg}={value!r}: must be a number of microseconds"
                            f"{' or None' if none_ok else ''}")
    v = float(value)
    if not np.isfinite(v) or v < 0 or (positive and v == 0):
        raise ArgumentError(f"{arg}={value!r}: must be a finite number {'> 0' if positive else '>= 0'}"
                            f"{' (None: unbounded)' if none_ok and positive else ''}")
    return v
