"""Bit-exact numerics for the emulator's cast and vector data paths.

Dtypes
------
At the API boundary arrays are plain numpy arrays:

* ``np.float32``, ``np.float16`` and ``ml_dtypes.bfloat16`` for floats,
* ``np.int8``, ``np.uint8``, ``np.int16``, ``np.int32`` for integers
  (``np.int64`` and ``np.float64`` are accepted as *sources* only).

Inside the Numba kernels every narrow float is handled as its raw bit pattern
(``uint16`` for fp16/bf16, ``uint32``/``uint64`` for fp32/fp64), and rounding is
done with integer arithmetic.  That is what makes every rounding mode available:
numpy, ml_dtypes and the FPU conversion instructions only round half to even.

Rounding modes
--------------
``ROUND_MODES`` mirrors Ascend C ``RoundMode``:

=========  ==============  ===========================================
name       Ascend C        meaning
=========  ==============  ===========================================
``rint``   ``CAST_RINT``   nearest, ties to even (IEEE default)
``floor``  ``CAST_FLOOR``  toward -inf
``ceil``   ``CAST_CEIL``   toward +inf
``round``  ``CAST_ROUND``  nearest, ties away from zero
``trunc``  ``CAST_TRUNC``  toward zero
``odd``    ``CAST_ODD``    von Neumann: truncate, set the LSB if inexact
=========  ==============  ===========================================

Float -> float rounding follows IEEE 754 including overflow: a finite value too
large for the target becomes inf under ``rint``/``round`` and when the mode
rounds away from zero in that direction (``ceil`` for positives, ``floor`` for
negatives); otherwise (``trunc``, ``odd``, the opposite directed mode) it
becomes the largest finite value.  Inf stays inf and the sign of zero is kept.
A NaN becomes the target's canonical quiet NaN with its sign kept and its
payload dropped (bf16 0x7FC0 / 0xFFC0, fp16 0x7E00 / 0xFE00).  For every
non-NaN input, fp32 -> bf16 with ``rint`` is bit-identical to
``torch.Tensor.to(torch.bfloat16)`` and fp32 -> fp16 to ``.to(torch.float16)``;
for NaN only NaN-ness matches: torch's NaN bits depend on which of its code
paths runs (on x86 its vectorised fp32 -> bf16 gives 0xFFFF for every NaN, its
scalar one 0x7FC0; its fp16 conversion keeps the payload's top bits), so
compare NaNs as NaNs.

Float -> integer applies the mode to the value, saturates to the integer range
and maps NaN to 0; ``odd`` sets the LSB of the magnitude (-2.5 -> -3, 3.5 -> 3).  Integer -> float goes through float64 (exact for every
supported source except int64 beyond 2**53) and then rounds with the mode.
Integer -> integer saturates.

Quantisation
------------
``quant_int8_rows`` is symmetric per-row int8 quantisation:
``scale = max|x| / 127`` and ``q = rint(x / scale)`` clamped to [-128, 127], all
in fp32.  A row whose ``scale`` is 0 (all zeros, or so tiny that ``max/127``
underflows) is divided by 1 instead, which yields ``q == 0`` and keeps
``scale == 0`` so dequantisation gives exact zeros; this matches the torch
reference ``x / torch.where(s == 0, 1, s)``.
"""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np

__all__ = ["ROUND_MODES", "cast", "cast_into", "quant_int8_rows", "quant_int8_rows_into", "dequant_int8_rows",
           "round_to", "transpose_into"]

ROUND_MODES = ("rint", "floor", "ceil", "round", "trunc", "odd")

_RINT = 0  # index into ROUND_MODES, which is also the kernels' mode id
_MODE_ID = {name: i for i, name in enumerate(ROUND_MODES)}

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

# (exponent bits, mantissa bits) of the float formats we round *to*.
_FLOAT_FMT = {_F32: (8, 23), _F16: (5, 10), _BF16: (8, 7)}
_NARROW_FLOATS = (_F16, _BF16)
_INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32))
_SRC_ONLY = (np.dtype(np.int64), _F64)
_SRC_DTYPES = (_F32, _F16, _BF16) + _INT_DTYPES + _SRC_ONLY
_DST_DTYPES = (_F32, _F16, _BF16) + _INT_DTYPES


# --------------------------------------------------------------------------- kernels


@numba.njit(cache=True)
def _mode_flags(mode):
    """Per-mode constants that turn rounding into one carry-propagating add.

    Rounding r = m >> sh up by one is ``(rem + addv) >> sh`` with
    addv = half - 1 + lsb (rint), half (round), mask toward the rounding
    direction (floor/ceil), 0 (trunc/odd); odd ORs the sticky bit in instead.
    Expressed as flags so the element loop has no data-dependent branches and
    LLVM can vectorise it.
    """
    use_half = 1 if (mode == 0 or mode == 3) else 0
    lsb = 1 if mode == 0 else 0
    dir_neg = 1 if mode == 1 else 0
    dir_pos = 1 if mode == 2 else 0
    odd = 1 if mode == 5 else 0
    # IEEE overflow: inf when the mode may round away from zero on that side.
    inf_neg = 1 if (mode == 0 or mode == 3 or mode == 1) else 0
    inf_pos = 1 if (mode == 0 or mode == 3 or mode == 2) else 0
    return use_half, lsb, dir_neg, dir_pos, odd, inf_neg, inf_pos


@numba.njit(cache=True)
def _f32_to_narrow_kernel(u, E, M, mode, out):
    """u: uint32[n] fp32 bit patterns -> out: uint16[n] bit patterns of the (E, M) format."""
    use_half, lsb, dir_neg, dir_pos, odd, inf_neg, inf_pos = _mode_flags(mode)
    inf_bits = ((1 << E) - 1) << M
    nan_bits = inf_bits | (1 << (M - 1))
    sign_shift = E + M
    # fp32 exponent field of the target's smallest normal: below it the target
    # quantum stays fixed (gradual underflow), so the shift grows instead.
    lo_ex = 2 - (1 << (E - 1)) + 127
    sh0 = 23 - M
    for i in range(u.size):
        x = np.int64(u[i])
        sign = x >> 31
        a = x & 0x7FFFFFFF
        ex = a >> 23
        frac = a & 0x7FFFFF
        # fp32 subnormals have no implicit bit and sit at exponent field 1.
        m = frac | (0x800000 if ex != 0 else 0)
        ex_eff = ex if ex != 0 else 1
        d = lo_ex - ex_eff
        d = d if d > 0 else 0
        sh = sh0 + d
        # A shift past 31 leaves r == 0 and rem == m < half, same as 31.
        sh = sh if sh < 31 else 31
        mask = (1 << sh) - 1
        half = 1 << (sh - 1)
        r = m >> sh
        rem = m & mask
        toward = dir_neg if sign != 0 else dir_pos
        addv = use_half * half - lsb * (1 - (r & 1)) + toward * mask
        r += (rem + addv) >> sh
        r |= odd & (1 if rem != 0 else 0)
        # r includes the implicit bit, so a mantissa carry bumps the exponent
        # and subnormal results get a zero prefix.
        pre = ex_eff - lo_ex
        bits = ((pre if pre > 0 else 0) << M) + r
        if bits >= inf_bits:
            bits = inf_bits if (inf_neg if sign != 0 else inf_pos) else inf_bits - 1
        if ex == 255:
            bits = nan_bits if frac != 0 else inf_bits
        out[i] = np.uint16((sign << sign_shift) | bits)


@numba.njit(cache=True)
def _f32_to_bf16_rint_kernel(u, out):
    """u: uint32[n] fp32 bit patterns -> out: uint16[n] bf16 bits, nearest-even: ``_f32_to_narrow_kernel``'s answer
    for (8, 7, rint) bit for bit, in the form LLVM vectorises (bf16 keeps fp32's exponent range, so rounding is one
    add on the bits: subnormals, overflow to inf and inf itself included; NaN becomes the canonical quiet NaN)."""
    for i in range(u.size):
        x = np.int64(u[i])
        rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
        nan = ((x >> 16) & 0x8000) | 0x7FC0
        out[i] = np.uint16(nan if (x & 0x7FFFFFFF) > 0x7F800000 else rounded)


@numba.njit(cache=True)
def _f64_to_narrow_kernel(u, E, M, mode, out):
    """u: uint64[n] fp64 bit patterns -> out: uint32[n] bit patterns of the (E, M) format."""
    use_half, lsb, dir_neg, dir_pos, odd, inf_neg, inf_pos = _mode_flags(mode)
    inf_bits = ((1 << E) - 1) << M
    nan_bits = inf_bits | (1 << (M - 1))
    sign_shift = E + M
    lo_ex = 2 - (1 << (E - 1)) + 1023
    sh0 = 52 - M
    for i in range(u.size):
        x = u[i]
        sign = np.int64(x >> np.uint64(63))
        a = np.int64(x & np.uint64(0x7FFFFFFFFFFFFFFF))
        ex = a >> 52
        frac = a & 0xFFFFFFFFFFFFF
        m = frac | ((1 << 52) if ex != 0 else 0)
        ex_eff = ex if ex != 0 else 1
        d = lo_ex - ex_eff
        d = d if d > 0 else 0
        sh = sh0 + d
        # m < 2**53, so any shift of 62 or more behaves like 62.
        sh = sh if sh < 62 else 62
        mask = (1 << sh) - 1
        half = 1 << (sh - 1)
        r = m >> sh
        rem = m & mask
        toward = dir_neg if sign != 0 else dir_pos
        addv = use_half * half - lsb * (1 - (r & 1)) + toward * mask
        r += (rem + addv) >> sh
        r |= odd & (1 if rem != 0 else 0)
        pre = ex_eff - lo_ex
        bits = ((pre if pre > 0 else 0) << M) + r
        if bits >= inf_bits:
            bits = inf_bits if (inf_neg if sign != 0 else inf_pos) else inf_bits - 1
        if ex == 2047:
            bits = nan_bits if frac != 0 else inf_bits
        out[i] = np.uint32((sign << sign_shift) | bits)


@numba.njit(cache=True)
def _f64_to_int_kernel(x, mode, lo, hi, out):
    """x: float64[n] -> out: int64[n], rounded with mode, saturated to [lo, hi], NaN -> 0."""
    # np.floor & co. rather than math.floor: numba's math versions return
    # int64, which would wrap for inf and |v| >= 2**63 before saturation.
    for i in range(x.size):
        v = x[i]
        if v != v:
            out[i] = 0
            continue
        t = np.trunc(v)
        if mode == 0:  # rint
            r = np.floor(v)
            d = v - r  # exact; NaN for inf, which then takes no branch
            if d > 0.5 or (d == 0.5 and np.fmod(r, 2.0) != 0.0):
                r += 1.0
        elif mode == 1:
            r = np.floor(v)
        elif mode == 2:
            r = np.ceil(v)
        elif mode == 3:
            # v - trunc(v) is exact, unlike floor(|v| + 0.5) which can round up.
            r = t
            if abs(v - t) >= 0.5:
                r = t + 1.0 if v > 0 else t - 1.0
        elif mode == 4:
            r = t
        else:
            r = t
            if t != v and np.fmod(t, 2.0) == 0.0:
                r = t + 1.0 if v > 0 else t - 1.0
        if r < lo:
            r = lo
        elif r > hi:
            r = hi
        out[i] = np.int64(r)


@numba.njit(cache=True)
def _bf16_bits_to_f32_kernel(u, out):
    """u: uint16[n] bf16 bits -> out: uint32[n] fp32 bits (the top half: an exact widening, NaN payloads kept)."""
    for i in range(u.size):
        out[i] = np.uint32(u[i]) << np.uint32(16)


@numba.njit(cache=True)
def _transpose_pairs_kernel(s, d):
    """s: uint32 [R, C/2], each word two 16-bit elements of a row; d: uint32 [C, R/2] <- the [C, R] transpose.
    Rows are taken in pairs, so every load and store moves two elements (a 2 x 2 block per pair of words)."""
    rows, words = s.shape
    lo = np.uint32(0xFFFF)
    hi = np.uint32(0xFFFF0000)
    for i in range(0, rows, 2):
        h = i >> 1
        for j in range(words):
            w0 = s[i, j]
            w1 = s[i + 1, j]
            d[2 * j, h] = (w0 & lo) | (w1 << np.uint32(16))
            d[2 * j + 1, h] = (w0 >> np.uint32(16)) | (w1 & hi)


@numba.njit(cache=True)
def _quant_rows_kernel(x, rows, cols, smooth, use_smooth, q, scale):
    """x: float32[rows*cols], smooth: float32[cols] -> q: int8[rows*cols], scale: float32[rows]."""
    c127 = np.float32(127.0)
    # Adding and subtracting 1.5 * 2**23 rounds half-to-even for |y| < 2**22; y is clamped first. Every step is a
    # select, not a branch, so LLVM vectorises the loops (the division above all).
    magic = np.float32(12582912.0)
    hi = np.float32(127.0)
    lo = np.float32(-128.0)
    zero = np.float32(0.0)
    for r in range(rows):
        base = r * cols
        mx = zero
        nan = False
        for c in range(cols):
            v = x[base + c]
            if use_smooth:
                v = v * smooth[c]
            av = abs(v)
            nan |= av != av                      # torch.amax propagates NaN; plain max would drop it
            mx = av if av > mx else mx
        if nan:
            mx = np.float32(np.nan)
        s = mx / c127
        scale[r] = s
        d = s if s != zero else np.float32(1.0)
        for c in range(cols):
            v = x[base + c]
            if use_smooth:
                v = v * smooth[c]
            y = v / d
            # NaN -> 0, then clamping to the integer bounds before rounding: the same result as rounding first
            y = y if y == y else zero
            y = y if y < hi else hi
            y = y if y > lo else lo
            q[base + c] = np.int8((y + magic) - magic)


@numba.njit(cache=True)
def _quant_rows_bf16_kernel(u, rows, cols, smooth, use_smooth, q, scale, row, row_bits):
    """u: uint16[rows*cols] bf16 bits -> q, scale as ``_quant_rows_kernel``: each row widened exactly into the fp32
    scratch ``row`` [cols] (``row_bits``: its uint32 view), then quantised by that kernel: the same fp32 values
    through the same steps."""
    for r in range(rows):
        base = r * cols
        _bf16_bits_to_f32_kernel(u[base:base + cols], row_bits)
        _quant_rows_kernel(row, 1, cols, smooth, use_smooth, q[base:base + cols], scale[r:r + 1])


# --------------------------------------------------------------------------- helpers


def _mode_id(round_mode) -> int:
    try:
        return _MODE_ID[round_mode]
    except (KeyError, TypeError):
        raise ValueError(
            f"round_mode must be one of {ROUND_MODES}, got {round_mode!r}"
        ) from None


def _as_dtype(dtype, what: str) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{what} {dtype!r} is not a numpy dtype: {exc}") from None


# below this many elements numpy's ``astype`` beats a compiled call's fixed cost
WIDEN_KERNEL_MIN = 1024


def widen_bf16(a: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32 (any shape), a new array laid out like numpy's ``astype`` lays it out: one vectorised
    pass for a C-contiguous tile (a third of ``astype``'s time at 128 x 128), ``astype`` otherwise. Bitwise the
    same for all 65536 bf16 patterns (tests/emu/test_numerics.py)."""
    if a.size >= WIDEN_KERNEL_MIN and a.flags.c_contiguous:
        out = np.empty(a.shape, dtype=np.float32)
        _bf16_bits_to_f32_kernel(a.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint32))
        return out
    return a.astype(np.float32)


def widen_bf16_into(a: np.ndarray, out: np.ndarray) -> None:
    """Exact bf16 -> fp32 of a C-contiguous tile into ``out`` (C-contiguous fp32, the same shape): ``widen_bf16``
    without the allocation."""
    _bf16_bits_to_f32_kernel(a.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint32))


def transpose_into(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[...] = src.T`` (``src`` any shape, ``dst`` of the reversed shape, one dtype, not overlapping). A 2-D
    [R, C] tile of a 2-byte dtype (bf16, fp16, int16) with even R and C, contiguous rows and a C-contiguous ``dst``
    moves as 32-bit pairs (a fifth of numpy's strided copy at 128 x 128); anything else is numpy's copy."""
    shape = src.shape
    if (len(shape) == 2 and src.itemsize == 2 and not (shape[0] | shape[1]) & 1 and
            shape[0] * shape[1] >= WIDEN_KERNEL_MIN and src.strides[1] == 2 and not src.strides[0] & 3 and
            dst.flags.c_contiguous and dst.shape == (shape[1], shape[0]) and dst.dtype == src.dtype):
        _transpose_pairs_kernel(src.view(np.uint32), dst.view(np.uint32))
    else:
        dst[...] = src.T


def _widen_to_f32(a: np.ndarray) -> np.ndarray:
    """Exact fp16/bf16 -> fp32 (any shape); fp32 passes through uncopied."""
    if a.dtype == _F32:
        return a
    if a.dtype == _BF16:
        # bf16 is the top half of an fp32, so a shift is an exact widening that also keeps NaN payloads
        return widen_bf16(a)
    return a.astype(np.float32)


def _f32_to_narrow(x32: np.ndarray, dst: np.dtype, mode: int) -> np.ndarray:
    flat = np.ascontiguousarray(x32).reshape(-1).view(np.uint32)
    out = np.empty(flat.size, dtype=np.uint16)
    if dst == _BF16 and mode == _RINT:          # the common case (every bf16 result of the vector unit): fast form
        _f32_to_bf16_rint_kernel(flat, out)
    else:
        E, M = _FLOAT_FMT[dst]
        _f32_to_narrow_kernel(flat, E, M, mode, out)
    return out.view(dst).reshape(x32.shape)


def _f64_to_float(x64: np.ndarray, dst: np.dtype, mode: int) -> np.ndarray:
    E, M = _FLOAT_FMT[dst]
    flat = np.ascontiguousarray(x64).reshape(-1).view(np.uint64)
    out = np.empty(flat.size, dtype=np.uint32)
    _f64_to_narrow_kernel(flat, E, M, mode, out)
    if dst != _F32:
        out = out.astype(np.uint16)
    return out.view(dst).reshape(x64.shape)


# --------------------------------------------------------------------------- public API


def cast(src: np.ndarray, dst_dtype, round_mode: str = "rint") -> np.ndarray:
    """Convert ``src`` (any shape) to ``dst_dtype`` with an Ascend C round mode.

    src dtype: float32, float16, bfloat16, int8, uint8, int16, int32, int64,
    float64; dst dtype: the same minus int64/float64.  Returns a new C-contiguous
    array of ``src.shape``.  See the module docstring for the exact rules.
    """
    mode = _mode_id(round_mode)
    src = np.asarray(src)
    dst = _as_dtype(dst_dtype, "dst_dtype")
    if src.dtype not in _SRC_DTYPES:
        raise TypeError(
            f"src dtype {src.dtype} is not supported; expected one of "
            f"{[str(d) for d in _SRC_DTYPES]}"
        )
    if dst not in _DST_DTYPES:
        raise TypeError(
            f"dst_dtype {dst} is not supported; expected one of "
            f"{[str(d) for d in _DST_DTYPES]}"
        )
    if src.dtype == dst:
        return np.array(src, copy=True, order="C")

    src_is_float = src.dtype.kind == "f" or src.dtype == _BF16
    dst_is_float = dst in _FLOAT_FMT

    if src_is_float and dst_is_float:
        if src.dtype == _F64:
            return _f64_to_float(src, dst, mode)
        x32 = _widen_to_f32(src)
        if dst == _F32:
            return np.ascontiguousarray(x32)
        return _f32_to_narrow(x32, dst, mode)

    if src_is_float:
        x64 = src if src.dtype == _F64 else _widen_to_f32(src).astype(np.float64)
        info = np.iinfo(dst)
        flat = np.ascontiguousarray(x64).reshape(-1)
        out = np.empty(flat.size, dtype=np.int64)
        _f64_to_int_kernel(flat, mode, float(info.min), float(info.max), out)
        return out.astype(dst).reshape(src.shape)

    if dst_is_float:
        return _f64_to_float(src.astype(np.float64), dst, mode)

    info = np.iinfo(dst)
    return np.clip(src.astype(np.int64), info.min, info.max).astype(dst)


def cast_into(src: np.ndarray, out: np.ndarray, round_mode: str = "rint") -> bool:
    """``out[...] = cast(src, out.dtype, round_mode)`` without the intermediate array, for fp32 ``src`` into a
    C-contiguous fp32, fp16 or bf16 ``out`` of its shape (the vector unit's casts): True if done, False (nothing
    written) for any other case."""
    if (src.dtype != _F32 or not out.flags.c_contiguous or src.shape != out.shape or
            np.may_share_memory(src, out)):         # an overlapping cast reads its source before writing
        return False
    dst = out.dtype
    if dst == _F32:
        out[...] = src
        return True
    if dst not in _NARROW_FLOATS:
        return False
    mode = _mode_id(round_mode)
    flat = np.ascontiguousarray(src).reshape(-1).view(np.uint32)
    bits = out.reshape(-1).view(np.uint16)
    if dst == _BF16 and mode == _RINT:
        _f32_to_bf16_rint_kernel(flat, bits)
    else:
        E, M = _FLOAT_FMT[dst]
        _f32_to_narrow_kernel(flat, E, M, mode, bits)
    return True


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """Round float32 ``x`` (any shape) to fp16/bf16 with ``rint`` and widen back.

    Returns float32 of ``x.shape``; emulates a vector op computed in fp32 whose
    result dtype is fp16/bf16.
    """
    dst = _as_dtype(dtype, "dtype")
    if dst not in _NARROW_FLOATS:
        raise TypeError(f"dtype must be float16 or bfloat16, got {dst}")
    x = np.asarray(x)
    if x.dtype != _F32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    return _widen_to_f32(_f32_to_narrow(x, dst, _RINT))


def quant_int8_rows(
    x: np.ndarray, smooth: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 quantisation.

    x: [rows, cols] float32 (fp16/bf16 are widened exactly first); smooth:
    optional [cols] float32 multiplied into x first.  Returns
    (q int8 [rows, cols], scale float32 [rows]) with scale = max|x|/127 and
    q = rint(x/scale) clamped to [-128, 127]; rows with scale 0 give q = 0.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {x.shape}")
    if x.dtype not in (_F32, _F16, _BF16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    rows, cols = x.shape
    flat = np.ascontiguousarray(_widen_to_f32(x)).reshape(-1)
    if smooth is None:
        s = np.ones(1, dtype=np.float32)
        use_smooth = False
    else:
        s = np.asarray(smooth)
        if s.shape != (cols,):
            raise ValueError(f"smooth must have shape ({cols},), got {s.shape}")
        if s.dtype != _F32:
            raise TypeError(f"smooth must be float32, got {s.dtype}")
        s = np.ascontiguousarray(s)
        use_smooth = True
    q = np.empty(rows * cols, dtype=np.int8)
    scale = np.empty(rows, dtype=np.float32)
    _quant_rows_kernel(flat, rows, cols, s, use_smooth, q, scale)
    return q.reshape(rows, cols), scale


def quant_int8_rows_into(x: np.ndarray, smooth: np.ndarray | None, q: np.ndarray, scale: np.ndarray) -> bool:
    """``q[...], scale[...] = quant_int8_rows(x, smooth)`` without the intermediate arrays (the vector unit's
    quant_int8): for a C-contiguous 2-D bf16 or fp32 ``x`` [rows, cols] (bf16 widened row by row inside the
    kernel), C-contiguous int8 ``q`` of ``rows * cols`` and fp32 ``scale`` of ``rows`` elements, and ``smooth``
    None or fp32 [cols], no output sharing memory with an input or the other output (the kernel writes a row's
    outputs before it reads the next row): True if done, False (nothing written) otherwise."""
    if (x.ndim != 2 or x.dtype not in (_F32, _BF16) or not x.flags.c_contiguous or q.dtype != np.int8 or
            not q.flags.c_contiguous or q.size != x.size or scale.dtype != _F32 or not scale.flags.c_contiguous or
            scale.size != x.shape[0] or
            (smooth is not None and (smooth.dtype != _F32 or smooth.shape != (x.shape[1],))) or
            any(np.may_share_memory(o, i) for o in (q, scale) for i in (x, smooth, scale) if i is not None and
                i is not o)):
        return False
    rows, cols = x.shape
    use_smooth = smooth is not None
    s = np.ascontiguousarray(smooth) if use_smooth else np.ones(1, dtype=np.float32)
    flat_q, flat_s = q.reshape(-1), scale.reshape(-1)
    if x.dtype == _BF16:
        row = np.empty(cols, dtype=np.float32)
        _quant_rows_bf16_kernel(x.reshape(-1).view(np.uint16), rows, cols, s, use_smooth, flat_q, flat_s, row,
                                row.view(np.uint32))
    else:
        _quant_rows_kernel(x.reshape(-1), rows, cols, s, use_smooth, flat_q, flat_s)
    return True


def dequant_int8_rows(
    q: np.ndarray, row_scale: np.ndarray, col_scale: np.ndarray | None = None
) -> np.ndarray:
    """float32 [rows, cols] = q * row_scale[:, None] (* col_scale[None, :]).

    q: int8 [rows, cols]; row_scale: float32 [rows]; col_scale: float32 [cols].
    Multiplies in fp32 in that order (int8 -> fp32 is exact, so numpy's
    elementwise fp32 products are already the bit-exact answer).
    """
    q = np.asarray(q)
    if q.ndim != 2 or q.dtype != np.int8:
        raise TypeError(f"q must be int8 [rows, cols], got {q.dtype} {q.shape}")
    rows, cols = q.shape
    row_scale = np.asarray(row_scale)
    if row_scale.shape != (rows,) or row_scale.dtype != _F32:
        raise ValueError(
            f"row_scale must be float32 [{rows}], got {row_scale.dtype} {row_scale.shape}"
        )
    out = q.astype(np.float32)
    out *= row_scale[:, None]
    if col_scale is not None:
        col_scale = np.asarray(col_scale)
        if col_scale.shape != (cols,) or col_scale.dtype != _F32:
            raise ValueError(
                f"col_scale must be float32 [{cols}], got {col_scale.dtype} {col_scale.shape}"
            )
        out *= col_scale[None, :]
    return out
