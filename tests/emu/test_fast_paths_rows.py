"""Fast paths of the bench_vs_torch rows' numeric executors (issue 19): each must write exactly the bytes the
general path writes.

- ``numerics.quant_int8_rows_into`` (vec.quant_int8 into its tiles, bf16 widened inside the kernel): bitwise
  ``quant_int8_rows``, and nothing written when it declines.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import numerics

BF16 = np.dtype(ml_dtypes.bfloat16)
HYP = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _bits(seed: int, n: int, dtype) -> np.ndarray:
    """``n`` elements of ``dtype`` with uniformly random bit patterns (NaNs, infs, subnormals among them)."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt)


@HYP
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 6), cols=st.integers(1, 300),
       dtype=st.sampled_from([BF16, np.dtype(np.float32)]), smooth=st.booleans(), finite=st.booleans(),
       scale_exp=st.integers(-30, 30))
def test_quant_rows_into_is_quant_rows_bitwise(seed, rows, cols, dtype, smooth, finite, scale_exp):
    """Every row's scale and int8 values are those of ``quant_int8_rows``: finite values over a wide range of
    magnitudes, or any bit pattern (NaN, inf: whatever the general path gives, NaN scales included)."""
    rng = np.random.default_rng(seed)
    if finite:
        x = (rng.standard_normal((rows, cols)) * 2.0 ** scale_exp).astype(np.float32).astype(dtype)
        if rows > 1:
            x[0] = 0                                        # a row of zeros: scale 0, q 0
    else:
        x = _bits(seed, rows * cols, dtype).reshape(rows, cols)
    sm = rng.uniform(0.25, 4, cols).astype(np.float32) if smooth else None
    want_q, want_s = numerics.quant_int8_rows(x, sm)
    q = np.full(rows * cols, 7, np.int8)
    s = np.full(rows, 7, np.float32)
    assert numerics.quant_int8_rows_into(x, sm, q, s)
    assert q.tobytes() == want_q.tobytes() and s.tobytes() == want_s.tobytes()


def test_quant_rows_into_declines_and_writes_nothing():
    """Strided x, a q or scale that is not C-contiguous or not the right size or dtype, q aliasing x, an output
    aliasing smooth or the other output, or an fp16 x / a bf16 smooth: False, the outputs untouched."""
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    smooth = np.ones(16, np.float32)
    shared = np.zeros(80, np.int8)                          # q and scale overlapping in one buffer
    cases = [(x[:, ::2], None, np.zeros(32, np.int8), np.zeros(4, np.float32)),
             (x, None, np.zeros(128, np.int8)[::2], np.zeros(4, np.float32)),
             (x, None, np.zeros(63, np.int8), np.zeros(4, np.float32)),
             (x, None, np.zeros(64, np.int8), np.zeros(4, np.float64)),
             (x.astype(np.float16), None, np.zeros(64, np.int8), np.zeros(4, np.float32)),
             (x, x[0].astype(BF16), np.zeros(64, np.int8), np.zeros(4, np.float32)),
             (x, None, x.reshape(-1).view(np.int8)[:64], np.zeros(4, np.float32)),
             (x, smooth, np.zeros(64, np.int8), smooth[:4]),
             (x, None, shared[:64], shared[60:76].view(np.float32))]
    for xa, sm, q, s in cases:
        before = (q.tobytes(), s.tobytes())
        assert not numerics.quant_int8_rows_into(xa, sm, q, s)
        assert (q.tobytes(), s.tobytes()) == before
