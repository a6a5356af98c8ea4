"""Hypothesis over the emulator's public entry points: ``Pod.alloc``, ``Pod.to_gm``, ``Pod.launch``/``stream``, the
kernel context's argument checks, vector arithmetic and casts. For any input the only allowed outcomes are a library
error (an ``EmulatorError``) whose message names the argument, or a result equal to the reference computed here.

Every case runs in a child process (``isolation.Child``): a case that crashes the interpreter or hangs fails its
example instead of the whole run. After every launch case the same pod must still run a good kernel correctly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ascend_emu import EmulatorError, Pod, cloudmatrix384, kernel, numerics
from ascend_emu.dtypes import as_dtype

from .isolation import Child

HYP = settings(max_examples=40, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BF16 = np.dtype(ml_dtypes.bfloat16)
GM_DTYPES = ["int8", "uint8", "int16", "int32", "int64", "uint32", "fp16", "bf16", "fp32", "fp64"]
JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.just(()),
                 st.lists(st.none(), max_size=2))


@pytest.fixture(scope="module")
def child():
    c = Child(timeout_s=120)
    yield c
    c.close()


def allowed(outcome, *names):
    """The outcome's value, or None after checking that it raised a library error naming one of ``names``."""
    if outcome.error is None:
        return outcome.value
    assert outcome.library, f"a non-library exception escaped: {outcome}\n{outcome.trace}"
    msg = outcome.message.lower()
    assert any(n.lower() in msg for n in names), f"the error names none of {names}: {outcome}"
    return None


def is_gm_dtype(d) -> bool:
    try:
        as_dtype(d)
    except EmulatorError:
        return False
    return True


def int_or_junk(low, high):
    return st.one_of(st.integers(low, high), st.integers(low, high).map(np.int64), JUNK)


# ---------------------------------------------------------------------------------------------- Pod.alloc
def case_alloc(die, shape, dtype, phantom):
    pod = Pod(cloudmatrix384(dies=2))
    t = pod.alloc(die, shape, dtype, phantom=phantom)
    zero = None if phantom else bool((t.numpy() == 0).all())
    return t.die, t.shape, as_dtype(t.dtype), t.phantom, zero


HUGE = st.sampled_from([2 ** 37, 2 ** 62, 2 ** 64])      # beyond a die's 64 GiB with any dtype
DIM = st.one_of(st.integers(-2, 9), HUGE, st.floats(-1, 9), st.just("3"), st.booleans())
SHAPES = st.one_of(DIM, st.lists(DIM, max_size=3), st.lists(DIM, max_size=3).map(tuple), st.text(max_size=2))
DTYPES = st.one_of(st.sampled_from(GM_DTYPES + ["float32", "int4", "", "FP32"]),
                   st.sampled_from([np.float32, np.int8, np.complex64, np.bool_, torch.bfloat16, torch.int64]),
                   JUNK)


@HYP
@given(die=int_or_junk(-1, 3), shape=SHAPES, dtype=DTYPES, phantom=st.booleans())
def test_alloc(child, die, shape, dtype, phantom):
    got = allowed(child.call(case_alloc, die, shape, dtype, phantom), "die", "shape", "dtype", "bytes")
    if got is None:
        return
    dims = shape if isinstance(shape, (list, tuple)) else (shape,)
    assert got[:4] == (int(die), tuple(int(d) for d in dims), as_dtype(dtype), phantom)
    assert got[4] in (None, True)                           # fresh GM is zero-filled


# ---------------------------------------------------------------------------------------------- Pod.to_gm
def case_to_gm(array, dtype):
    pod = Pod(cloudmatrix384(dies=1))
    return pod.to_gm(0, array, dtype=dtype).numpy()


def die_cast(a: np.ndarray, dst: np.dtype) -> np.ndarray:
    """The reference: what the die's own vec.cast (rint) makes of host data; float64 reaches a narrow float through
    float32 as torch's .to does; integers saturate."""
    flat = a.reshape(-1)
    if dst.kind in "iu":
        info = np.iinfo(dst)
        if a.dtype.kind in "iub":
            vals = [int(v) for v in flat]
        else:
            vals = [0 if np.isnan(v) else (info.max if v > 0 else info.min) if np.isinf(v) else round(float(v))
                    for v in flat.astype(np.float64)]
        return np.array([min(max(v, info.min), info.max) for v in vals], dst).reshape(a.shape)
    if a.dtype.kind in "iub":
        wide = np.array([float(int(v)) for v in flat], np.float64).reshape(a.shape)
        return wide if dst == np.float64 else numerics.cast(wide, dst)
    if dst == np.float64:
        return a.astype(np.float64)
    return numerics.cast(np.ascontiguousarray(a, dtype=np.float32), dst)


ARRAY_DTYPES = st.sampled_from([np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint32, np.uint64,
                                np.float16, np.float32, np.float64, np.complex64])


@st.composite
def host_arrays(draw):
    dt = np.dtype(draw(ARRAY_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=2, max_side=6))
    a = draw(hnp.arrays(dt, shape))
    if draw(st.booleans()) and dt.kind == "f":
        a = a.astype(np.float32).astype(BF16)            # bf16 host data
    if draw(st.booleans()):
        a = a.T if a.ndim == 2 else a[::2]              # non-contiguous input
    return a


@HYP
@given(array=host_arrays(), dtype=st.one_of(st.none(), st.sampled_from(GM_DTYPES), st.just("int4")))
def test_to_gm(child, array, dtype):
    got = allowed(child.call(case_to_gm, array, dtype), "array", "dtype")
    if got is None:                                       # refused: complex data or a dtype GM does not have
        assert array.dtype.kind == "c" or not is_gm_dtype(array.dtype if dtype is None else dtype)
        return
    dst = as_dtype(dtype) if dtype is not None else as_dtype(array.dtype)
    ref = array if dst == array.dtype else die_cast(array, dst)
    assert got.dtype == dst and got.shape == array.shape
    with np.errstate(invalid="ignore"):
        assert np.array_equal(got.astype(np.float64), ref.astype(np.float64), equal_nan=True), (array, got, ref)


# ---------------------------------------------------------------------------------------------- Pod.launch / stream
@kernel(cores="aiv")
def count_cores(ctx, counters):
    yield ctx.atomic_add(counters[ctx.die], 1)


def case_launch(die, dies, aiv, mode, wait_timeout_us, args_as_list):
    pod = Pod(cloudmatrix384(dies=3), max_modeled_us=1000)
    counters = [pod.alloc(d, (1,), "int32") for d in range(3)]
    args = [counters] if args_as_list else counters       # a bare list of tensors is not an argument tuple
    try:
        pod.launch(count_cores, die=die, dies=dies, aiv=aiv, mode=mode, wait_timeout_us=wait_timeout_us, args=args)
        first = [int(c.numpy()[0]) for c in counters]
    finally:                                              # whatever happened, the pod still runs a good launch
        before = int(counters[2].numpy()[0])
        pod.launch(count_cores, die=2, aiv=3, args=(counters,))
        assert int(counters[2].numpy()[0]) == before + 3, "the pod is unusable after that launch"
    return first


def reference_cores(aiv) -> int:
    if aiv is None:
        return 48
    return int(aiv) if isinstance(aiv, (int, np.integer)) else len(aiv)


@HYP
@given(die=int_or_junk(-1, 3),
       dies=st.one_of(st.none(), st.lists(int_or_junk(-1, 3), max_size=4), JUNK),
       aiv=st.one_of(st.none(), st.integers(-1, 50), st.lists(st.integers(-1, 50), max_size=4), JUNK,
                     st.lists(st.floats(0, 4), min_size=1, max_size=2)),
       mode=st.sampled_from([None, "single-op", "graph", "eager"]),
       wait_timeout_us=st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=2)),
       args_as_list=st.booleans())
def test_launch(child, die, dies, aiv, mode, wait_timeout_us, args_as_list):
    got = allowed(child.call(case_launch, die, dies, aiv, mode, wait_timeout_us, args_as_list),
                  "die", "aiv", "mode", "wait_timeout_us", "args")
    if got is None:
        return
    on = [int(d) for d in dies] if dies is not None else [int(die)]
    assert got == [reference_cores(aiv) if d in on else 0 for d in range(3)]


# ---------------------------------------------------------------------------------------------- kernel instructions
@kernel(cores="aiv")
def one_instruction(ctx, op, a, b, flag, out):
    """Issue one instruction ``op`` with arguments ``a``, ``b``; what it yields goes to ``out``."""
    t = ctx.ub.alloc((8,), flag.dtype)
    yield ctx.copy_gm_to_ub(t, flag[1:9], pad=True)        # 0..7
    if op == "get_value":
        out.append((yield ctx.get_value(t, a)))
    elif op == "gm_store":
        yield ctx.gm_store(flag[0:1], a)
    elif op == "atomic_add":
        out.append((yield ctx.atomic_add(flag[0:1], a)))
    elif op == "wait_gm":
        out.append((yield ctx.wait_gm(flag[0:1], a, b, timeout_us=5.0)))
    elif op == "scalar":
        yield ctx.scalar(a)
    elif op == "cross_core_wait":
        yield ctx.cross_core_wait(a)
    elif op == "barrier":
        yield ctx.barrier(a)
    elif op == "after":
        yield ctx.gm_store(flag[0:1], 1, after=a)
    elif op == "dma_engine":
        yield ctx.dma_copy(flag[9:17], flag[1:9], engine=a)
    yield ctx.pipe_barrier()


def case_instruction(op, dtype, a, b):
    pod = Pod(cloudmatrix384(dies=1), max_modeled_us=1000)
    flag = pod.to_gm(0, np.concatenate([[0], np.arange(8), np.zeros(8)]).astype(np.int32))
    if dtype != "int32":
        flag = pod.to_gm(0, np.concatenate([[0], np.arange(8), np.zeros(8)]).astype(as_dtype(dtype)))
    out = []
    pod.launch(one_instruction, aiv=1, args=(op, a, b, flag, out))
    return out, flag.numpy()[0].item()


VALUES = st.one_of(st.integers(-2 ** 40, 2 ** 40), st.integers(-300, 300), st.floats(allow_nan=True), JUNK,
                   st.lists(st.integers(0, 3), max_size=3))
INDICES = st.one_of(st.integers(-10, 10), st.tuples(st.integers(-2, 9)), st.slices(10), JUNK)
INSTRUCTIONS = st.one_of(
    st.tuples(st.just("get_value"), st.just("int32"), INDICES, st.none()),
    st.tuples(st.sampled_from(["gm_store", "atomic_add"]), st.sampled_from(["int32", "fp32", "int8"]), VALUES,
              st.none()),
    st.tuples(st.just("wait_gm"), st.just("int32"), st.sampled_from(["eq", "ne", "gt", "xx", 3]), VALUES),
    st.tuples(st.sampled_from(["scalar", "cross_core_wait", "dma_engine"]), st.just("int32"), VALUES, st.none()),
    st.tuples(st.sampled_from(["barrier", "after"]), st.just("int32"),
              st.one_of(st.sampled_from(["all", "die", "aiv", "MTE3", "V", ("MTE2", "DMA")]), JUNK), st.none()),
)


def stored(value, dtype):
    """What a scalar store of ``value`` leaves in a word of ``dtype``: integers exactly, floats rounded (RNE)."""
    dt = as_dtype(dtype)
    want = np.asarray(value).astype(dt) if dt.kind == "i" else np.asarray(value, np.float32)
    return np.broadcast_to(want, (1,))[0]                 # the one word the store wrote


@HYP
@given(case=INSTRUCTIONS)
def test_instruction_arguments(child, case):
    op, dtype, a, b = case
    got = allowed(child.call(case_instruction, op, dtype, a, b), op, "value", "index", "cycles", "flag", "cmp",
                  "engine", "group", "after", "wait bound", "timeout", "phantom", "max_modeled_us")
    if got is None:
        return
    out, first = got
    if op == "get_value":
        assert np.array_equal(np.asarray(out[0]), np.arange(8)[a])
    elif op == "gm_store":
        assert np.array_equal(first, stored(a, dtype), equal_nan=True)
    elif op == "atomic_add":
        assert out[0] == 0
        assert np.array_equal(first, stored(a, dtype), equal_nan=True)
    elif op == "wait_gm":                                 # flag[0] is 0: satisfied at once or never
        assert {"eq": np.equal, "ne": np.not_equal, "gt": np.greater}[a](0, b)
        assert np.array_equal(out[0], [0])


# ---------------------------------------------------------------------------------------------- vector arithmetic
@kernel(cores="aiv")
def binary_op(ctx, op, x, y, z):
    tx, ty = ctx.ub.alloc(x.shape, x.dtype), ctx.ub.alloc(y.shape, y.dtype)
    yield ctx.copy_gm_to_ub(tx, x)
    yield ctx.copy_gm_to_ub(ty, y)
    yield getattr(ctx.vec, op)(tx, tx, ty)
    yield ctx.copy_ub_to_gm(z, tx)


def case_binary(op, x, y):
    pod = Pod(cloudmatrix384(dies=1))
    gx, gy = pod.to_gm(0, x), pod.to_gm(0, y)
    z = pod.alloc(0, x.shape, x.dtype)
    pod.launch(binary_op, aiv=1, args=(op, gx, gy, z))
    return z.numpy()


def reference_binary(op, x, y):
    if x.dtype.kind == "i":                                # exact in int64, then wrapped to the dtype
        a, b = x.astype(np.int64), y.astype(np.int64)
        if op == "div":
            return (np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(x.dtype)
        return {"add": a + b, "sub": a - b, "mul": a * b, "max": np.maximum(a, b), "min": np.minimum(a, b)}[op] \
            .astype(x.dtype)
    a, b = x.astype(np.float32), y.astype(np.float32)     # fp16: computed in fp32, rounded once (innocuous)
    with np.errstate(all="ignore"):
        r = {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b, "max": np.maximum(a, b),
             "min": np.minimum(a, b)}[op]
    return r.astype(x.dtype)


@st.composite
def operands(draw):
    dt = np.dtype(draw(st.sampled_from([np.int16, np.int32, np.float16, np.float32])))
    n = 32 // dt.itemsize * draw(st.integers(1, 4))       # whole 32-byte blocks
    x = draw(hnp.arrays(dt, n))
    y = draw(hnp.arrays(dt, n))
    return x, y


@HYP
@given(op=st.sampled_from(["add", "sub", "mul", "div", "max", "min"]), xy=operands())
def test_vector_binary(child, op, xy):
    x, y = xy
    got = allowed(child.call(case_binary, op, x, y), "division by zero")
    if got is None:
        assert op == "div" and x.dtype.kind == "i" and not y.all()
        return
    ref = reference_binary(op, x, y)
    with np.errstate(invalid="ignore"):
        assert np.array_equal(got, ref, equal_nan=True), (x, y, got, ref)


# ---------------------------------------------------------------------------------------------- casts
@HYP
@given(bits=hnp.arrays(np.uint32, st.integers(1, 64)), target=st.sampled_from([BF16, np.dtype(np.float16)]))
def test_narrowing_casts_are_torchs_bits_except_nan_payloads(bits, target):
    """fp32 -> bf16/fp16 (rint) equals torch bit for bit on every non-NaN input; a NaN becomes the canonical quiet NaN
    with its sign (the documented exception: torch's NaN bits depend on its code path)."""
    x = bits.view(np.float32)
    got = numerics.cast(x, target).view(np.uint16)
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16 if target == BF16 else torch.float16).view(torch.int16)
    ref = ref.numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], ref[~nan])
    quiet = 0x7FC0 if target == BF16 else 0x7E00
    assert np.array_equal(got[nan], np.where(bits[nan] >> 31 == 1, quiet | 0x8000, quiet).astype(np.uint16))
