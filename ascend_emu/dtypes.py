"""The dtypes the die works with, as numpy dtypes (bf16 via ``ml_dtypes.bfloat16``), and their short names."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import DTypeError

fp32 = np.dtype(np.float32)
fp16 = np.dtype(np.float16)
bf16 = np.dtype(ml_dtypes.bfloat16)
int8 = np.dtype(np.int8)
uint8 = np.dtype(np.uint8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
uint32 = np.dtype(np.uint32)
fp64 = np.dtype(np.float64)

_BY_NAME = {
    "fp32": fp32, "float32": fp32, "fp16": fp16, "float16": fp16, "half": fp16,
    "bf16": bf16, "bfloat16": bf16, "int8": int8, "uint8": uint8, "int16": int16,
    "int32": int32, "int64": int64, "uint32": uint32, "fp64": fp64, "float64": fp64,
}
_NAMES = {fp32: "fp32", fp16: "fp16", bf16: "bf16", int8: "int8", uint8: "uint8", int16: "int16",
          int32: "int32", int64: "int64", uint32: "uint32", fp64: "fp64"}
FLOATS = (fp32, fp16, bf16)
INTS = (int8, uint8, int16, int32, int64, uint32)


def as_dtype(d, arg: str = "dtype") -> np.dtype:
    """Normalise a name ("bf16"), numpy dtype or torch dtype to the numpy dtype the emulator stores."""
    if isinstance(d, str):
        try:
            return _BY_NAME[d.lower()]
        except KeyError:
            raise DTypeError(f"{arg}={d!r} is not a supported dtype; use one of {sorted(set(_NAMES.values()))}") from None
    if type(d).__module__ == "torch":
        name = str(d).rsplit(".", 1)[-1]
        return as_dtype(name, arg)
    try:
        dt = np.dtype(d)
    except TypeError:
        raise DTypeError(f"{arg}={d!r} is not a dtype") from None
    if dt not in _NAMES:
        raise DTypeError(f"{arg}={dt} is not a supported dtype; use one of {sorted(set(_NAMES.values()))}")
    return dt


def name_of(dt) -> str:
    return _NAMES.get(np.dtype(dt), str(dt))


def is_float(dt) -> bool:
    return np.dtype(dt) in FLOATS or np.dtype(dt) == fp64


def poison(dt) -> float | int:
    """The fill value of fresh core-local storage: NaN for floats, the byte pattern 0x5A.. for integers."""
    dt = np.dtype(dt)
    if dt.kind == "f" or dt == bf16:
        return np.nan
    return int.from_bytes(b"\x5a" * dt.itemsize, "little")


def poison_fill(dt) -> tuple[np.dtype, int]:
    """``poison(dt)``'s bytes as an unsigned integer dtype of ``dt``'s width and its value: filling a view of that
    dtype writes the same bytes at integer speed (numpy fills a bf16 array element by element through ml_dtypes'
    copy function)."""
    dt = np.dtype(dt)
    fill = _POISON_FILLS.get(dt)
    if fill is None:
        uint = np.dtype(f"u{dt.itemsize}")
        fill = _POISON_FILLS[dt] = (uint, int(np.array(poison(dt), dtype=dt).view(uint)))
    return fill


_POISON_FILLS: dict = {}        # dtype -> (unsigned dtype, value)
