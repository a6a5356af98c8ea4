"""Value-level tests of ascend_emu.numerics against torch and independent references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import numerics as nm

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
NARROW = [pytest.param(BF16, id="bf16"), pytest.param(F16, id="fp16")]
TORCH_OF = {BF16: torch.bfloat16, F16: torch.float16}
# Largest finite positive bit pattern of each 16-bit format.
MAX_BITS = {BF16: 0x7F7F, F16: 0x7BFF}
INF_BITS = {BF16: 0x7F80, F16: 0x7C00}


# --------------------------------------------------------------------------- helpers


def torch_bits(x32: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """fp32 -> fp16/bf16 by torch (round half to even), as uint16 bit patterns."""
    t = torch.from_numpy(np.ascontiguousarray(x32)).to(TORCH_OF[dtype])
    return t.view(torch.int16).numpy().view(np.uint16)


def our_bits(x: np.ndarray, dtype: np.dtype, mode: str = "rint") -> np.ndarray:
    out = nm.cast(x, dtype, mode)
    assert out.dtype == dtype
    assert out.shape == x.shape
    return out.view(np.uint16)


def bits_to_f64(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling-NaN patterns warn on widening
        return bits.astype(np.uint16).view(dtype).astype(np.float32).astype(np.float64)


def assert_same_bits(ours: np.ndarray, ref: np.ndarray, dtype: np.dtype, x=None):
    """Bit equality, except that NaNs only need to be NaN on both sides."""
    ours_nan = np.isnan(bits_to_f64(ours, dtype))
    ref_nan = np.isnan(bits_to_f64(ref, dtype))
    np.testing.assert_array_equal(ours_nan, ref_nan)
    bad = np.flatnonzero((ours != ref) & ~ref_nan)
    if bad.size:
        i = bad[:8]
        detail = "" if x is None else f" x={np.asarray(x).reshape(-1)[i]!r}"
        raise AssertionError(
            f"{bad.size} mismatches, first: ours={ours.reshape(-1)[i]} ref={ref.reshape(-1)[i]}{detail}"
        )


def step_bits(bits: np.ndarray, up: bool) -> np.ndarray:
    """Next representable 16-bit float pattern toward +inf (up) or -inf, sign-magnitude."""
    b = bits.astype(np.int64)
    neg = (b & 0x8000) != 0
    mag = b & 0x7FFF
    if up:
        res = np.where(neg, b - 1, b + 1)
        res = np.where(mag == 0, 0x0001, res)
    else:
        res = np.where(neg, b + 1, b - 1)
        res = np.where(mag == 0, 0x8001, res)
    return res.astype(np.uint16)


def reference_round(x32: np.ndarray, dtype: np.dtype, mode: str) -> np.ndarray:
    """Directed rounding built from torch's rint result and its bit-pattern neighbours.

    The rint result is one of the two representable values bracketing x; the
    other one is one step away.  Every mode then just picks a bracket end.
    """
    anchor = torch_bits(x32, dtype)
    if mode == "rint":
        return anchor
    with np.errstate(invalid="ignore"):
        xv = x32.astype(np.float64)
    av = bits_to_f64(anchor, dtype)
    anchor_above = av > xv
    other = np.where(anchor_above, step_bits(anchor, up=False), step_bits(anchor, up=True))
    lower = np.where(anchor_above, other, anchor)
    upper = np.where(anchor_above, anchor, other)
    lv, uv = bits_to_f64(lower, dtype), bits_to_f64(upper, dtype)
    positive = xv > 0
    if mode == "floor":
        res = lower
    elif mode == "ceil":
        res = upper
    elif mode == "trunc":
        res = np.where(positive, lower, upper)
    elif mode == "round":
        with np.errstate(invalid="ignore"):
            tie = (xv - lv) == (uv - xv)
        res = np.where(tie, np.where(positive, upper, lower), anchor)
    elif mode == "odd":
        res = np.where((lower & 1) == 1, lower, upper)
    else:
        raise AssertionError(mode)
    exact = (av == xv) | np.isnan(xv)
    return np.where(exact, anchor, res).astype(np.uint16)


def midpoints(dtype: np.dtype) -> np.ndarray:
    """Every exact tie between consecutive finite non-negative values, as fp32.

    Includes the tie between 0 and the smallest subnormal and the one between
    the largest finite value and the first overflow value 2**(emax+1).
    """
    lo_bits = np.arange(0, MAX_BITS[dtype] + 1, dtype=np.uint16)
    lo = bits_to_f64(lo_bits, dtype)
    hi = bits_to_f64(lo_bits + 1, dtype)
    hi[-1] = 2.0 ** (128 if dtype == BF16 else 16)
    mid = (lo + hi) / 2
    mid32 = mid.astype(np.float32)
    assert np.array_equal(mid32.astype(np.float64), mid), "ties must be exact in fp32"
    return mid32


def with_neighbours(x32: np.ndarray) -> np.ndarray:
    up = np.nextafter(x32, np.float32(np.inf))
    down = np.nextafter(x32, np.float32(-np.inf))
    both = np.concatenate([x32, up, down])
    return np.concatenate([both, -both])


# --------------------------------------------------------------------------- fp32 -> bf16/fp16, rint


@pytest.mark.parametrize("dtype", NARROW)
def test_rint_random_bit_patterns_match_torch(dtype):
    rng = np.random.default_rng(1234)
    x = rng.integers(0, 2**32, size=2**20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    assert_same_bits(our_bits(x, dtype), torch_bits(x, dtype), dtype, x)


@pytest.mark.parametrize("dtype", NARROW)
def test_rint_exhaustive_ties_match_torch(dtype):
    mid = midpoints(dtype)
    x = with_neighbours(mid)
    assert_same_bits(our_bits(x, dtype), torch_bits(x, dtype), dtype, x)
    # Independent of torch: a tie goes to the even pattern, so from lower
    # neighbour h it stays at h if h is even and moves to h + 1 if h is odd.
    h = np.arange(mid.size, dtype=np.uint16)
    expected = np.where(h % 2 == 0, h, h + 1).astype(np.uint16)
    np.testing.assert_array_equal(our_bits(mid, dtype), expected)
    np.testing.assert_array_equal(our_bits(-mid, dtype), expected | 0x8000)


@pytest.mark.parametrize("dtype", NARROW)
def test_rint_fp32_subnormals_match_torch(dtype):
    rng = np.random.default_rng(7)
    mags = rng.integers(1, 0x800000, size=1 << 16, dtype=np.uint32)
    edges = np.array([1, 2, 3, 0x7FFF, 0x8000, 0x8001, 0x7FFFFF], dtype=np.uint32)
    bits = np.concatenate([mags, edges])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    x = bits.view(np.float32)
    ours = our_bits(x, dtype)
    assert_same_bits(ours, torch_bits(x, dtype), dtype, x)
    if dtype == BF16:
        # bf16 shares fp32's exponent, so fp32 subnormals must not flush to zero.
        assert np.count_nonzero(ours & 0x7FFF) > mags.size // 2


def test_rint_fp16_subnormal_range_and_underflow_boundary():
    rng = np.random.default_rng(99)
    x = np.exp2(rng.uniform(-27.0, -13.0, size=1 << 15)).astype(np.float32)
    x = np.concatenate([x, -x])
    assert_same_bits(our_bits(x, F16), torch_bits(x, F16), F16, x)
    tiny = np.float32(2.0**-24)  # smallest fp16 subnormal
    cases = {
        np.float32(2.0**-25): 0x0000,  # exact tie with 0: to even
        np.nextafter(np.float32(2.0**-25), np.float32(1)): 0x0001,
        np.nextafter(np.float32(2.0**-25), np.float32(0)): 0x0000,
        np.float32(1.5) * tiny: 0x0002,  # tie between 1 and 2: to even
        np.float32(2.5) * tiny: 0x0002,
        np.float32(2.0**-14): 0x0400,  # smallest normal
        np.float32(2.0**-14) - tiny / np.float32(2): 0x0400,  # tie 0x3ff/0x400
        np.float32(2.0**-14) - tiny: 0x03FF,
    }
    x = np.array(list(cases), dtype=np.float32)
    np.testing.assert_array_equal(our_bits(x, F16), np.array(list(cases.values()), np.uint16))
    np.testing.assert_array_equal(our_bits(x, F16), torch_bits(x, F16))


@pytest.mark.parametrize("dtype", NARROW)
def test_rint_overflow_boundary_zeros_and_infinities(dtype):
    max_bits = MAX_BITS[dtype]
    inf_bits = INF_BITS[dtype]
    max_val = float(bits_to_f64(np.array([max_bits], np.uint16), dtype)[0])
    half_ulp = 2.0 ** (127 - 8 if dtype == BF16 else 15 - 11)
    boundary = np.float32(max_val + half_ulp)  # exact tie: odd max -> rounds to inf
    below = np.nextafter(boundary, np.float32(0))
    x = np.array(
        [max_val, below, boundary, np.finfo(np.float32).max, 0.0, -0.0, np.inf, -np.inf],
        dtype=np.float32,
    )
    expected = np.array(
        [max_bits, max_bits, inf_bits, inf_bits, 0x0000, 0x8000, inf_bits, inf_bits | 0x8000],
        dtype=np.uint16,
    )
    np.testing.assert_array_equal(our_bits(x, dtype), expected)
    np.testing.assert_array_equal(our_bits(-x, dtype), expected ^ np.uint16(0x8000))
    np.testing.assert_array_equal(our_bits(x, dtype), torch_bits(x, dtype))


@pytest.mark.parametrize("dtype", NARROW)
def test_nan_stays_nan_in_every_mode(dtype):
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF800001], np.uint32)
    x = nans.view(np.float32)
    for mode in nm.ROUND_MODES:
        assert np.isnan(nm.cast(x, dtype, mode).astype(np.float32)).all(), mode


@pytest.mark.parametrize("dtype", NARROW)
def test_nan_becomes_the_canonical_quiet_nan_with_its_sign(dtype):
    """What the numerics docstring promises for NaN (the one place casts are not torch's bits: torch's own NaN
    patterns depend on which of its code paths runs, e.g. 0xFFFF for every NaN from its vectorised fp32 -> bf16)."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF800001, 0x7FC12345], np.uint32)
    quiet = 0x7FC0 if dtype == BF16 else 0x7E00
    want = np.array([quiet, quiet | 0x8000, quiet, quiet, quiet | 0x8000, quiet], np.uint16)
    for mode in nm.ROUND_MODES:
        np.testing.assert_array_equal(our_bits(nans.view(np.float32), dtype, mode), want, err_msg=mode)
        with np.errstate(invalid="ignore"):      # widening a signalling NaN warns
            wide = nans.view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(nm.cast(wide, dtype, mode).view(np.uint16), want, err_msg=mode)


# --------------------------------------------------------------------------- directed modes


def directed_sample(dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(2024)
    # Log-uniform over the full fp32 range: covers target subnormals,
    # underflow to zero and overflow for both formats.
    mags = np.exp2(rng.uniform(-149, 128, size=3000)).astype(np.float32)
    near_one = rng.uniform(0.5, 4.0, size=1000).astype(np.float32)
    raw = rng.integers(0, 2**32, size=1000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    mid = midpoints(dtype)
    ties = mid[rng.choice(mid.size, size=2000, replace=False)]
    ties = np.concatenate([ties, mid[:4], mid[-4:]])  # underflow & overflow ties
    specials = np.array(
        [0.0, np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45],
        dtype=np.float32,
    )
    signed = np.concatenate([mags, near_one, ties, specials])
    return np.concatenate([signed, -signed, raw, with_neighbours(ties[:200])])


@pytest.mark.parametrize("mode", nm.ROUND_MODES)
@pytest.mark.parametrize("dtype", NARROW)
def test_directed_modes_match_neighbour_reference(dtype, mode):
    x = directed_sample(dtype)
    assert_same_bits(our_bits(x, dtype, mode), reference_round(x, dtype, mode), dtype, x)


@pytest.mark.parametrize("dtype", NARROW)
def test_directed_mode_overflow_follows_ieee(dtype):
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32)
    mx, inf = MAX_BITS[dtype], INF_BITS[dtype]
    expected = {
        "rint": [inf, inf | 0x8000],
        "round": [inf, inf | 0x8000],
        "floor": [mx, inf | 0x8000],
        "ceil": [inf, mx | 0x8000],
        "trunc": [mx, mx | 0x8000],
        "odd": [mx, mx | 0x8000],
    }
    for mode, exp in expected.items():
        np.testing.assert_array_equal(our_bits(big, dtype, mode), np.array(exp, np.uint16), mode)


def test_directed_modes_on_simple_values():
    # 1 + 2**-8 lies between bf16 1.0 and 1.0078125: a tie with an even lower end.
    x = np.array([1 + 2.0**-8, -(1 + 2.0**-8), 1 + 3 * 2.0**-8], np.float32)
    got = {m: nm.cast(x, BF16, m).astype(np.float64).tolist() for m in nm.ROUND_MODES}
    assert got["rint"] == [1.0, -1.0, 1.015625]
    assert got["round"] == [1.0078125, -1.0078125, 1.015625]
    assert got["floor"] == [1.0, -1.0078125, 1.0078125]
    assert got["ceil"] == [1.0078125, -1.0, 1.015625]
    assert got["trunc"] == [1.0, -1.0, 1.0078125]
    assert got["odd"] == [1.0078125, -1.0078125, 1.0078125]


# --------------------------------------------------------------------------- other float casts


def test_widening_is_exact_for_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for dtype in (BF16, F16):
        src = bits.view(dtype)
        got = nm.cast(src, np.float32)
        want = torch.from_numpy(bits.view(np.int16)).view(TORCH_OF[dtype]).float().numpy()
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@given(shape=st.sampled_from([(1 << 16,), (256, 256), (16, 4096), (3, 5), (8, 128)]),
       strided=st.booleans(), seed=st.integers(0, 2 ** 16))
@settings(max_examples=20, deadline=None, database=None)
def test_the_compiled_bf16_widening_is_numpys_astype_bit_for_bit(shape, strided, seed):
    """``widen_bf16`` (a compiled shift for contiguous tiles of WIDEN_KERNEL_MIN elements or more, ``astype``
    otherwise) against numpy's ``astype``: every bf16 bit pattern (NaN payloads and signs included), and the same
    layout."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    bits = rng.permutation(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    src = np.resize(bits, n * (2 if strided else 1)).view(BF16).reshape(shape[:-1] + (-1,))
    if strided:
        src = src[..., ::2]
    got, want = nm.widen_bf16(src), src.astype(np.float32)
    assert got.shape == want.shape and got.strides == want.strides
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("src,dst", [(BF16, F16), (F16, BF16)])
def test_bf16_fp16_cross_casts_match_torch(src, dst):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = nm.cast(bits.view(src), dst).view(np.uint16)
    ref = torch.from_numpy(bits.view(np.int16)).view(TORCH_OF[src]).to(TORCH_OF[dst])
    assert_same_bits(ours, ref.view(torch.int16).numpy().view(np.uint16), dst)
    # Directed modes go through exact fp32, so they agree with the reference too.
    x32 = nm.cast(bits.view(src), np.float32)
    for mode in ("floor", "odd"):
        assert_same_bits(
            nm.cast(bits.view(src), dst, mode).view(np.uint16), reference_round(x32, dst, mode), dst
        )


def test_round_to_matches_torch_round_trip():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((37, 19)) * 1000).astype(np.float32)
    for dtype in (BF16, F16):
        got = nm.round_to(x, dtype)
        assert got.dtype == np.float32 and got.shape == x.shape
        want = torch.from_numpy(x).to(TORCH_OF[dtype]).float().numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(TypeError, match="dtype"):
        nm.round_to(x, np.int8)


def test_shapes_noncontiguous_and_copies():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    xt = x.T[::2]
    got = nm.cast(xt, BF16, "ceil")
    assert got.shape == xt.shape and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint16), nm.cast(xt.copy(), BF16, "ceil").view(np.uint16))
    assert nm.cast(np.zeros((0, 5), np.float32), F16).shape == (0, 5)
    scalar = nm.cast(np.array(1.5, np.float32), np.int8, "round")
    assert scalar.shape == () and scalar == 2
    same = nm.cast(x, np.float32)
    assert same is not x and np.array_equal(same, x)


# --------------------------------------------------------------------------- float -> int


def float_to_int_reference(x: np.ndarray, dst, mode: str) -> np.ndarray:
    xv = x.astype(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore"):
        if mode == "rint":
            r = np.rint(xv)
        elif mode == "floor":
            r = np.floor(xv)
        elif mode == "ceil":
            r = np.ceil(xv)
        elif mode == "trunc":
            r = np.trunc(xv)
        elif mode == "round":
            r = np.sign(xv) * np.floor(np.abs(xv) + 0.5)
        else:
            t = np.trunc(xv)
            bump = (t != xv) & (np.fmod(t, 2) == 0)
            r = np.where(bump, t + np.sign(xv), t)
    info = np.iinfo(dst)
    r = np.where(np.isnan(r), 0, np.clip(r, info.min, info.max))
    return r.astype(dst)


def float_to_int_sample() -> np.ndarray:
    rng = np.random.default_rng(11)
    vals = [
        rng.uniform(-300, 300, 2000),
        rng.integers(-300, 300, 500) + 0.5,  # ties
        rng.integers(-300, 300, 200).astype(np.float64),
        np.exp2(rng.uniform(-30, 40, 1000)) * rng.choice([-1, 1], 1000),
        [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 127.5, -128.5, 255.5, 126.5],
        [2147483520.0, 2.0**31, -(2.0**31), -2147483904.0, 1e30, -1e30, np.inf, -np.inf, np.nan],
    ]
    return np.concatenate([np.asarray(v, np.float64) for v in vals]).astype(np.float32)


@pytest.mark.parametrize("mode", nm.ROUND_MODES)
@pytest.mark.parametrize("dst", [np.int8, np.int32, np.uint8, np.int16])
@pytest.mark.parametrize("src", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_float_to_int_every_mode_matches_numpy(src, dst, mode):
    x = float_to_int_sample()
    with np.errstate(over="ignore"):
        x = x.astype(src)
    got = nm.cast(x, dst, mode)
    assert got.dtype == np.dtype(dst)
    want = float_to_int_reference(x, dst, mode)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (x[bad[:8]], got[bad[:8]], want[bad[:8]])


def test_float_to_int_saturates_and_zeroes_nan():
    x = np.array([np.nan, np.inf, -np.inf, 1e10, -1e10, 200.0, -200.0], np.float32)
    np.testing.assert_array_equal(nm.cast(x, np.int8), [0, 127, -128, 127, -128, 127, -128])
    np.testing.assert_array_equal(nm.cast(x, np.uint8), [0, 255, 0, 255, 0, 200, 0])
    np.testing.assert_array_equal(
        nm.cast(x, np.int32), [0, 2**31 - 1, -(2**31), 2**31 - 1, -(2**31), 200, -200]
    )


# --------------------------------------------------------------------------- int -> float / int


def test_int32_to_float32_rint_equals_numpy_astype():
    rng = np.random.default_rng(17)
    x = np.concatenate(
        [
            rng.integers(-(2**31), 2**31, size=200_000, dtype=np.int64),
            [2**24 + 1, 2**24 + 3, -(2**24) - 1, 2**31 - 1, -(2**31), 0, 1, -1],
        ]
    ).astype(np.int32)
    got = nm.cast(x, np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), x.astype(np.float32).view(np.uint32))


def test_int32_to_float32_directed_modes():
    # Above 2**24 fp32 steps by 2 (by 128 near 2**31), so every mode is visible.
    x = np.array([2**24 + 1, -(2**24) - 1, 2**24 + 3, 2**31 - 1, 2**24], np.int32)
    expected = {
        "rint": [16777216, -16777216, 16777220, 2147483648, 16777216],
        "floor": [16777216, -16777218, 16777218, 2147483520, 16777216],
        "ceil": [16777218, -16777216, 16777220, 2147483648, 16777216],
        "trunc": [16777216, -16777216, 16777218, 2147483520, 16777216],
        "round": [16777218, -16777218, 16777220, 2147483648, 16777216],
        "odd": [16777218, -16777218, 16777218, 2147483520, 16777216],
    }
    for mode, want in expected.items():
        got = nm.cast(x, np.float32, mode)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=mode)


@pytest.mark.parametrize("mode", nm.ROUND_MODES)
@pytest.mark.parametrize("dtype", NARROW)
def test_int_to_narrow_float_matches_reference(dtype, mode):
    rng = np.random.default_rng(23)
    # |v| <= 2**24 is exact in fp32, so the fp32-based reference applies.
    v = np.concatenate([rng.integers(-(2**24), 2**24 + 1, size=4000), np.arange(-600, 600)])
    for src in (np.int32, np.int16):
        xi = v.astype(src) if src is np.int32 else np.clip(v, -(2**15), 2**15 - 1).astype(src)
        ref = reference_round(xi.astype(np.float32), dtype, mode)
        assert_same_bits(nm.cast(xi, dtype, mode).view(np.uint16), ref, dtype)


def test_int_to_fp16_beyond_range_and_int64_source():
    x = np.array([65519, 65520, 70000, -70000, 2**40], np.int64)
    got = nm.cast(x, F16)
    np.testing.assert_array_equal(got.astype(np.float64), [65504, np.inf, np.inf, -np.inf, np.inf])
    np.testing.assert_array_equal(nm.cast(x, F16, "trunc").astype(np.float64)[2:], [65504, -65504, 65504])


def test_float64_source_matches_numpy_direct_rounding():
    # numpy rounds float64 -> float32/float16 once (no detour through fp32).
    rng = np.random.default_rng(31)
    x = rng.integers(0, 2**64, size=1 << 16, dtype=np.uint64).view(np.float64)
    x = np.concatenate([x, np.exp2(rng.uniform(-160, 20, 1 << 14)), [65520.0, 2.0**-25, -0.0]])
    with np.errstate(over="ignore", invalid="ignore"):
        for dst, ubits in ((np.float32, np.uint32), (np.float16, np.uint16)):
            want = x.astype(dst)
            got = nm.cast(x, dst)
            nan = np.isnan(want)
            np.testing.assert_array_equal(np.isnan(got), nan)
            np.testing.assert_array_equal(got.view(ubits)[~nan], want.view(ubits)[~nan])


def test_int_to_int_saturates():
    np.testing.assert_array_equal(
        nm.cast(np.array([-300, -129, -128, 0, 127, 128, 300], np.int32), np.int8),
        [-128, -128, -128, 0, 127, 127, 127],
    )
    np.testing.assert_array_equal(nm.cast(np.array([-5, 0, 255, 256], np.int16), np.uint8), [0, 0, 255, 255])
    np.testing.assert_array_equal(nm.cast(np.array([200, 255], np.uint8), np.int8), [127, 127])
    np.testing.assert_array_equal(
        nm.cast(np.array([2**40, -(2**40), 5], np.int64), np.int32), [2**31 - 1, -(2**31), 5]
    )


# --------------------------------------------------------------------------- quantisation


def torch_quant(x32: np.ndarray, smooth: np.ndarray | None):
    x = torch.from_numpy(x32)
    if smooth is not None:
        x = x * torch.from_numpy(smooth)
    s = x.abs().amax(-1) / 127
    q = torch.round(x / torch.where(s == 0, 1, s)[:, None]).clamp(-128, 127).to(torch.int8)
    return q.numpy(), s.numpy()


def assert_quant_matches_torch(x, smooth=None):
    q, s = nm.quant_int8_rows(x, smooth)
    x32 = nm.cast(x, np.float32)
    q_ref, s_ref = torch_quant(x32, smooth)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert s.dtype == np.float32 and s.shape == (x.shape[0],)
    np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    np.testing.assert_array_equal(q, q_ref)
    return q, s


@settings(
    max_examples=60,
    deadline=None,
    database=None,  # no .hypothesis/ example store in the repo
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    rows=st.integers(1, 64),
    cols=st.integers(1, 300),
    log2_scale=st.integers(-140, 120),
    dtype=st.sampled_from([F32, F16, BF16]),
    use_smooth=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_quant_int8_rows_matches_torch(rows, cols, log2_scale, dtype, use_smooth, seed):
    rng = np.random.default_rng(seed)
    if dtype == F16:
        log2_scale = int(np.clip(log2_scale, -20, 12))  # keep the fp16 input finite
    x = rng.standard_normal((rows, cols)) * 2.0**log2_scale
    kind = rng.integers(0, 4, size=rows)  # 0: zeros, 1: one nonzero, else dense
    x[kind == 0] = 0.0
    for r in np.flatnonzero(kind == 1):
        keep = rng.integers(cols)
        x[r, :keep] = 0.0
        x[r, keep + 1 :] = 0.0
    with np.errstate(over="ignore", under="ignore"):
        x = x.astype(np.float32).astype(dtype)
    smooth = rng.uniform(0.25, 4.0, size=cols).astype(np.float32) if use_smooth else None
    q, s = assert_quant_matches_torch(x, smooth)
    assert np.all(s[kind == 0] == 0) and np.all(q[kind == 0] == 0)
    ones = np.flatnonzero((kind == 1) & (s > np.finfo(np.float32).tiny))
    assert np.all(np.abs(q[ones]).max(axis=1) == 127)


def test_quant_rounds_half_to_even_and_zero_rows():
    x = np.array(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5],
            [0.0] * 7,
            [0.0, 0.0, -3.0, 0.0, 0.0, 0.0, 0.0],
            [1e-44, -1e-44, 0, 0, 0, 0, 0],  # max/127 underflows: scale 0, q 0
        ],
        np.float32,
    )
    q, s = assert_quant_matches_torch(x)
    np.testing.assert_array_equal(q[0], [127, 0, 2, 2, 0, -2, -2])
    np.testing.assert_array_equal(q[1], 0)
    np.testing.assert_array_equal(q[2], [0, 0, -127, 0, 0, 0, 0])
    np.testing.assert_array_equal(q[3], 0)
    assert s[0] == 1.0 and s[1] == 0.0 and s[3] == 0.0
    # A subnormal max makes max/127 lose precision (190/127 quanta -> 1), so
    # x/scale leaves the int8 range and must saturate.
    sub = np.array([[190, -190, 64, 0]], np.float32) * np.float32(2.0**-149)
    q, s = assert_quant_matches_torch(sub)
    np.testing.assert_array_equal(q[0], [127, -128, 64, 0])
    assert s[0] == np.float32(2.0**-149)
    smooth = np.array([1, 2, 1, 1, 1, 1, 1], np.float32)
    q, _ = assert_quant_matches_torch(x, smooth)
    assert q[0, 1] == 1  # 0.5 * 2 == 1.0 exactly


def test_dequant_matches_torch_and_bounds_quant_error():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((33, 257)) * 3).astype(np.float32)
    q, s = nm.quant_int8_rows(x)
    cs = rng.uniform(0.5, 2, size=257).astype(np.float32)
    qt, st_, ct = torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(cs)
    want = (qt.float() * st_[:, None]).numpy()
    got = nm.dequant_int8_rows(q, s)
    assert got.dtype == np.float32 and got.shape == q.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    want_c = (qt.float() * st_[:, None] * ct[None, :]).numpy()
    np.testing.assert_array_equal(nm.dequant_int8_rows(q, s, cs).view(np.uint32), want_c.view(np.uint32))
    assert np.all(np.abs(got - x) <= s[:, None] * 0.5000001)


# --------------------------------------------------------------------------- errors


def test_bad_round_mode_names_argument_and_choices():
    x = np.ones(3, np.float32)
    for bad in ("nearest", "RINT", None, 0):
        with pytest.raises(ValueError, match="round_mode") as ei:
            nm.cast(x, BF16, bad)
        assert all(m in str(ei.value) for m in nm.ROUND_MODES)


@pytest.mark.parametrize("dst", [np.int64, np.float64, np.bool_, np.complex64, np.uint16])
def test_unsupported_dst_dtype_raises(dst):
    with pytest.raises(TypeError, match="dst_dtype"):
        nm.cast(np.ones(3, np.float32), dst)


def test_unsupported_src_and_garbage_dtype_raise():
    with pytest.raises(TypeError, match="src"):
        nm.cast(np.ones(3, np.complex64), np.float32)
    with pytest.raises(TypeError, match="src"):
        nm.cast(np.ones(3, np.uint16), np.float32)
    with pytest.raises(TypeError, match="dst_dtype"):
        nm.cast(np.ones(3, np.float32), "not-a-dtype")
    with pytest.raises(ValueError, match="2-D"):
        nm.quant_int8_rows(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="smooth"):
        nm.quant_int8_rows(np.ones((2, 3), np.float32), np.ones(4, np.float32))


EDGE_BITS = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001,
             0x8000FFFF, 0x00008000, 0x00018000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x807FFFFF, 0x3F808000]


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=64))
def test_fast_bf16_rint_rounding_is_the_general_kernel_bit_for_bit(patterns):
    """fp32 -> bf16 nearest-even has a fast kernel (every vector result in bf16 takes it): it must give the general
    rounding kernel's bits for every fp32 bit pattern: subnormals, ties, overflow to inf, inf and NaN."""
    u = np.array(patterns + EDGE_BITS, dtype=np.uint64).astype(np.uint32)
    fast, general = np.empty(u.size, np.uint16), np.empty(u.size, np.uint16)
    nm._f32_to_bf16_rint_kernel(u, fast)
    nm._f32_to_narrow_kernel(u, 8, 7, 0, general)
    np.testing.assert_array_equal(fast, general)
    got = nm.cast(u.view(np.float32), ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(got, general)


def quant_spec(x: np.ndarray, smooth) -> tuple[np.ndarray, np.ndarray]:
    """quant_int8_rows as its docstring defines it, in whole-array numpy: NaN in a row makes its scale NaN (torch.amax
    propagates it) and NaN quotients become 0; quotients clamp to [-128, 127] and round half to even."""
    v = x.astype(np.float32) if smooth is None else x.astype(np.float32) * smooth[None, :]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = np.max(np.abs(v), axis=1) / np.float32(127)
        y = v / np.where(s == 0, np.float32(1), s)[:, None]
    y = np.clip(np.where(np.isnan(y), np.float32(0), y), -128, 127)
    return np.rint(y).astype(np.int8), s


@settings(max_examples=80, deadline=None, database=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 70), use_smooth=st.booleans(), seed=st.integers(0, 2 ** 16),
       specials=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(
           [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-45, 0.0, 2.5, -0.5])), max_size=6))
def test_quant_int8_rows_with_non_finite_and_extreme_values_is_its_definition(rows, cols, use_smooth, seed, specials):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 10).astype(np.float32)
    for i, v in specials:
        x.reshape(-1)[i % x.size] = v
    smooth = rng.uniform(0.25, 4.0, size=cols).astype(np.float32) if use_smooth else None
    q, s = nm.quant_int8_rows(x, smooth)
    want_q, want_s = quant_spec(x, smooth)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s.view(np.uint32), want_s.view(np.uint32))
