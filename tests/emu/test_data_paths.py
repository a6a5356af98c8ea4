"""Fast data paths of the instruction table against the plain forms they replace, bit for bit.

- Vector binary / scalar ops on fp32 tiles write straight into the destination (``isa._into``); the plain form
  computes a temporary and stores it (``isa.store_values``). Cases: in place (dst is an operand), broadcast rows,
  strided views, other dtypes (which take the plain form).
- ``cube_math.mmad_step``: one float mmad on the host, against the product and add written out.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import cube_math, isa

BF16 = np.dtype(ml_dtypes.bfloat16)
HYP = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
BINARY = ("add", "sub", "mul", "max", "min", "div")
SCALAR = ("adds", "muls", "maxs", "mins", "divs")
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")   # inf / NaN operands on purpose
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -1.5], np.float32)


class _View:
    """The two fields a data path reads from a view."""

    def __init__(self, arr):
        self.arr = arr
        self.dtype = arr.dtype
        self.shape = arr.shape


class _Ins:
    def __init__(self, dsts, srcs, p=None):
        self.dsts = tuple(_View(d) for d in dsts)
        self.srcs = tuple(_View(s) for s in srcs)
        self.p = p or {}


def _values(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32) * 4
    flat = x.reshape(-1)
    n = min(flat.size, SPECIAL.size)
    flat[:n] = SPECIAL[rng.permutation(SPECIAL.size)[:n]]        # signed zeros, infinities, NaN, extremes
    return x.astype(dtype)


def _plain_binary(name, dst, a, b):
    fn = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
          "div": isa.divide}[name]
    isa.store_values(_View(dst), fn(isa.widen(a), isa.widen(b)))


@HYP
@given(name=st.sampled_from(BINARY), rows=st.integers(1, 9), cols=st.integers(1, 40),
       form=st.sampled_from(["fresh", "in_place", "broadcast_row", "broadcast_col", "strided"]),
       dtype=st.sampled_from(["fp32", "bf16"]), seed=st.integers(0, 2 ** 16))
def test_a_binary_op_into_its_tile_equals_the_stored_temporary(name, rows, cols, form, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(np.float32) if dtype == "fp32" else BF16
    a = _values(rng, (rows, cols), dt)
    b = _values(rng, (rows, 1) if form == "broadcast_col" else (1, cols) if form == "broadcast_row" else
                (rows, cols), dt)
    if form == "strided":
        a = _values(rng, (rows, 2 * cols), dt)[:, ::2]
    want = np.zeros((rows, cols), dt)
    _plain_binary(name, want, a.copy(), b.copy())
    got = a if form == "in_place" else np.zeros((rows, cols), dt)
    isa.OPS[name].execute(_Ins([got], [a, b]))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@HYP
@given(name=st.sampled_from(SCALAR), n=st.integers(1, 70), in_place=st.booleans(),
       scalar=st.sampled_from([0.0, -0.0, 1.0, -3.25, 1e-30, np.inf, np.nan]), seed=st.integers(0, 2 ** 16))
def test_a_scalar_op_into_its_tile_equals_the_stored_temporary(name, n, in_place, scalar, seed):
    rng = np.random.default_rng(seed)
    a = _values(rng, (n,), np.float32)
    fn = {"adds": np.add, "muls": np.multiply, "maxs": np.maximum, "mins": np.minimum, "divs": isa.divide}[name]
    want = np.zeros(n, np.float32)
    isa.store_values(_View(want), fn(a, np.asarray(scalar, dtype=np.float32)))
    got = a if in_place else np.zeros(n, np.float32)
    isa.OPS[name].execute(_Ins([got], [a], {"scalar": scalar}))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_an_in_place_op_on_overlapping_shifted_views_reads_the_operands_before_writing():
    """dst overlaps a shifted copy of the source: numpy buffers it, so the result is the temporary's."""
    buf = np.arange(12, dtype=np.float32)
    want = buf[:8] + buf[2:10]
    isa.OPS["add"].execute(_Ins([buf[2:10]], [buf[:8], buf[2:10]]))
    np.testing.assert_array_equal(buf[2:10], want)


@HYP
@given(m=st.integers(1, 48), k=st.integers(1, 80), n=st.integers(1, 48), accumulate=st.booleans(),
       dtype=st.sampled_from(["bf16", "fp16", "fp32"]), strided_out=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_a_float_mmad_step_is_the_fp32_product_added_to_the_accumulator(m, k, n, accumulate, dtype, strided_out,
                                                                         seed):
    rng = np.random.default_rng(seed)
    dt = {"bf16": BF16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}[dtype]
    a = rng.standard_normal((m, k)).astype(dt)
    b = rng.standard_normal((k, n)).astype(dt)
    acc = rng.standard_normal((m, 2 * n if strided_out else n)).astype(np.float32)
    out = acc[:, ::2] if strided_out else acc
    want = out.copy()
    prod = (torch.from_numpy(a.astype(np.float32)) @ torch.from_numpy(b.astype(np.float32))).numpy()
    if accumulate:
        want += prod
    else:
        want[...] = prod
    cube_math.mmad_step(out, a, b, accumulate)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
