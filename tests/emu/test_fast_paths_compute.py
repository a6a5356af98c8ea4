"""Fast paths of the compute kernels' host work (issue 19, decode attention and mla_prolog): each must give exactly
what the general path gives.

- ``View.typed``: a byte region re-typed as a tile in one memoised step, the same view as ``view_as``, slice and
  ``reshape`` one after the other.
- ``numerics.widen_bf16_into``: bf16 -> fp32 into a given array, bitwise ``widen_bf16`` for every bf16 pattern.
- ``cube_math.mmad_step`` widens bf16 operands and stages an accumulated product in reused scratch arrays: a step
  must not see what an earlier step left there, and the accumulator must never alias the scratch.
- ``numerics.transpose_into`` (the transposed L1 -> L0 load) and ``numerics.cast_into`` (vec.cast): bitwise numpy's
  transpose and ``numerics.cast``, and nothing written when they decline.
- The data paths that write their tile directly (fixpipe, fp32 unary ufuncs, reductions, duplicate): bitwise what
  the general path (round the computed array, then store it) gives.
- ``kernel._check_index`` and ``vec.reduce_*`` shape checks without numpy probes: the same verdicts and messages.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import cube_math, isa, numerics
from ascend_emu.arguments import is_int
from ascend_emu.errors import AddressError, ArgumentError, ShapeError
from ascend_emu.isa import OPS, Instr
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


# ---------------------------------------------------------------------------------------------- transposed loads
def _bits(shape, dtype, seed):
    """Random bit patterns (NaNs and infs included) of a 2-byte or 4-byte dtype."""
    dt = np.dtype(dtype)
    u = np.dtype(f"uint{8 * dt.itemsize}")
    return np.random.default_rng(seed).integers(0, np.iinfo(u).max, shape, dtype=u, endpoint=True).view(dt)


@HYP
@given(r=st.integers(1, 72), c=st.integers(1, 72), pad=st.integers(0, 3), col=st.integers(0, 3),
       dtype=st.sampled_from([BF16, np.float16, np.int16, np.float32]), seed=st.integers(0, 2 ** 16))
def test_transpose_into_is_numpy_transpose(r, c, pad, col, dtype, seed):
    """Any column offset (aligned 32-bit pairs or not), row pitch, parity and dtype: the bytes of ``src.T``."""
    big = _bits((r, c + pad + col), dtype, seed)
    src = big[:, col:col + c]
    dst = np.zeros((c, r), dtype)
    numerics.transpose_into(src, dst)
    assert dst.tobytes() == np.ascontiguousarray(src.T).tobytes()


def test_transpose_into_takes_the_pair_path_for_an_l0_tile():
    """A [128, 128] bf16 column block of a [128, 512] L1 tile: the 32-bit pair kernel runs (and is exact)."""
    big = _bits((128, 512), BF16, 3)
    for col in (128, 1):                                  # 4-byte aligned columns, and a misaligned start
        src = big[:, col:col + 128]
        dst = np.zeros((128, 128), BF16)
        numerics.transpose_into(src, dst)
        assert dst.tobytes() == np.ascontiguousarray(src.T).tobytes()


# ---------------------------------------------------------------------------------------------- casts
@HYP
@given(shape=st.sampled_from([(64, 128), (3, 5), (1,), (2, 3, 4)]), dtype=st.sampled_from([BF16, np.float16,
                                                                                           np.float32]),
       mode=st.sampled_from(numerics.ROUND_MODES), strided=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_cast_into_is_cast(shape, dtype, mode, strided, seed):
    x = _bits(shape[:-1] + (2 * shape[-1],), np.float32, seed)
    src = x[..., ::2] if strided else x[..., :shape[-1]]
    out = np.zeros(shape, dtype)
    assert numerics.cast_into(src, out, mode)
    assert out.tobytes() == numerics.cast(np.ascontiguousarray(src), dtype, mode).tobytes()


def test_cast_into_declines_without_writing():
    x = np.arange(8, dtype=np.float32)
    for src, out in ((x, np.zeros(8, np.int32)),                 # not a float destination
                     (x, np.zeros((16,), BF16)[::2]),            # a strided destination
                     (x.astype(np.float16), np.zeros(8, BF16)),  # not an fp32 source
                     (x, np.zeros(4, BF16))):                    # another shape
        before = out.tobytes()
        assert not numerics.cast_into(src, out)
        assert out.tobytes() == before
    raw = np.zeros(64, np.uint8)                                  # an in-place narrowing overlaps its source
    assert not numerics.cast_into(raw.view(np.float32), raw[:32].view(BF16))


# ---------------------------------------------------------------------------------------------- data paths
def _tile(shape, dtype, space="UB", values=None) -> View:
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    store = Store("t", n + 64, False, space, 0, 0, core=None if space == "GM" else object())
    v = View(store, 32, tuple(shape), tuple(int(x) for x in np.empty(shape, dt).strides), dt)
    v.arr[...] = 0 if values is None else values
    return v


def _fixpipe_reference(src, dst_dtype, scale, relu):
    """The fixpipe's arithmetic written out: fp32 (int32 widened), times scale, ReLU, rounded to the dtype."""
    if dst_dtype == np.int32 and src.dtype == np.int32 and scale is None:
        return src.copy()
    v = src.astype(np.float32)
    if scale is not None:
        v = v * np.asarray(scale, dtype=np.float32)
    if relu:
        v = np.maximum(v, np.float32(0))
    return numerics.cast(v, dst_dtype)


@pytest.mark.parametrize("space", ["GM", "L1"])
@pytest.mark.parametrize("src_dt, dst_dt, scale, relu", [
    (np.float32, np.float32, None, False), (np.float32, np.float32, None, True), (np.float32, BF16, None, True),
    (np.float32, np.float16, 0.5, False), (np.int32, np.int32, None, False), (np.int32, np.float32, "col", True),
    (np.int32, BF16, 0.25, False), (np.int32, np.int8, None, False)])
def test_fixpipe_writes_or_samples_the_converted_tile_once(space, src_dt, dst_dt, scale, relu):
    rng = np.random.default_rng(7)
    vals = (rng.standard_normal((16, 32)) * 100).astype(src_dt)
    c = _tile((16, 32), src_dt, "L0C", vals)
    dst = _tile((16, 32), dst_dt, space)
    sc = rng.random(32).astype(np.float32) if scale == "col" else scale
    ins = Instr(OPS["copy_l0c_to_gm" if space == "GM" else "copy_l0c_to_l1"], (dst,), (c,),
                {"scale": sc, "relu": relu})
    isa.ex_fixpipe(ins)
    want = _fixpipe_reference(vals, np.dtype(dst_dt), sc, relu)
    if space == "GM":
        assert not dst.arr.any()                              # nothing lands before the end time
        got = ins.result
        c.arr[...] = 1                                         # the sample is the tile as it was at the start
        assert not np.shares_memory(got, c.arr)
    else:
        got = dst.arr
    assert got.dtype == np.dtype(dst_dt) and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name, fn", [("exp", np.exp), ("ln", np.log), ("sqrt", np.sqrt), ("abs", np.abs),
                                      ("neg", np.negative), ("rsqrt", lambda a: np.float32(1) / np.sqrt(a))])
@pytest.mark.parametrize("layout", ["apart", "in_place", "strided_src", "strided_dst"])
def test_unary_into_the_tile_is_the_stored_result(name, fn, layout):
    x = _bits((8, 64), np.float32, 11)
    x[:4] = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32) * 30    # finite values too
    src = _tile((8, 64), np.float32, values=x)
    dst = src if layout == "in_place" else _tile((8, 64), np.float32)
    if layout == "strided_src":
        src = _tile((8, 128), np.float32, values=np.repeat(x, 2, axis=1))[:, ::2]
    if layout == "strided_dst":
        dst = _tile((8, 128), np.float32)[:, ::2]
    with np.errstate(all="ignore"):
        want = fn(src.arr)                                # the general path: a new array, then stored
        isa.OPS[name].execute(Instr(OPS[name], (dst,), (src,)))
    assert dst.arr.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("name, fn", [("reduce_sum", np.sum), ("reduce_max", np.max), ("reduce_min", np.min)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int16, np.int32])
def test_reductions_are_numpys(name, fn, dtype):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 300)) * (1e4 if np.dtype(dtype).kind == "i" else 3)).astype(dtype)
    src = _tile((6, 300), dtype, values=x)
    dst = _tile((6, 1), dtype)
    with np.errstate(all="ignore"):
        OPS[name].execute(Instr(OPS[name], (dst,), (src,)))
        want = isa.rounded(fn(isa.widen(x), axis=-1), np.dtype(dtype)).reshape(6, 1)
    assert dst.arr.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype, value", [(np.float32, 0.1), (np.float32, -1e30), (np.float32, 2 ** 60 + 1),
                                          (BF16, 1 / 3), (np.float16, 70000.0), (np.int32, -7), (np.int8, 300),
                                          (np.float32, float("nan"))])
def test_duplicate_fills_the_value_rounded_once(dtype, value):
    dst = _tile((4, 24), dtype)
    isa.ex_duplicate(Instr(OPS["duplicate"], (dst,), (), {"value": value}))
    full = np.full((4, 24), value, dtype=np.float64 if np.dtype(dtype).kind == "f" or dtype == BF16 else np.int64)
    with np.errstate(all="ignore"):
        want = isa.rounded(full, np.dtype(dtype))
    assert dst.arr.tobytes() == want.tobytes()


def test_vector_cast_into_a_tile_and_through_the_general_path():
    x = _bits((8, 64), np.float32, 2)
    for dst, src in ((_tile((8, 64), BF16), _tile((8, 64), np.float32, values=x)),          # cast_into
                     (_tile((8, 64), np.int32), _tile((8, 64), np.float32, values=np.nan_to_num(x)))):
        isa.ex_cast(Instr(OPS["cast"], (dst,), (src,), {"round_mode": "floor"}))
        assert dst.arr.tobytes() == numerics.cast(src.arr, dst.dtype, "floor").tobytes()


# ---------------------------------------------------------------------------------------------- issue checks
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
