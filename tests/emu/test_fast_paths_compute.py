"""Fast paths of the compute kernels' host work (issue 19, decode attention and mla_prolog): each must give exactly
what the general path gives.

- ``View.typed``: a byte region re-typed as a tile in one memoised step, the same view as ``view_as``, slice and
  ``reshape`` one after the other.
- ``numerics.widen_bf16_into``: bf16 -> fp32 into a given array, bitwise ``widen_bf16`` for every bf16 pattern.
- ``cube_math.mmad_step`` widens bf16 operands and stages an accumulated product in reused scratch arrays: a step
  must not see what an earlier step left there, and the accumulator must never alias the scratch.
- ``kernel._check_index`` and ``vec.reduce_*`` shape checks without numpy probes: the same verdicts and messages.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import cube_math, numerics
from ascend_emu.arguments import is_int
from ascend_emu.errors import AddressError, ArgumentError, ShapeError
from ascend_emu.kernel import _check_index
from ascend_emu.views import Store, View

BF16 = np.dtype(ml_dtypes.bfloat16)
HYP = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")


def _region(nbytes: int, core=True) -> View:
    store = Store("r", nbytes + 64, False, "UB", 0, 0, core=object() if core else None)
    store.data[...] = np.random.default_rng(nbytes).integers(0, 256, store.nbytes, dtype=np.uint8)
    return View(store, 32, (nbytes,), (1,), np.dtype(np.uint8))


@HYP
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), dtype=st.sampled_from(["bf16", "fp32", "int8"]),
       local=st.booleans())
def test_typed_is_view_as_slice_reshape(shape, dtype, local):
    flat = _region(4 * 9 ** 3, core=local)
    t = flat.typed(tuple(shape), dtype)
    n = int(np.prod(shape))
    want = flat.view_as(dtype)[:n].reshape(*shape)
    assert (t.offset, t.shape, t.strides, t.dtype, t.lo, t.hi) == \
        (want.offset, want.shape, want.strides, want.dtype, want.lo, want.hi)
    assert t.arr.tobytes() == want.arr.tobytes()
    assert flat.typed(list(shape), dtype) is t            # memoised: one lookup per tile of a loop


def test_typed_of_a_strided_view_or_too_many_elements_raises():
    flat = _region(256)
    with pytest.raises(ShapeError):
        flat.view_as("int32").reshape(8, 8)[:, :4].typed((4, 4), "int32")
    with pytest.raises(Exception, match="out of range"):
        flat.typed((20, 8), "fp32")                        # 640 bytes from a 256-byte region


def test_widen_bf16_into_is_widen_bf16_for_every_pattern():
    bits = np.arange(2 ** 16, dtype=np.uint16).reshape(256, 256)
    a = bits.view(BF16)
    out = np.full(a.shape, 7.0, np.float32)
    numerics.widen_bf16_into(a, out)
    np.testing.assert_array_equal(out.view(np.uint32), numerics.widen_bf16(a).view(np.uint32))
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)


def _product(a, b):
    return (torch.from_numpy(a.astype(np.float32)) @ torch.from_numpy(b.astype(np.float32))).numpy()


@HYP
@given(m=st.integers(8, 64), k=st.sampled_from([32, 64, 128]), n=st.integers(16, 64),
       steps=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_float_mmad_steps_in_a_row_each_add_their_own_product(m, k, n, steps, seed):
    """Steps of one shape reuse the scratch arrays; every step's result is its own product (written out), whether
    an operand is a contiguous bf16 tile (the scratch path) or a strided one (widened on its own)."""
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((m, n)).astype(np.float32)
    want = acc.copy()
    for i, (accumulate, strided) in enumerate(steps):
        a = rng.standard_normal((m, 2 * k if strided else k)).astype(BF16)
        a = a[:, ::2] if strided else a
        b = rng.standard_normal((k, n)).astype(BF16)
        prod = _product(a, b)
        if accumulate or i == 0:
            want += prod
        else:
            want[...] = prod
        cube_math.mmad_step(acc, a, b, accumulate or i == 0)
        np.testing.assert_array_equal(acc.view(np.uint32), want.view(np.uint32))
    for arr, _ in cube_math._SCRATCH.values():
        assert not np.shares_memory(arr, acc)


# ---------------------------------------------------------------------------------------------- issue checks
def _tile(shape, dtype, space="UB", values=None) -> View:
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    store = Store("t", n + 64, False, space, 0, 0, core=None if space == "GM" else object())
    v = View(store, 32, tuple(shape), tuple(int(x) for x in np.empty(shape, dt).strides), dt)
    v.arr[...] = 0 if values is None else values
    return v


def _probe_verdict(tile, index):
    """The verdict of the numpy probe alone (the check before its fast paths): None (accepted) or (exception
    type, message)."""
    what = "get_value"
    for part in index if isinstance(index, tuple) else (index,):
        if not (is_int(part) or isinstance(part, (slice, list, np.ndarray)) or part is Ellipsis):
            return ArgumentError, f"{what}: index {index!r} is not an index of {tile.describe()} (integers and slices)"
    try:
        np.broadcast_to(np.empty((), np.bool_), tile.shape)[index]
    except IndexError as e:
        return AddressError, f"{what}: index {index!r} out of range for {tile.describe()} ({e})"
    except (TypeError, ValueError) as e:
        return ArgumentError, f"{what}: index {index!r} is not an index of {tile.describe()} ({e})"
    return None


INDEX = st.one_of(st.integers(-12, 12), st.tuples(st.integers(-9, 9)), st.tuples(st.integers(-9, 9),
                  st.integers(-9, 9)), st.tuples(st.integers(-3, 3), st.integers(-3, 3), st.integers(-3, 3)),
                  st.slices(10), st.just(()), st.just(Ellipsis), st.just(True), st.just(1.5), st.just("a"),
                  st.tuples(st.integers(0, 3), st.slices(8)))


EDGES = [((8,), i) for i in (7, 8, -8, -9, (7,), (8,), (-9,))] + \
    [((4, 8), i) for i in (3, 4, -4, -5, (3, 7), (4, 0), (3, 8), (-4, -8), (-5, 0), (0, -9), (0, 0, 0))] + \
    [((0,), 0), ((0,), -1), ((3, 0), (2, 0)), ((3, 0), 2)]


@pytest.mark.parametrize("shape, index", EDGES)
def test_check_index_at_the_edges(shape, index):
    _agrees_with_the_probe(shape, index)


@HYP
@given(shape=st.sampled_from([(8,), (4, 8), (1, 1), (0,), (3, 0)]), index=INDEX)
def test_check_index_agrees_with_the_probe(shape, index):
    _agrees_with_the_probe(shape, index)


def _agrees_with_the_probe(shape, index):
    tile = _tile(shape, np.int32)
    try:
        _check_index(tile, index, "get_value")
        got = None
    except (AddressError, ArgumentError) as e:
        got = (type(e), str(e))
    assert got == _probe_verdict(tile, index)
    if got is None:
        tile.arr[index]                                   # accepted: numpy indexes it
    else:
        assert "get_value: index" in got[1] and tile.describe() in got[1]


def test_reduce_dst_must_hold_the_rows():
    from ascend_emu import Pod, cloudmatrix384
    from ascend_emu.kernel import kernel as make_kernel

    @make_kernel(cores="aiv")
    def bad(ctx):
        src = ctx.ub.alloc((2, 3, 16), "fp32")
        dst = ctx.ub.alloc((8,), "fp32")
        yield ctx.vec.reduce_sum(dst, src)

    with pytest.raises(ShapeError, match=r"reduces the last axis of \(2, 3, 16\); dst \(8,\) must hold 6 elements"):
        Pod(cloudmatrix384(dies=1)).launch(bad, aiv=1)
