"""The instruction table: one row per op -> its pipe, its kind, its data path and its cost.

Kinds, which decide how the scheduler treats an instruction:
- ``compute``: touches only the issuing core's buffers (vector, cube, L1 -> L0 loads, scalar reads of local data);
  its time follows from its operands' dependencies and its pipe alone.
- ``transfer``: crosses into global memory, so it competes for shared servers (HBM, fabric ports, DMA engines); it
  reserves them in simulated-time order.
- ``sync``: observes or changes shared state at a point in simulated time (GM flags, atomics, polls, barriers,
  cross-core flags); a handler in the scheduler runs it.

Data paths run at an instruction's start time (inputs sampled then); outputs to core-local buffers are written then
(no one can read them before the instruction ends: dependency tracking), outputs to GM land at its end time.
Adding an instruction is adding a row here and a method on the kernel context.
"""
from __future__ import annotations

import operator

import numpy as np

from . import cube_math, numerics
from .dtypes import bf16, fp16, fp32, int8, int32
from .timing import cube_cycles, vector_cycles

COMPUTE, TRANSFER, SYNC = 0, 1, 2


class OpSpec:
    __slots__ = ("name", "pipe", "kind", "execute", "commit", "cost", "cpr", "gm_rows", "lends", "row")

    def __init__(self, name, pipe, kind, execute=None, commit=None, cost=None, cpr=1.0, gm_rows=False,
                 lends=False, row=0):
        self.name = name
        self.pipe = pipe          # "MTE2", "MTE3", "MTE1", "CUBE", "VECTOR", "FIXP", "SCALAR", "DMA"
        self.kind = kind
        self.execute = execute    # data path at start time: fn(ins)
        self.commit = commit      # GM landing at end time: fn(ins)
        self.cost = cost          # compute kinds: fn(ins, prof) -> (duration_ps, latency_ps)
        self.cpr = cpr            # vector: cycles per 256-byte repeat
        self.gm_rows = gm_rows    # transfers that touch only some rows of their GM view (ins.p["rows"])
        # GM-bound copies whose ``execute`` only samples the source for the commit: the engine lends the source
        # instead (engine.Engine._lend) and copies it at the landing, unless a write to it comes first
        self.lends = lends
        self.row = row            # its row in ``OPS`` (< _ROWS_MAX): with a byte count, one int keys its cost memo


class Instr:
    """One issued instruction. Fields after ``p`` are the scheduler's."""

    __slots__ = ("spec", "dsts", "srcs", "p", "core", "ready", "pending", "waiters", "start", "busy_end", "end",
                 "blocking", "result", "real", "nbytes", "dur", "lat", "path", "pipe_prev", "pipe_end", "hb", "origin",
                 "loan")

    def __init__(self, spec: OpSpec, dsts: tuple, srcs: tuple, p=None, blocking: bool = False):
        _fill(self, spec, dsts, srcs, p, blocking)

    def __repr__(self):
        return f"<Instr {self.spec.name} start={self.start} end={self.end}>"   # -1: not scheduled yet


def new_instr(spec: OpSpec, dsts: tuple, srcs: tuple, p=None, blocking: bool = False) -> Instr:
    """``Instr(spec, dsts, srcs, p, blocking)``; compiled, a C call (isa.pxd) that allocates and fills it without
    the class call's argument parsing: the kernel context makes every instruction through it."""
    ins = Instr.__new__(Instr)
    _fill(ins, spec, dsts, srcs, p, blocking)
    return ins


def _fill(ins: Instr, spec: OpSpec, dsts: tuple, srcs: tuple, p, blocking: bool) -> None:
    ins.spec = spec
    ins.dsts = dsts
    ins.srcs = srcs
    ins.p = p
    ins.blocking = blocking
    ins.pending = 0
    ins.waiters = None        # flat pairs: a dependent instruction, which of my times it waits for (a list made
    #                           by the first: most instructions never have one)
    ins.start = -1            # times in ps, -1 until the scheduler knows them
    ins.busy_end = -1
    ins.end = -1
    ins.pipe_prev = None      # the previous instruction of my pipe on my core, until my times are known
    ins.pipe_end = -1         # the latest end of me and every earlier instruction of my pipe on my core
    ins.result = None
    ins.hb = None             # the race sanitizer's happens-before record (None: not sanitized)
    ins.nbytes = 0
    ins.dur = 0
    ins.lat = 0
    ins.origin = None         # tracing: {"kernel", "function", "source"} of the line that issued it
    ins.loan = None           # what a lent copy reads at its landing (Engine._execute: sources copied once)


# ---------------------------------------------------------------------------------------------- data paths
def store_values(view, values) -> None:
    """Write float32/int values into a view, rounding to its dtype the way the die does (RNE, saturating ints)."""
    view.arr[...] = rounded(values, view.dtype)


def rounded(values, dt) -> np.ndarray:
    """``values`` as dtype ``dt``, rounded the way the die stores them (``store_values``)."""
    v = np.asarray(values)
    if v.dtype != dt:
        if dt == bf16 or dt == fp16 or (dt.kind in "iu" and v.dtype.kind == "f"):
            v = numerics.cast(np.ascontiguousarray(v, dtype=np.float32 if v.dtype.kind == "f" else v.dtype), dt)
        else:
            v = v.astype(dt)
    return v


def widen(a: np.ndarray) -> np.ndarray:
    """fp16/bf16 -> fp32 for arithmetic (exact)."""
    if a.dtype == bf16:
        return numerics.widen_bf16(a)
    if a.dtype == fp16:
        return a.astype(np.float32)
    return a


def ex_copy(ins):
    ins.dsts[0].arr[...] = ins.srcs[0].arr


def ex_sample(ins):
    """GM-bound outputs: sample the source now, land it at the end time (the engine defers it: ``OpSpec.lends``).
    A lent source is read where the loan points (``Instr.loan``: the source, or the GM bytes it stands for)."""
    src = ins.loan if ins.loan is not None else ins.srcs[0]
    ins.result = np.array(src.arr, copy=True)


def cm_copy(ins):
    ins.dsts[0].arr[...] = ins.result


def cm_atomic_add(ins):
    """GM atomic add (SetAtomicAdd): integers wrap, floats add in fp32 and store rounded (RNE)."""
    dst = ins.dsts[0]
    d = dst.arr
    if d.dtype.kind in "iu":
        d += ins.result.astype(d.dtype)
    else:
        store_values(dst, widen(d).astype(np.float32) + widen(ins.result).astype(np.float32))


def rows_of(ins):
    """The row indices of a gather / scatter (a host array, or the values of an int32 UB tile)."""
    rows = ins.p["rows"]
    if rows.__class__ is not np.ndarray and hasattr(rows, "store"):     # hasattr fails slowly on arrays
        r = rows.arr
        if r is None:
            from .errors import AddressError
            raise AddressError(f"row indices {rows.describe()} are phantom: index tiles are control data, "
                               f"allocate them with phantom=False")
        return np.asarray(r, dtype=np.int64).reshape(-1)
    return rows


def ex_gather(ins):
    src = ins.srcs[0]
    rows = rows_of(ins)
    _check_rows(rows, src.shape[0], src)
    ins.dsts[0].arr[...] = src.arr[rows]


def ex_scatter_sample(ins):
    dst = ins.dsts[0]
    rows = rows_of(ins)
    _check_rows(rows, dst.shape[0], dst)
    ins.result = (rows.copy(), np.array(ins.srcs[0].arr, copy=True))


def cm_scatter(ins):
    rows, vals = ins.result
    ins.dsts[0].arr[rows] = vals


def _check_rows(rows, n, view):
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        from .errors import AddressError
        bad = int(rows.min() if rows.min() < 0 else rows.max())
        raise AddressError(f"row index {bad} out of range 0..{n - 1} of {view.describe()}")


def ex_mmad(ins):
    c = ins.dsts[0]
    a, b = ins.srcs[0].arr, ins.srcs[1].arr
    if a.dtype == int8 and cube_math.FUSE_INT8_K:
        cube_math.defer_int8_mmad(c, a, b, ins.p["accumulate"])     # one multiply for the tile's K steps
        return
    cube_math.settle(c)
    cube_math.mmad_step(c.arr, a, b, ins.p["accumulate"])


def ex_fixpipe(ins):
    """L0C (fp32 / int32) -> dst dtype, with optional dequant scale and ReLU; samples for a GM landing. Each result
    is made once: converted into a new array (the GM sample), or written into an L1 destination as it is made."""
    c = ins.srcs[0]
    cube_math.settle(c)
    src = c.arr
    p = ins.p
    dst = ins.dsts[0]
    to_gm = dst.store.space == "GM"
    scale = p.get("scale")
    if dst.dtype == int32 and src.dtype == int32 and scale is None:
        v = src                                             # int32 -> int32 passes as it is (no ReLU)
    else:
        v = src if src.dtype == fp32 else src.astype(np.float32)
        if scale is not None:
            if hasattr(scale, "store"):
                scale = scale.arr
            v = v * np.asarray(scale, dtype=np.float32)
        if p.get("relu"):
            v = np.maximum(v, np.float32(0), out=None if v is src else v)     # in place on a temporary
        if dst.dtype != fp32:
            v = numerics.cast(np.ascontiguousarray(v, dtype=np.float32), dst.dtype)
    if to_gm:
        ins.result = v.copy() if v is src else v            # sampled now: L0C may be rewritten before landing
    else:
        dst.arr[...] = v


def ex_load2d(ins):
    src = ins.srcs[0].arr
    if ins.p.get("transpose"):
        numerics.transpose_into(src, ins.dsts[0].arr)
    else:
        ins.dsts[0].arr[...] = src


# vector ---------------------------------------------------------------------------------------------------
def _into(dst, fn, a, b) -> bool:
    """``fn(a, b, out=dst)`` when the result needs no rounding (fp32 operands and destination) and has the
    destination's shape: the value ``store_values`` would store, without a temporary. Overlapping operands are
    numpy's to buffer, as if the result were computed first."""
    d = dst.arr
    if d.dtype != fp32 or a.dtype != fp32 or b.dtype != fp32 or (a.shape != d.shape and b.shape != d.shape):
        return False
    fn(a, b, out=d)
    return True


def _vec_binary(fn):
    exact = fn in _EXACT_BINARY

    def ex(ins):
        a = widen(ins.srcs[0].arr)
        b = widen(ins.srcs[1].arr)
        if not (exact and _into(ins.dsts[0], fn, a, b)):
            store_values(ins.dsts[0], fn(a, b))
    return ex


def _vec_scalar(fn):
    exact = fn in _EXACT_BINARY

    def ex(ins):
        src = ins.srcs[0].arr
        a = widen(src)
        # the scalar operand has the tile's dtype (Adds<half> takes a half scalar), then widens like the tile
        s = np.asarray(ins.p["scalar"], dtype=src.dtype).astype(a.dtype)
        if not (exact and _into(ins.dsts[0], fn, a, s)):
            store_values(ins.dsts[0], fn(a, s))
    return ex


def divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The vector unit's divide: floats as IEEE division in the (widened) operand dtype; integers exactly,
    truncating toward zero like C and Ascend's integer ops (7 / 2 = 3, -7 / 2 = -3), not through a float.
    The quotient is stored like every integer result: INT_MIN / -1 wraps to INT_MIN. An integer division by zero
    has no defined result: ``NumericError`` (floats give inf / NaN)."""
    if a.dtype.kind not in "iu":
        return np.divide(a, b)
    a64 = a.astype(np.int64)
    b64 = np.asarray(b).astype(np.int64)
    if not b64.all():
        from .errors import NumericError
        raise NumericError(f"vec.div: integer division by zero ({int(np.sum(b64 == 0))} zero divisor(s) among "
                           f"{b64.size})")
    q = np.abs(a64) // np.abs(b64)
    return np.where((a64 < 0) != (b64 < 0), -q, q)


def _vec_unary(fn):
    ufunc = fn if isinstance(fn, np.ufunc) else None

    def ex(ins):
        src = ins.srcs[0].arr
        if ufunc is not None:
            d = ins.dsts[0].arr
            # fp32 in and out, both C-contiguous: the ufunc writes the tile itself. Its loop sees the strides of a
            # fresh output (numpy computes an exact in-place operand like a separate one), so the same values
            if (src.dtype == fp32 and d.dtype == fp32 and src.shape == d.shape and src.flags.c_contiguous and
                    d.flags.c_contiguous):
                ufunc(src, out=d)
                return
        store_values(ins.dsts[0], fn(widen(src)))
    return ex


def _vec_reduce(fn):
    reduce = fn.reduce        # np.sum / np.max / np.min's own call, without their Python wrapper

    def ex(ins):
        a = widen(ins.srcs[0].arr)
        r = reduce(a, axis=-1)
        store_values(ins.dsts[0], r.reshape(ins.dsts[0].shape))
    return ex


def ex_duplicate(ins):
    """Every element is the value rounded once to the tile's dtype (elementwise: one element, then a fill)."""
    d = ins.dsts[0]
    dt = d.dtype
    one = np.full((), ins.p["value"], dtype=np.float64 if dt.kind == "f" or dt == bf16 else np.int64)
    d.arr[...] = rounded(one, dt)


def ex_broadcast(ins):
    ins.dsts[0].arr[...] = np.broadcast_to(ins.srcs[0].arr, ins.dsts[0].shape)


def ex_cast(ins):
    src = ins.srcs[0].arr
    d = ins.dsts[0].arr
    mode = ins.p["round_mode"]
    if not numerics.cast_into(src, d, mode):
        d[...] = numerics.cast(np.ascontiguousarray(src), d.dtype, mode)


def ex_compare(ins):
    a = widen(ins.srcs[0].arr)
    b = widen(ins.srcs[1].arr) if len(ins.srcs) > 1 else np.asarray(ins.p["scalar"], dtype=a.dtype)
    r = COMPARE[ins.p["cmp"]](a, b)
    ins.dsts[0].arr[...] = r.astype(ins.dsts[0].dtype)


def ex_select(ins):
    m = ins.srcs[0].arr != 0
    a = widen(ins.srcs[1].arr)
    b = widen(ins.srcs[2].arr)
    store_values(ins.dsts[0], np.where(m, a, b))


def ex_quant(ins):
    x = ins.srcs[0].arr
    x2 = x.reshape(-1, x.shape[-1])
    smooth = ins.srcs[1].arr if len(ins.srcs) > 1 else None
    if numerics.quant_int8_rows_into(x2, smooth, ins.dsts[0].arr, ins.dsts[1].arr):
        return                                              # written in place: the same bytes
    q, s = numerics.quant_int8_rows(np.ascontiguousarray(x2), smooth)
    ins.dsts[0].arr[...] = q.reshape(ins.dsts[0].shape)
    ins.dsts[1].arr[...] = s.reshape(ins.dsts[1].shape)


def ex_dequant(ins):
    q = ins.srcs[0].arr
    rs = ins.srcs[1].arr.reshape(-1)
    cs = ins.srcs[2].arr.reshape(-1) if len(ins.srcs) > 2 else None
    q2 = np.ascontiguousarray(q.reshape(-1, q.shape[-1]))
    if q.dtype == int8:
        r = numerics.dequant_int8_rows(q2, rs, cs)
    else:  # int32 accumulators (a GEMM epilogue): exact in fp32 while |acc| < 2^24, same operation order
        r = q2.astype(np.float32) * rs[:, None]
        if cs is not None:
            r = r * cs[None, :]
    store_values(ins.dsts[0], r.reshape(ins.dsts[0].shape))


def ex_get_value(ins):
    a = ins.srcs[0].arr
    if a is None:
        from .errors import AddressError
        raise AddressError(f"get_value from phantom {ins.srcs[0].describe()}: scalar-read data is control data, "
                           f"allocate it with phantom=False")
    ins.result = a[ins.p["index"]].item() if np.ndim(a[ins.p["index"]]) == 0 else np.array(a[ins.p["index"]])


def ex_set_value(ins):
    store_values(ins.dsts[0], ins.p["value"])


# IEEE-exact elementwise ops (correctly rounded on every code path): safe to write straight into an fp32 tile
_EXACT_BINARY = (np.add, np.subtract, np.multiply, np.maximum, np.minimum)

COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
           "ge": np.greater_equal}
_WORD_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
                 "ge": operator.ge}


def word_poll(src, cmp: str, value) -> tuple | None:
    """(compare, int) for a poll of one integer word against an integer scalar: Python ints compare exactly as
    numpy's ufunc does, without a ufunc call at every landing on a flag or counter; None otherwise (arrays, floats,
    64-bit unsigned words, which numpy may compare as floats against signed ones)."""
    dt, vt = src.dtype, value.dtype
    if (src.numel == 1 and value.ndim == 0 and dt.kind in "iu" and vt.kind in "iu" and
            not (dt.kind == "u" and dt.itemsize == 8) and not (vt.kind == "u" and vt.itemsize == 8)):
        return _WORD_COMPARE[cmp], int(value)
    return None


# costs ----------------------------------------------------------------------------------------------------
# [the profile, {key: cost}, the profile's ub_align]: costs under the last profile used. A kernel repeats a few tile
# shapes, so their costs are memoised per profile (profiles are frozen; a new one, or a full memo, starts over). Keys:
# bytes * _ROWS_MAX + the spec's row for vector ops (one int: no key tuple to build and hash per instruction),
# (m, k, n, dtype) for mmads, (bytes-per-cycle attribute, bytes) for local copies. Values: the (duration, latency)
# tuple the cost function returns, made once.
_VECTOR_PS = [None, {}, 32]
_VECTOR_MEMO_MAX = 4096


def _memo(prof) -> dict:
    """The cost memo of profile ``prof`` (``_VECTOR_PS``), started over for a new profile or when full."""
    memo = _VECTOR_PS[1]
    if _VECTOR_PS[0] is not prof or len(memo) > _VECTOR_MEMO_MAX:
        memo = {}
        _VECTOR_PS[0] = prof
        _VECTOR_PS[1] = memo
        _VECTOR_PS[2] = prof.ub_align
    return memo


def cost_vector(ins, prof):
    """The widest operand's 32-byte blocks, in 256-byte repeats: a repeat takes eight 32-byte blocks at any block and
    repeat stride (Ascend C's repeat parameters), so a strided operand costs the blocks it touches, not its extent."""
    memo = _memo(prof)
    align = _VECTOR_PS[2]
    nbytes = 0
    for v in ins.dsts:
        n = _aligned_blocks_bytes(v, align)
        if n > nbytes:
            nbytes = n
    for v in ins.srcs:
        n = _aligned_blocks_bytes(v, align)
        if n > nbytes:
            nbytes = n
    spec = ins.spec
    key = nbytes * _ROWS_MAX + spec.row
    ps = memo.get(key)
    if ps is None:
        ps = memo[key] = (prof.cycles_to_ps(vector_cycles(prof, nbytes, spec.cpr)), 0)
    return ps


def _aligned_blocks_bytes(v, align: int) -> int:
    """The bytes of view ``v``'s blocks, each rounded up to ``align``."""
    blk = v._blk
    if blk is None:
        blk = v._layout()
    count = blk[0]              # C integers in the build (isa.pxd): a vector op's cost took a tenth of its issue
    block = blk[1]
    return count * (-(-block // align) * align)


def cost_mmad(ins, prof):
    a = ins.srcs[0]
    m, k = a.shape
    n = ins.srcs[1].shape[1]
    dt = a.dtype
    memo = _memo(prof)
    key = (m, k, n, dt)
    ps = memo.get(key)
    if ps is None:
        k0 = prof.cube_k_int8 if dt == int8 else prof.cube_k_fp32 if dt == fp32 else prof.cube_k_fp16
        ps = memo[key] = (prof.cycles_to_ps(cube_cycles(prof, m, n, k, k0)), 0)
    return ps


def cost_local_copy(bytes_per_cycle_attr):
    def cost(ins, prof):
        nbytes = ins.srcs[0].nbytes
        memo = _memo(prof)
        key = (bytes_per_cycle_attr, nbytes)
        ps = memo.get(key)
        if ps is None:
            cycles = prof.mte_startup_cycles + nbytes / getattr(prof, bytes_per_cycle_attr)
            ps = memo[key] = (prof.cycles_to_ps(cycles), 0)
        return ps
    return cost


def cost_scalar(ins, prof):
    return prof.cycles_to_ps(prof.scalar_op_cycles), 0


# the table ------------------------------------------------------------------------------------------------
OPS: dict[str, OpSpec] = {}
_ROWS_MAX = 256


def _row(name, pipe, kind, execute=None, commit=None, cost=None, cpr=1.0, gm_rows=False):
    assert len(OPS) < _ROWS_MAX, "the cost memo's keys leave room for _ROWS_MAX rows"
    OPS[name] = OpSpec(name, pipe, kind, execute, commit, cost, cpr, gm_rows, lends=execute is ex_sample,
                       row=len(OPS))
    return OPS[name]


# data movement
_row("copy_gm_to_ub", "MTE2", TRANSFER, ex_copy)
_row("copy_gm_to_l1", "MTE2", TRANSFER, ex_copy)
_row("gather_gm_to_ub", "MTE2", TRANSFER, ex_gather, gm_rows=True)
_row("copy_ub_to_gm", "MTE3", TRANSFER, ex_sample, cm_copy)
_row("copy_ub_to_gm_add", "MTE3", TRANSFER, ex_sample, cm_atomic_add)
_row("scatter_ub_to_gm", "MTE3", TRANSFER, ex_scatter_sample, cm_scatter, gm_rows=True)
_row("copy_l0c_to_gm", "FIXP", TRANSFER, ex_fixpipe, cm_copy)
_row("copy_l0c_to_l1", "FIXP", COMPUTE, ex_fixpipe, cost=cost_local_copy("l0c_to_l1_bytes_per_cycle"))
_row("copy_l1_to_l0a", "MTE1", COMPUTE, ex_load2d, cost=cost_local_copy("l1_to_l0a_bytes_per_cycle"))
_row("copy_l1_to_l0b", "MTE1", COMPUTE, ex_load2d, cost=cost_local_copy("l1_to_l0b_bytes_per_cycle"))
_row("copy_ub_to_ub", "MTE2", COMPUTE, ex_copy, cost=cost_local_copy("ub_to_ub_bytes_per_cycle"))
_row("dma_copy", "DMA", TRANSFER, ex_sample, cm_copy)
# cube
_row("mmad", "CUBE", COMPUTE, ex_mmad, cost=cost_mmad)
# vector: cycles per 256-byte repeat; transcendental and divide take several passes
for _name, _fn, _cpr in (("add", np.add, 1), ("sub", np.subtract, 1), ("mul", np.multiply, 1),
                         ("div", divide, 4), ("max", np.maximum, 1), ("min", np.minimum, 1)):
    _row(_name, "VECTOR", COMPUTE, _vec_binary(_fn), cost=cost_vector, cpr=_cpr)
for _name, _fn, _cpr in (("adds", np.add, 1), ("muls", np.multiply, 1), ("maxs", np.maximum, 1),
                         ("mins", np.minimum, 1), ("divs", divide, 4)):
    _row(_name, "VECTOR", COMPUTE, _vec_scalar(_fn), cost=cost_vector, cpr=_cpr)
for _name, _fn, _cpr in (("exp", np.exp, 2), ("ln", np.log, 2), ("sqrt", np.sqrt, 2),
                         ("rsqrt", lambda a: np.float32(1) / np.sqrt(a), 3), ("abs", np.abs, 1),
                         ("relu", lambda a: np.maximum(a, a.dtype.type(0)), 1), ("neg", np.negative, 1),
                         ("reciprocal", lambda a: np.float32(1) / a, 4), ("vcopy", lambda a: a, 1)):
    _row(_name, "VECTOR", COMPUTE, _vec_unary(_fn), cost=cost_vector, cpr=_cpr)
for _name, _fn in (("reduce_sum", np.add), ("reduce_max", np.maximum), ("reduce_min", np.minimum)):
    _row(_name, "VECTOR", COMPUTE, _vec_reduce(_fn), cost=cost_vector, cpr=2)
_row("duplicate", "VECTOR", COMPUTE, ex_duplicate, cost=cost_vector)
_row("broadcast", "VECTOR", COMPUTE, ex_broadcast, cost=cost_vector)
_row("cast", "VECTOR", COMPUTE, ex_cast, cost=cost_vector)
_row("compare", "VECTOR", COMPUTE, ex_compare, cost=cost_vector)
_row("select", "VECTOR", COMPUTE, ex_select, cost=cost_vector)
# abs, row max, divide, scale, round+cast: five passes over the row
_row("quant_int8", "VECTOR", COMPUTE, ex_quant, cost=cost_vector, cpr=5)
_row("dequant_int8", "VECTOR", COMPUTE, ex_dequant, cost=cost_vector, cpr=3)
# scalar unit on local data
_row("get_value", "SCALAR", COMPUTE, ex_get_value, cost=cost_scalar)
_row("set_value", "SCALAR", COMPUTE, ex_set_value, cost=cost_scalar)
# synchronisation and GM control (handlers live in the scheduler)
for _name in ("gm_load", "gm_store", "atomic_add", "atomic_cas", "wait_gm", "barrier", "cross_core_set",
              "cross_core_wait", "pipe_barrier", "kernel_end"):
    _row(_name, "SCALAR", SYNC)
