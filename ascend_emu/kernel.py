"""Kernels and the context they program the die through.

A kernel is a generator function ``fn(ctx, *args)`` run once per core of a launch. It allocates tiles in its core's
buffers and yields instructions made by the context; the scheduler times and executes them::

    @kernel(cores="aiv")
    def scale_rows(ctx, x_gm, y_gm, rows_per_core):
        x = ctx.ub.alloc((2, R, H), "fp32")               # two slots: double buffering
        for i, r in enumerate(range(lo, hi, R)):
            yield ctx.copy_gm_to_ub(x[i % 2], x_gm[r:r + R])     # MTE2
            yield ctx.vec.muls(x[i % 2], x[i % 2], 2.0)          # VECTOR, waits for the copy
            yield ctx.copy_ub_to_gm(y_gm[r:r + R], x[i % 2])     # MTE3, may target another die

Instruction methods check operands when they are called (capacity was checked at alloc): a misaligned copy, a wrong
dtype or a tile of another core raises at once with the numbers. ``yield`` of a blocking instruction (``get_value``,
``gm_load``, ``atomic_add``, ``wait_gm``, ``barrier``, ``cross_core_wait``, ``pipe_barrier``) returns its value.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .arguments import is_int
from .buffers import LocalBuffer, LocalTensor
from .dtypes import bf16, fp16, fp32, int8, int16, int32, name_of, uint8
from .errors import AddressError, AlignmentError, ArgumentError, DTypeError, NumericError, ShapeError
from .isa import COMPARE, OPS, Instr, new_instr, word_poll
from .memory import GMTensor
from .timing import burst_bytes
from .views import View

_VEC_ARITH = frozenset((fp16, fp32, int16, int32))
_SRC_NAMES = ("src0", "src1", "src2", "src3")
_CUBE_OUT = {fp16: fp32, bf16: fp32, int8: int32, fp32: fp32}
# the OpSpecs of the hot instructions as module constants (C globals in the build, kernel.pxd): a lookup in OPS by
# name cost a dict probe per instruction
_COPY_GM_TO_UB, _COPY_GM_TO_L1 = OPS["copy_gm_to_ub"], OPS["copy_gm_to_l1"]
_COPY_UB_TO_GM, _COPY_UB_TO_GM_ADD = OPS["copy_ub_to_gm"], OPS["copy_ub_to_gm_add"]
(_V_ADD, _V_SUB, _V_MUL, _V_DIV, _V_MAX, _V_MIN, _V_ADDS, _V_MULS, _V_MAXS, _V_MINS,
 _V_DIVS, _V_EXP, _V_LN, _V_SQRT, _V_RSQRT, _V_ABS, _V_RELU, _V_NEG, _V_RECIPROCAL, _V_VCOPY) = [OPS[n] for n in (
    "add", "sub", "mul", "div", "max", "min", "adds", "muls", "maxs", "mins",
    "divs", "exp", "ln", "sqrt", "rsqrt", "abs", "relu", "neg", "reciprocal", "vcopy")]


class Kernel:
    """A kernel function plus the kind of cores it runs on: "aiv", "aic" or "mix" (AIC + its two AIVs).

    ``comm=True`` marks a kernel that carries the fitted start-up residual of the operators it was fitted on
    (``profile.comm_start_us``: the fused dispatch / combine of kernels.fused_moe, see kernels.calibrate): its cores
    start that long after launch. Other kernels model their costs instead and leave it False.

    ``work``: ``work(die, cores, *args) -> float``, an estimate of the instructions the launch's ``cores`` cores on
    ``die`` issue (its loops' trip counts times the instructions per trip is enough): a run over several workers
    splits the dies by it (ascend_emu.work). None: every core of a launch counts the same."""

    def __init__(self, fn, cores: str = "aiv", name: str | None = None, comm: bool = False, work=None):
        if cores not in ("aiv", "aic", "mix"):
            raise ArgumentError(f"cores={cores!r}: use 'aiv', 'aic' or 'mix'")
        if work is not None and not callable(work):
            raise ArgumentError(f"work={work!r}: a function work(die, cores, *args) -> estimated instructions, or None")
        self.fn = fn
        self.cores = cores
        self.comm = comm
        self.work = work
        self.name = name or fn.__name__
        functools.update_wrapper(self, fn)

    def __call__(self, ctx, *args):
        return self.fn(ctx, *args)

    def __repr__(self):
        return f"<Kernel {self.name} cores={self.cores}>"


def kernel(fn=None, *, cores: str = "aiv", name: str | None = None, comm: bool = False, work=None):
    """Decorator: ``@kernel(cores="aiv")``. A bare ``@kernel`` means vector cores. ``work``: see ``Kernel``."""
    if fn is None:
        return lambda f: Kernel(f, cores, name, comm, work)
    return Kernel(fn, cores, name, comm, work)


class _Buffer:
    """A core-local buffer of the context (``ctx.ub``, ``ctx.l1``, ...): this core's, or ``AddressError`` when its
    kind has none (UB belongs to AIVs, L1/L0A/L0B/L0C/BT/FB to AICs)."""

    def __init__(self, name: str):
        self.slot, self.space = "_" + name, name.upper()

    def __get__(self, ctx, owner=None):
        if ctx is None:
            return self
        b = getattr(ctx, self.slot)
        if b is None:
            if self.space == "UB":
                raise AddressError(f"{ctx._owner} has no UB: unified buffers belong to vector cores (AIV)")
            raise AddressError(f"{ctx._owner} has no {self.space}: it belongs to cube cores (AIC)")
        return b


class KernelContext:
    """What one core of a launch sees: its identity, its buffers, and the instruction set.

    Identity: ``die``, ``rank`` (index of the die in the launch), ``num_ranks``, ``core_kind`` ("aiv"/"aic"),
    ``block_idx``/``block_num`` (index/count among the launch's cores of this kind), and in MIX launches
    ``group_idx`` (the AIC of the group) and ``sub_block_idx`` (0/1 for the two AIVs).
    """

    def __init__(self, engine, core, launch, block_idx: int, block_num: int, group_idx: int, sub_block_idx: int):
        prof = engine.prof
        self._engine = engine
        self._core = core
        self._paths = engine.paths
        self.profile = prof
        self.die = core.die
        self.rank = launch.dies.index(core.die)
        self.num_ranks = len(launch.dies)
        self.core_kind = core.kind
        self.core_idx = core.idx
        self.block_idx = block_idx
        self.block_num = block_num
        self.group_idx = group_idx
        self.sub_block_idx = sub_block_idx
        self.is_aiv = core.kind == "aiv"
        self.is_aic = core.kind == "aic"
        self.args = launch.args
        owner = core.where
        self._owner = owner
        phantom = not launch.numeric
        self._ub = self._l1 = self._l0a = self._l0b = self._l0c = self._bt = self._fb = None
        if self.is_aiv:
            self._ub = LocalBuffer("UB", prof.ub_bytes, prof.ub_align, owner, core.die, phantom)
        else:
            self._l1 = LocalBuffer("L1", prof.l1_bytes, prof.l1_align, owner, core.die, phantom)
            self._l0a = LocalBuffer("L0A", prof.l0a_bytes, prof.l0ab_align, owner, core.die, phantom)
            self._l0b = LocalBuffer("L0B", prof.l0b_bytes, prof.l0ab_align, owner, core.die, phantom)
            self._l0c = LocalBuffer("L0C", prof.l0c_bytes, prof.l0c_align, owner, core.die, phantom)
            self._bt = LocalBuffer("BT", prof.bt_bytes, prof.bt_align, owner, core.die, phantom)
            self._fb = LocalBuffer("FB", prof.fb_bytes, prof.fb_align, owner, core.die, phantom)
        self._timeout_ps = launch.wait_timeout_ps
        self._burst_bytes = prof.burst_bytes
        self._routes = {}         # mover -> GM die (a read's, or -1 - a write's) -> its timing.Route (_route)
        self._rd_mover = self._wr_mover = None    # the last read's / write's mover, GM die and route (_xfer)
        self._rd_die = self._wr_die = 0
        self._rd_route = self._wr_route = None
        self._align_of = {"UB": prof.ub_align, "L1": prof.l1_align, "L0A": prof.l0ab_align, "L0B": prof.l0ab_align,
                          "L0C": prof.l0c_align, "BT": prof.bt_align, "FB": prof.fb_align}
        self._last_space = None   # the space _space_align answered last, and its alignment
        self._last_align = 0
        self.vec = Vector(self)

    def _retire(self) -> None:
        """This core has finished: release what links its tiles and instructions into cycles (LocalBuffer.retire)."""
        for buf in (self._ub, self._l1, self._l0a, self._l0b, self._l0c, self._bt, self._fb):
            if buf is not None:
                buf.retire()
        self.vec = None           # the vector unit refers back to the context: unlinked, the context and every tile
        #                           it holds are freed by reference counting, not by a collection pass after the run

    # the buffers of this core's kind; the others raise (descriptors, not a __getattr__ hook, which would slow every
    # attribute lookup on the context)
    ub = _Buffer("ub")
    l1 = _Buffer("l1")
    l0a = _Buffer("l0a")
    l0b = _Buffer("l0b")
    l0c = _Buffer("l0c")
    bt = _Buffer("bt")
    fb = _Buffer("fb")

    @property
    def now_us(self) -> float:
        """The core's scalar time in microseconds (when it issues its next instruction)."""
        return self._core.time / 1e6

    # ------------------------------------------------------------------ operand checks
    def _local(self, v, spaces, arg: str, aligned: bool = True) -> None:
        if not isinstance(v, LocalTensor):
            raise AddressError(f"{arg} must be a local tile in {'/'.join(spaces)}, got {_what(v)}")
        tile = v                  # a View (kernel.pxd): its fields without attribute lookups
        st = tile.store
        if st.space not in spaces:
            raise AddressError(f"{arg} is in {st.space}, this instruction needs {'/'.join(spaces)}: {v.describe()}")
        if st.core is not self._owner and st.core != self._owner:
            raise AddressError(f"{arg} {v.describe()} belongs to {st.core}, not to {self._owner}")
        if aligned:
            align = self._space_align(st.space)
            if (st.base + tile.offset) % align:
                raise AlignmentError(f"{arg} {v.describe()} starts at byte {st.base + v.offset} of {st.space}, "
                                     f"not a multiple of the {align}-byte {st.space} alignment")

    def _space_align(self, space) -> int:
        """The alignment of local space ``space`` (bytes): the last space's by identity before the dict (a core
        checks mostly one space, its UB or L1, at every operand)."""
        if space is not self._last_space:
            self._last_align = self._align_of[space]
            self._last_space = space
        return self._last_align

    def _gm(self, v, arg: str) -> None:
        if not isinstance(v, GMTensor):
            raise AddressError(f"{arg} must be a GM tensor, got {_what(v)}")

    def _align(self, local, gm, pad: bool, what: str) -> int:
        """Check a GM <-> local copy's alignment; return the bytes it moves (whole bursts per GM block)."""
        align = self._space_align(local.store.space)
        if local.offset % align:
            raise AlignmentError(f"{what}: {local.describe()} starts at byte {local.offset} of its allocation, "
                                 f"not a multiple of the {align}-byte {local.store.space} alignment")
        burst = self._burst_bytes
        g = gm._blk
        if g is None:
            g = gm._layout()
        block = g[1]
        if not pad:
            if block % burst:
                _burst_error(what, gm, g, burst)
            blk = local._blk
            if blk is None:
                blk = local._layout()
            lblock = blk[1]
            if lblock % burst:
                _burst_error(what, local, blk, burst)
        count = g[0]
        return count * (-(-block // burst) * burst)

    def _xfer(self, spec, mover, dst, src, src_die, dst_die, nbytes, p=None) -> Instr:
        """A copy ``spec`` (an OpSpec) between a local tile and GM on die ``src_die`` (a read) or ``dst_die`` (a
        write)."""
        ins = new_instr(spec, (dst,), (src,), p)
        # the last read's and the last write's route first (C compares: a tile loop reads and writes the same dies
        # through the same movers), then this core's routes by mover and GM die
        if dst_die is None:
            die = src_die
            if mover is not self._rd_mover or die != self._rd_die:
                self._rd_route = self._route(mover, src_die, None, die)
                self._rd_mover = mover
                self._rd_die = die
            ins.path = self._rd_route
        else:
            die = -1 - dst_die
            if mover is not self._wr_mover or die != self._wr_die:
                self._wr_route = self._route(mover, src_die, dst_die, die)
                self._wr_mover = mover
                self._wr_die = die
            ins.path = self._wr_route
        ins.nbytes = nbytes
        return ins

    def _route(self, mover, src_die, dst_die, die: int):
        """The timing.Route of ``mover`` from ``src_die`` to ``dst_die`` (one None: this core), memoised by mover
        and ``die`` (a read's GM die, or -1 - a write's): Paths.path's five-part key cost as much as the rest of
        the issue."""
        by_die = self._routes.get(mover)
        if by_die is None:
            by_die = self._routes[mover] = {}
        r = by_die.get(die)
        if r is None:
            r = by_die[die] = self._paths.path(mover, self.die, src_die, dst_die)
        return r

    def _burst(self, v) -> int:
        count, block = v.blocks()
        return burst_bytes(count, block, self.profile.burst_bytes)

    # ------------------------------------------------------------------ GM <-> UB / L1 (MTE2 / MTE3)
    def copy_gm_to_ub(self, dst: LocalTensor, src: GMTensor, *, pad: bool = False) -> Instr:
        """mtu-in (MTE2): GM (any die) -> this AIV's UB. ``pad`` allows blocks that are not 32-byte multiples."""
        self._local(dst, ("UB",), "dst")
        self._gm(src, "src")
        _same(dst, src, "copy_gm_to_ub")
        nbytes = self._align(dst, src, pad, "copy_gm_to_ub")
        return self._xfer(_COPY_GM_TO_UB, "MTE2", dst, src, _die(src), None, nbytes)

    mtu_in = copy_gm_to_ub

    def copy_ub_to_gm(self, dst: GMTensor, src: LocalTensor, *, pad: bool = False, atomic: str | None = None) -> Instr:
        """mtu-out (MTE3): this AIV's UB -> GM on any die; lands at the end time. ``atomic="add"`` accumulates
        into GM (SetAtomicAdd: fp32 math, stored in the GM dtype)."""
        self._local(src, ("UB",), "src")
        self._gm(dst, "dst")
        _same(dst, src, "copy_ub_to_gm")
        nbytes = self._align(src, dst, pad, "copy_ub_to_gm")
        if atomic is not None and atomic != "add":
            raise ArgumentError(f"atomic={atomic!r}: only 'add' is supported")
        return self._xfer(_COPY_UB_TO_GM_ADD if atomic else _COPY_UB_TO_GM, "MTE3", dst, src, None, _die(dst), nbytes)

    mtu_out = copy_ub_to_gm

    def copy_gm_to_l1(self, dst: LocalTensor, src: GMTensor, *, pad: bool = False) -> Instr:
        """MTE2: GM -> this AIC's L1."""
        self._local(dst, ("L1",), "dst")
        self._gm(src, "src")
        _same(dst, src, "copy_gm_to_l1")
        nbytes = self._align(dst, src, pad, "copy_gm_to_l1")
        return self._xfer(_COPY_GM_TO_L1, "MTE2", dst, src, _die(src), None, nbytes)

    def gather_gm_to_ub(self, dst: LocalTensor, src: GMTensor, rows) -> Instr:
        """MTE2 row gather: ``dst[i] = src[rows[i]]``. ``rows`` is a host sequence or an int32 UB tile (read when
        the copy starts; index tiles are control data and stay real in timing-only runs)."""
        return self._row_copy("gather_gm_to_ub", "MTE2", dst, src, gm=src, local=dst, rows=rows)

    def scatter_ub_to_gm(self, dst: GMTensor, src: LocalTensor, rows) -> Instr:
        """MTE3 row scatter: ``dst[rows[i]] = src[i]``, landing at the end time."""
        return self._row_copy("scatter_ub_to_gm", "MTE3", dst, src, gm=dst, local=src, rows=rows)

    def _row_copy(self, name, mover, dst, src, gm, local, rows) -> Instr:
        self._local(local, ("UB",), "dst" if local is dst else "src")
        self._gm(gm, "src" if gm is src else "dst")
        rows, n = self._rows(rows, local.shape[0], gm.shape[0], name)
        if dst.dtype != src.dtype or tuple(dst.shape[1:]) != tuple(src.shape[1:]):
            raise ShapeError(f"{name}: tile rows {local.shape[1:]} {name_of(local.dtype)} do not match GM rows "
                             f"{gm.shape[1:]} {name_of(gm.dtype)}")
        row_bytes = gm[0].nbytes if gm.shape[0] else 0
        nbytes = burst_bytes(n, row_bytes, self.profile.burst_bytes)
        gm_die = gm.store.die
        ins = self._xfer(OPS[name], mover, dst, src, gm_die if gm is src else None, gm_die if gm is dst else None,
                         nbytes, {"rows": rows})
        if isinstance(rows, View):
            ins.srcs = (src, rows)
        return ins

    def _rows(self, rows, n_tile, n_gm, what):
        if isinstance(rows, View):
            self._local(rows, ("UB",), "rows")
            if rows.dtype not in (int32, np.dtype(np.int64)):
                raise DTypeError(f"{what}: rows tile must be int32, got {name_of(rows.dtype)}")
            n = rows.numel
        else:
            rows = np.asarray(rows, dtype=np.int64)
            if rows.ndim != 1:
                rows = rows.reshape(-1)
            n = len(rows)
            if n:
                first, last = _row_range(rows)
                if first < 0 or last >= n_gm:
                    raise AddressError(f"{what}: row index {first if first < 0 else last} out of range "
                                       f"0..{n_gm - 1}")
        if n != n_tile:
            raise ShapeError(f"{what}: {n} row indices for a tile of {n_tile} rows")
        return rows, n

    # ------------------------------------------------------------------ DMA engine (GM -> GM, any dies)
    def dma_copy(self, dst: GMTensor, src: GMTensor, *, engine: int = 0) -> Instr:
        """GM -> GM through this die's DMA engine: large start-up, no UB, any size. Lands at the end time."""
        self._gm(dst, "dst")
        self._gm(src, "src")
        _same(dst, src, "dma_copy")
        if not is_int(engine) or not 0 <= engine < self.profile.dma_engines_per_die:
            raise AddressError(f"dma_copy: engine {engine} out of range 0..{self.profile.dma_engines_per_die - 1}")
        ins = new_instr(OPS["dma_copy"], (dst,), (src,))
        ins.path = self._paths.path("DMA", self.die, src.store.die, dst.store.die, engine)
        ins.nbytes = max(self._burst(src), self._burst(dst))
        return ins

    # ------------------------------------------------------------------ cube core: L1 -> L0, mmad, fixpipe
    def copy_l1_to_l0a(self, dst: LocalTensor, src: LocalTensor, *, transpose: bool = False) -> Instr:
        """MTE1: L1 -> L0A (the left matrix, [M, K])."""
        return self._load2d("copy_l1_to_l0a", "L0A", dst, src, transpose)

    def copy_l1_to_l0b(self, dst: LocalTensor, src: LocalTensor, *, transpose: bool = False) -> Instr:
        """MTE1: L1 -> L0B (the right matrix, [K, N])."""
        return self._load2d("copy_l1_to_l0b", "L0B", dst, src, transpose)

    def _load2d(self, name, space, dst, src, transpose):
        self._local(dst, (space,), "dst")
        self._local(src, ("L1",), "src")
        shape = tuple(reversed(src.shape)) if transpose else src.shape
        if dst.dtype != src.dtype or dst.shape != shape:
            raise ShapeError(f"{name}: dst {dst.shape} {name_of(dst.dtype)} != src {shape} {name_of(src.dtype)}"
                             f"{' (transposed)' if transpose else ''}")
        return new_instr(OPS[name], (dst,), (src,), {"transpose": transpose})

    def mmad(self, c: LocalTensor, a: LocalTensor, b: LocalTensor, *, accumulate: bool = False) -> Instr:
        """CUBE: c[M, N] (L0C) (+)= a[M, K] (L0A) @ b[K, N] (L0B). fp16/bf16 -> fp32, int8 -> int32 (exact)."""
        self._local(c, ("L0C",), "c")
        self._local(a, ("L0A",), "a")
        self._local(b, ("L0B",), "b")
        if a.ndim != 2 or b.ndim != 2 or c.ndim != 2 or a.shape[1] != b.shape[0] or \
                c.shape != (a.shape[0], b.shape[1]):
            raise ShapeError(f"mmad: a {a.shape} @ b {b.shape} -> c {c.shape} do not fit ([M,K] @ [K,N] -> [M,N])")
        if a.dtype != b.dtype or a.dtype not in _CUBE_OUT or c.dtype != _CUBE_OUT[a.dtype]:
            raise DTypeError(f"mmad: a {name_of(a.dtype)}, b {name_of(b.dtype)} -> c {name_of(c.dtype)} is not a "
                             f"cube mode (fp16/bf16 -> fp32, int8 -> int32, fp32 -> fp32)")
        return new_instr(OPS["mmad"], (c,), (a, b), {"accumulate": accumulate})

    def copy_l0c_to_gm(self, dst: GMTensor, src: LocalTensor, *, scale=None, relu: bool = False) -> Instr:
        """FIXP: L0C -> GM (any die), converting to dst's dtype on the way (RNE); ``scale`` (a float, a host
        array [N], or an FB/UB fp32 tile [N]) dequantises int32 accumulators per output channel."""
        self._local(src, ("L0C",), "src")
        self._gm(dst, "dst")
        _same(dst, src, "copy_l0c_to_gm", check_dtype=False)
        self._check_fix(dst, src, scale)
        ins = new_instr(OPS["copy_l0c_to_gm"], (dst,), (src,), {"scale": scale, "relu": relu})
        ins.path = self._paths.path("FIXP", self.die, None, dst.store.die)
        ins.nbytes = self._burst(dst)
        if isinstance(scale, View):
            ins.srcs = (src, scale)
        return ins

    def copy_l0c_to_l1(self, dst: LocalTensor, src: LocalTensor, *, scale=None, relu: bool = False) -> Instr:
        """FIXP: L0C -> L1 with the same conversions as copy_l0c_to_gm."""
        self._local(src, ("L0C",), "src")
        self._local(dst, ("L1",), "dst")
        _same(dst, src, "copy_l0c_to_l1", check_dtype=False)
        self._check_fix(dst, src, scale)
        ins = new_instr(OPS["copy_l0c_to_l1"], (dst,), (src,), {"scale": scale, "relu": relu})
        if isinstance(scale, View):
            ins.srcs = (src, scale)
        return ins

    def _check_fix(self, dst, src, scale):
        if dst.dtype not in (fp32, fp16, bf16, int32, int8):
            raise DTypeError(f"fixpipe: dst dtype {name_of(dst.dtype)} not supported (fp32, fp16, bf16, int32, int8)")
        if dst.dtype == int32 and scale is not None:
            raise DTypeError("fixpipe: a dequant scale needs a float dst dtype")
        if isinstance(scale, View) and scale.store.space not in ("FB", "UB", "L1"):
            raise AddressError(f"fixpipe scale {scale.describe()} must be in FB")

    # ------------------------------------------------------------------ scalar unit
    def get_value(self, tile: LocalTensor, index) -> Instr:
        """Blocking scalar read of one element (or a small slice) of a local tile; yields the value."""
        self._local(tile, ("UB", "L1", "FB"), "tile", aligned=False)
        _check_index(tile, index, "get_value")
        return new_instr(OPS["get_value"], (), (tile,), {"index": index}, blocking=True)

    def set_value(self, tile: LocalTensor, index, value) -> Instr:
        """Scalar write of one element of a local tile (floats rounded to its dtype; integers must fit it)."""
        self._local(tile, ("UB", "L1", "FB"), "tile", aligned=False)
        view = tile[index]
        return new_instr(OPS["set_value"], (view,), (), {"value": _fit_value(view, value, "set_value", "value")})

    def _fields_ps(self, v: GMTensor) -> int:
        """Scalar cost of a poll loop reading every 32-byte field a view spans, beyond the first: the scalar unit
        reads them one load at a time, each after a data-cache invalidate (DataCacheCleanAndInvalid, so it sees
        other cores' writes), so each is one round trip to the memory the view lives in."""
        fields = min(v.numel, -(-(v.hi - v.lo) // 32))
        return max(fields - 1, 0) * self._lat(v, True)

    def _lat(self, v: GMTensor, round_trip: bool) -> int:
        lat = self._paths.scalar_lat(self.die, v.store.die, round_trip)
        jitter = self._paths.jitter
        if jitter is not None:
            # a posted store (the only one-way access) keeps one latency per path, so that one core's stores to a
            # word still land in issue order
            lat = jitter.latency(lat) if round_trip else jitter.fixed(lat, (self._owner, v.store.die))
        return lat

    def gm_load(self, src: GMTensor) -> Instr:
        """Blocking scalar read of GM (small control data); yields a copy of the values."""
        self._gm(src, "src")
        return new_instr(OPS["gm_load"], (), (src,), {"lat": self._lat(src, True)}, blocking=True)

    def gm_store(self, dst: GMTensor, value, *, after: str | tuple | None = None) -> Instr:
        """Posted scalar write to GM (a flag); lands one path latency later. ``after`` = a pipe name, a tuple of
        pipe names, or "all": the store waits until those pipes' earlier work is visible (Ascend C: SetFlag/WaitFlag
        from each pipe to S before the store). Integer values must fit ``dst``'s dtype."""
        self._gm(dst, "dst")
        value = _control_value(dst, value, "gm_store", "value")
        return new_instr(OPS["gm_store"], (dst,), (), {"value": value, "after": _after(after, "gm_store"),
                                                   "lat": self._lat(dst, False), "issue": self._engine.issue_ps})

    def atomic_add(self, dst: GMTensor, value, *, after: str | tuple | None = None) -> Instr:
        """Blocking GM atomic add; yields the old value. ``after`` as for gm_store. Integers wrap on overflow;
        the value itself must fit ``dst``'s dtype."""
        self._gm(dst, "dst")
        _check_atomic(dst, "atomic_add")
        value = _control_value(dst, value, "atomic_add", "value")
        return new_instr(OPS["atomic_add"], (dst,), (), {"value": value, "after": _after(after, "atomic_add"),
                                                     "lat": self._lat(dst, True)}, blocking=True)

    def atomic_cas(self, dst: GMTensor, expected, value, *, after: str | tuple | None = None) -> Instr:
        """Blocking GM compare-and-swap on one word; yields the old value (swapped iff old == expected)."""
        self._gm(dst, "dst")
        _check_atomic(dst, "atomic_cas")
        if dst.numel != 1:
            raise ShapeError(f"atomic_cas works on one word, got {dst.describe()}")
        expected = np.asarray(_control_value(dst, expected, "atomic_cas", "expected")).item()
        value = _control_value(dst, value, "atomic_cas", "value")
        return new_instr(OPS["atomic_cas"], (dst,), (), {"expected": expected, "value": value,
                                                     "after": _after(after, "atomic_cas"),
                                                     "lat": self._lat(dst, True)}, blocking=True)

    def wait_gm(self, src: GMTensor, cmp: str, value, *, timeout_us: float | None = -1.0,
                how: str = "all", on_timeout: str = "raise") -> Instr:
        """Blocking poll until every element (``how="any"``: some element) of ``src`` satisfies ``cmp``
        (eq, ne, lt, le, gt, ge) ``value`` (a scalar, or an array broadcast against ``src``).

        Event-driven: the core sleeps until a write to ``src`` lands. Bounded: past ``timeout_us`` of simulated
        time (default: the launch's ``wait_timeout_us``; None = unbounded) it raises DeadlockError, or with
        ``on_timeout="return"`` yields None so the kernel can react (resend to a replica, give up). Yields the
        values seen."""
        self._gm(src, "src")
        if cmp not in COMPARE:
            raise ArgumentError(f"cmp={cmp!r}: use one of {sorted(COMPARE)}")
        if how not in ("all", "any"):
            raise ArgumentError(f"how={how!r}: use 'all' or 'any'")
        if on_timeout not in ("raise", "return"):
            raise ArgumentError(f"on_timeout={on_timeout!r}: use 'raise' or 'return'")
        value = _check_number(value, "wait_gm", "value", src)
        if on_timeout == "return" and (timeout_us is None or (timeout_us == -1.0 and self._timeout_ps is None)):
            raise ArgumentError("on_timeout='return' needs a finite timeout_us")
        timeout_ps = self._timeout_ps if timeout_us == -1.0 else (None if timeout_us is None
                                                                 else int(timeout_us * 1e6))
        return new_instr(OPS["wait_gm"], (), (src,), {"cmp": cmp, "fn": COMPARE[cmp], "value": value, "how": how,
                                                  "word": word_poll(src, cmp, value),
                                                  "on_timeout": on_timeout,
                                                  "timeout_ps": timeout_ps,
                                                  "lat": self._lat(src, True) + self._fields_ps(src)},
                     blocking=True)

    def barrier(self, group: str = "all") -> Instr:
        """Blocking barrier (SyncAll) over the launch's cores: group "all", "aiv", "aic", or "die" (only this
        die's cores of a multi-die launch)."""
        if group not in ("all", "aiv", "aic", "die"):
            raise ArgumentError(f"group={group!r}: use 'all', 'aiv', 'aic' or 'die'")
        return new_instr(OPS["barrier"], (), (), {"group": group}, blocking=True)

    def cross_core_set(self, flag: int, *, after: str | None = None) -> Instr:
        """Set cross-core flag ``flag`` (0..15) toward the paired core(s) of this MIX group (AIC -> both AIVs,
        AIV -> its AIC). It fires once ``after`` pipe's earlier work is visible (default: FIXP on an AIC, MTE3
        on an AIV), as CrossCoreSetFlag<mode 2, pipe> does."""
        _check_flag(flag)
        after = after or ("FIXP" if self.is_aic else "MTE3")
        lat = int(self.profile.flag_latency_ns * 1000)
        jitter = self._paths.jitter
        if jitter is not None:      # one latency per core: its sets of a flag land in issue order
            lat = jitter.fixed(lat, (self._owner, "cross-core"))
        return new_instr(OPS["cross_core_set"], (), (), {"flag": flag, "after": after, "lat": lat})

    def cross_core_wait(self, flag: int) -> Instr:
        """Blocking wait for cross-core flag ``flag``; an AIC waits for both its AIVs, decrementing each."""
        _check_flag(flag)
        return new_instr(OPS["cross_core_wait"], (), (), {"flag": flag}, blocking=True)

    def pipe_barrier(self) -> Instr:
        """Blocking: wait until every instruction this core issued so far has finished and its writes are
        visible (PipeBarrier<PIPE_ALL> plus a fence on outstanding GM writes)."""
        return new_instr(OPS["pipe_barrier"], (), (), None, blocking=True)

    def scalar(self, cycles: int = 1) -> int:
        """Scalar work of ``cycles`` cycles (an integer >= 0: address arithmetic, loop control);
        ``yield ctx.scalar(n)``."""
        if isinstance(cycles, bool) or not isinstance(cycles, (int, np.integer)) or cycles < 0:
            raise ArgumentError(f"scalar(cycles={cycles!r}): a cycle count is an integer >= 0")
        return int(cycles)

    def gm_at(self, die: int, addr: int, shape, dtype) -> GMTensor:
        """A GM view at a raw byte address on any die (far-memory protocols compute addresses)."""
        return self._engine.gm.at(die, addr, shape, dtype)


class Vector:
    """The vector unit of an AIV (``ctx.vec``). Operands are UB tiles; sources broadcast to the destination
    shape (numpy rules). Arithmetic runs on fp16, fp32, int16, int32; bf16 data must be cast to fp32 first, as on
    the die. Float results are rounded to the destination dtype (RNE); integer arithmetic is exact and wraps on
    overflow, and integer ``div``/``divs`` truncate toward zero (7 / 2 = 3, -7 / 2 = -3; a zero divisor raises
    ``NumericError``)."""

    def __init__(self, ctx: KernelContext):
        self._ctx = ctx

    def _op(self, spec, dst, srcs, p=None, arith=True):
        """The instruction ``spec`` (an OpSpec: the module's constants, no lookup by name) after its operand
        checks."""
        ctx = self._ctx
        if not ctx.is_aiv:
            raise AddressError(f"vec.{spec.name} on {ctx._owner}: the vector unit belongs to AIV cores")
        ctx._local(dst, ("UB",), "dst")
        d = dst                   # a View once checked (kernel.pxd): its fields without attribute lookups
        for i in range(len(srcs)):
            s = srcs[i]
            if s is not dst:      # an operand that is the destination (in place) passed the same check just now
                ctx._local(s, ("UB",), _SRC_NAMES[i] if i < 4 else f"src{i}")
            v = s
            if arith and v.dtype is not d.dtype and v.dtype != d.dtype:
                raise DTypeError(f"vec.{spec.name}: src{i} dtype {name_of(v.dtype)} != dst dtype {name_of(d.dtype)}")
            if arith and not _broadcastable(v.shape, d.shape):
                raise ShapeError(f"vec.{spec.name}: src{i} shape {v.shape} does not broadcast to dst shape {d.shape}")
        if arith and d.dtype is not fp32 and d.dtype not in _VEC_ARITH:   # fp32 by identity: no dtype hash
            raise DTypeError(f"vec.{spec.name}: the vector unit has no {name_of(dst.dtype)} arithmetic "
                             f"(fp16, fp32, int16, int32); cast to fp32 first")
        return new_instr(spec, (dst,), tuple(srcs), p)

    def add(self, dst, a, b): return self._op(_V_ADD, dst, (a, b))
    def sub(self, dst, a, b): return self._op(_V_SUB, dst, (a, b))
    def mul(self, dst, a, b): return self._op(_V_MUL, dst, (a, b))
    def div(self, dst, a, b): return self._op(_V_DIV, dst, (a, b))
    def max(self, dst, a, b): return self._op(_V_MAX, dst, (a, b))
    def min(self, dst, a, b): return self._op(_V_MIN, dst, (a, b))
    def adds(self, dst, a, scalar): return self._scalar_op(_V_ADDS, dst, a, scalar)
    def muls(self, dst, a, scalar): return self._scalar_op(_V_MULS, dst, a, scalar)
    def maxs(self, dst, a, scalar): return self._scalar_op(_V_MAXS, dst, a, scalar)
    def mins(self, dst, a, scalar): return self._scalar_op(_V_MINS, dst, a, scalar)

    def divs(self, dst, a, scalar):
        """dst = a / scalar; integers truncate toward zero (isa.divide), and an integer scalar 0 raises here."""
        ins = self._scalar_op(_V_DIVS, dst, a, scalar)
        if dst.dtype.kind in "iu" and scalar == 0:
            raise NumericError(f"vec.divs: integer division by zero (scalar {scalar!r}) into {dst.describe()}")
        return ins

    def _scalar_op(self, spec, dst, a, scalar):
        ins = self._op(spec, dst, (a,), {"scalar": scalar})
        d = dst                   # checked by _op: a View
        dt = d.dtype              # fp32 by identity first: its kind is an attribute read of a numpy dtype
        if (type(scalar) is not float and type(scalar) is not int) or (dt is not fp32 and dt.kind in "iu"):
            _check_scalar(scalar, dst, f"vec.{spec.name}", "scalar")     # a float tile's float or int passes as it is
        return ins
    def exp(self, dst, a): return self._op(_V_EXP, dst, (a,))
    def ln(self, dst, a): return self._op(_V_LN, dst, (a,))
    def sqrt(self, dst, a): return self._op(_V_SQRT, dst, (a,))
    def rsqrt(self, dst, a): return self._op(_V_RSQRT, dst, (a,))
    def abs(self, dst, a): return self._op(_V_ABS, dst, (a,))
    def relu(self, dst, a): return self._op(_V_RELU, dst, (a,))
    def neg(self, dst, a): return self._op(_V_NEG, dst, (a,))
    def reciprocal(self, dst, a): return self._op(_V_RECIPROCAL, dst, (a,))
    def copy(self, dst, a): return self._op(_V_VCOPY, dst, (a,))

    def duplicate(self, dst, value):
        """dst[...] = value (a number: rounded to a float dst's dtype; an integer dst's must fit it)."""
        ins = self._op(OPS["duplicate"], dst, (), {"value": value}, arith=False)
        _check_scalar(value, dst, "vec.duplicate", "value")
        return ins

    def broadcast(self, dst, src):
        """dst = src broadcast to dst's shape (e.g. a [R, 1] column over [R, H])."""
        if src.dtype != dst.dtype or not _broadcastable(src.shape, dst.shape):
            raise ShapeError(f"vec.broadcast: {src.shape} {name_of(src.dtype)} -> {dst.shape} {name_of(dst.dtype)}")
        return self._op(OPS["broadcast"], dst, (src,), arith=False)

    def _reduce(self, name, dst, src):
        if src.dtype != dst.dtype:
            raise DTypeError(f"vec.{name}: dst dtype {name_of(dst.dtype)} != src dtype {name_of(src.dtype)}")
        rows = math.prod(src.shape[:-1])
        if dst.numel != rows:
            raise ShapeError(f"vec.{name}: reduces the last axis of {src.shape}; dst {dst.shape} must hold "
                             f"{rows} elements")
        if dst.dtype not in _VEC_ARITH:
            raise DTypeError(f"vec.{name}: the vector unit has no {name_of(dst.dtype)} arithmetic "
                             f"(fp16, fp32, int16, int32); cast to fp32 first")
        return self._op(OPS[name], dst, (src,), arith=False)

    def reduce_sum(self, dst, src): return self._reduce("reduce_sum", dst, src)
    def reduce_max(self, dst, src): return self._reduce("reduce_max", dst, src)
    def reduce_min(self, dst, src): return self._reduce("reduce_min", dst, src)

    def cast(self, dst, src, round_mode: str = "rint"):
        """dst = src converted to dst's dtype with ``round_mode`` (rint, floor, ceil, round, trunc, odd)."""
        from .numerics import ROUND_MODES
        if round_mode not in ROUND_MODES:
            raise ArgumentError(f"round_mode={round_mode!r}: use one of {ROUND_MODES}")
        if dst.shape != src.shape:
            raise ShapeError(f"vec.cast: dst shape {dst.shape} != src shape {src.shape}")
        return self._op(OPS["cast"], dst, (src,), {"round_mode": round_mode}, arith=False)

    def compare(self, dst, a, b, cmp: str):
        """dst (uint8 mask, 1 where true) = a <cmp> b; ``b`` a tile or a scalar."""
        if cmp not in COMPARE:
            raise ArgumentError(f"cmp={cmp!r}: use one of {sorted(COMPARE)}")
        if dst.dtype != uint8:
            raise DTypeError(f"vec.compare: dst must be a uint8 mask, got {name_of(dst.dtype)}")
        if isinstance(b, View):
            return self._op(OPS["compare"], dst, (a, b), {"cmp": cmp}, arith=False)
        ins = self._op(OPS["compare"], dst, (a,), {"cmp": cmp, "scalar": b}, arith=False)
        _check_scalar(b, a, "vec.compare", "b")
        return ins

    def select(self, dst, mask, a, b):
        """dst = where(mask, a, b)."""
        if mask.dtype != uint8:
            raise DTypeError(f"vec.select: mask must be uint8, got {name_of(mask.dtype)}")
        if a.dtype != dst.dtype or b.dtype != dst.dtype:
            raise DTypeError("vec.select: a, b and dst must share a dtype")
        return self._op(OPS["select"], dst, (mask, a, b), arith=False)

    def quant_int8(self, y, scale, x, smooth=None):
        """Per-row dynamic INT8: scale[r] = max|x[r] (* smooth)| / 127 (fp32), y = rint(x / scale) saturated.
        x [R, H] fp32/fp16/bf16, y [R, H] int8, scale [R] fp32, smooth [H] fp32."""
        ctx = self._ctx
        for name, v in (("y", y), ("scale", scale), ("x", x)):
            ctx._local(v, ("UB",), name)
        if y.dtype != int8 or scale.dtype != fp32 or x.dtype not in (fp32, fp16, bf16):
            raise DTypeError(f"vec.quant_int8: y int8, scale fp32, x fp32/fp16/bf16 expected, got y "
                             f"{name_of(y.dtype)}, scale {name_of(scale.dtype)}, x {name_of(x.dtype)}")
        rows = x.numel // x.shape[-1]
        if y.shape != x.shape or scale.numel != rows:
            raise ShapeError(f"vec.quant_int8: y {y.shape} must equal x {x.shape}; scale {scale.shape} must hold "
                             f"{rows} rows")
        srcs = (x,)
        if smooth is not None:
            ctx._local(smooth, ("UB",), "smooth")
            if smooth.dtype != fp32 or smooth.numel != x.shape[-1]:
                raise ShapeError(f"vec.quant_int8: smooth must be fp32 [{x.shape[-1]}], got {smooth.describe()}")
            srcs = (x, smooth)
        if not ctx.is_aiv:
            raise AddressError("vec.quant_int8 runs on AIV cores")
        return new_instr(OPS["quant_int8"], (y, scale), srcs)

    def dequant_int8(self, dst, q, row_scale, col_scale=None):
        """dst = q * row_scale[:, None] (* col_scale[None, :]) in fp32, rounded to dst's dtype."""
        ctx = self._ctx
        if q.dtype not in (int8, int32) or row_scale.dtype != fp32:
            raise DTypeError(f"vec.dequant_int8: q int8/int32 and fp32 scales expected, got q {name_of(q.dtype)}, "
                             f"row_scale {name_of(row_scale.dtype)}")
        if dst.shape != q.shape:
            raise ShapeError(f"vec.dequant_int8: dst shape {dst.shape} != q shape {q.shape}")
        srcs = (q, row_scale) if col_scale is None else (q, row_scale, col_scale)
        for i, v in enumerate(srcs):
            ctx._local(v, ("UB",), f"src{i}")
        ctx._local(dst, ("UB",), "dst")
        return new_instr(OPS["dequant_int8"], (dst,), srcs)


def _die(v) -> int:
    """The die holding GM tensor ``v`` (checked by ``_gm``): a field read in the build (kernel.pxd), where the
    copies' untyped operands would look ``store`` up as an attribute."""
    return v.store.die


def _burst_error(what: str, v, blk: tuple, burst: int):
    raise AlignmentError(f"{what}: {v.describe()} moves {blk[0]} block(s) of {blk[1]} bytes; DataCopy moves whole "
                         f"{burst}-byte blocks, {blk[1]} is not a multiple of {burst} (pass pad=True for DataCopyPad)")


def _row_range(rows) -> tuple:
    """(min, max) of a 1-D int64 row array: Python's over a tile's few rows (two numpy reductions cost more)."""
    if len(rows) <= 256:
        values = rows.tolist()
        return min(values), max(values)
    return int(rows.min()), int(rows.max())


def _same(dst, src, what: str, check_dtype: bool = True) -> None:
    """A copy's operands (views): the same dtype (unless ``check_dtype`` is False) and shape, or the same number of
    elements when both are contiguous."""
    if check_dtype and dst.dtype is not src.dtype and dst.dtype != src.dtype:
        raise DTypeError(f"{what}: dst dtype {name_of(dst.dtype)} != src dtype {name_of(src.dtype)} "
                         f"(copies do not convert; use vec.cast)")
    if dst.shape != src.shape and (dst.numel != src.numel or not (dst.is_contiguous and src.is_contiguous)):
        raise ShapeError(f"{what}: dst shape {dst.shape} does not match src shape {src.shape}")


def _broadcastable(src, dst) -> bool:
    if src == dst:              # the common case: same-shape tiles (a tuple compare, no zip of reversed iterators)
        return True
    if len(src) > len(dst):
        return False
    for s, d in zip(reversed(src), reversed(dst)):
        if s != d and s != 1:
            return False
    return True


def _check_atomic(v, what):
    if v.dtype not in (int32, np.dtype(np.int64), fp32, np.dtype(np.uint32)):
        raise DTypeError(f"{what}: GM atomics work on int32, int64, uint32, fp32 words, got {name_of(v.dtype)}")


def _check_index(tile, index, what: str) -> None:
    """An index of ``tile`` (an int, a slice or a tuple of them) that numpy would accept, never past its end."""
    shape = tile.shape
    cls = index.__class__
    if cls is int:                      # the common indices (an element, a page of a table) pass without numpy
        if shape and -shape[0] <= index < shape[0]:
            return
    elif cls is tuple and len(index) <= len(shape):
        for i in range(len(index)):
            part = index[i]
            if part.__class__ is not int or not -shape[i] <= part < shape[i]:
                break
        else:
            return
    for part in index if isinstance(index, tuple) else (index,):
        if not (is_int(part) or isinstance(part, (slice, list, np.ndarray)) or part is Ellipsis):
            raise ArgumentError(f"{what}: index {index!r} is not an index of {tile.describe()} (integers and slices)")
    try:
        np.broadcast_to(np.empty((), np.bool_), tile.shape)[index]     # a view of no memory: checks only
    except IndexError as e:
        raise AddressError(f"{what}: index {index!r} out of range for {tile.describe()} ({e})") from None
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{what}: index {index!r} is not an index of {tile.describe()} ({e})") from None


def _check_number(value, what: str, arg: str, like=None) -> np.ndarray:
    """``value`` as a numeric array (a scalar, or one broadcasting to ``like``'s shape)."""
    a = np.asarray(value)
    if a.dtype == object:           # Python ints beyond 64 bits
        try:
            a = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            pass
    if a.dtype.kind not in "biuf" and a.dtype != bf16:
        raise DTypeError(f"{what}: {arg}={value!r} is not a number")
    if like is not None and not _broadcastable(a.shape, like.shape) or like is None and a.ndim:
        raise ShapeError(f"{what}: {arg} of shape {a.shape} does not broadcast to "
                         f"{like.describe() if like is not None else 'a scalar'}")
    return a


def _control_value(dst, value, what: str, arg: str) -> np.ndarray:
    """A value a scalar store or atomic writes to GM ``dst``, which must be real (control data)."""
    if dst.store.data is None:
        raise AddressError(f"{what} on phantom {dst.describe()}: flags, counters and other control data must be "
                           f"real (allocate them with phantom=False)")
    return _fit_value(dst, value, what, arg)


def _check_scalar(value, tile, what: str, arg: str) -> None:
    """A scalar operand of a vector op on ``tile``: a number; for an integer tile, an integer that fits its dtype
    (the scalar register has the tile's type)."""
    if tile.dtype.kind in "iu":
        _fit_value(tile, value, what, arg)
        if np.ndim(value):
            raise ShapeError(f"{what}: {arg} must be a scalar, got shape {np.shape(value)}")
    elif type(value) is not float and type(value) is not int:     # the common case skips numpy
        if _check_number(value, what, arg).ndim:
            raise ShapeError(f"{what}: {arg} must be a scalar, got shape {np.shape(value)}")


def _fit_value(dst, value, what: str, arg: str):
    """A value the scalar unit writes to ``dst``, broadcasting to its shape: integers must fit its dtype exactly (a
    flag or a counter that silently wrapped would be a protocol bug); floats are rounded when they land."""
    dt = dst.dtype
    cls = value.__class__
    if cls is int and dt.kind in "iu":          # the common cases skip numpy (set_value runs per token)
        lo, hi = _INT_RANGE[dt]
        if lo <= value <= hi:
            return value
    elif (cls is float or cls is int) and dt.kind not in "iu":
        return value
    elif cls is np.ndarray and value.dtype == dt and _broadcastable(value.shape, dst.shape):
        return value.copy()                     # already the store's dtype (a status record): it fits; sampled now
    a = _check_number(value, what, arg, dst)
    if dt.kind not in "iu":
        return a
    if a.size:
        wide = a.astype(np.float64) if a.dtype.kind == "f" or a.dtype == bf16 else a
        info = np.iinfo(dt)
        bad = ~np.isfinite(wide) if wide.dtype.kind == "f" else np.zeros(wide.shape, bool)
        if wide.dtype.kind == "f":
            bad |= wide != np.trunc(wide)
        with np.errstate(invalid="ignore"):
            bad |= (wide < info.min) | (wide > info.max)
        if bad.any():
            first = wide.reshape(-1)[int(np.argmax(bad.reshape(-1)))]
            raise ArgumentError(f"{what}: {arg} {first} does not fit {dst.describe()} ({name_of(dt)}: integers "
                                f"{info.min}..{info.max})")
    return a.astype(dt)


_INT_RANGE = {np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
              for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)}


def _check_flag(flag):
    if not (isinstance(flag, (int, np.integer)) and 0 <= flag <= 15):
        raise ArgumentError(f"cross-core flag id {flag!r} out of range 0..15")


def _what(v) -> str:
    return v.describe() if isinstance(v, View) else type(v).__name__


_PIPES = ("MTE1", "MTE2", "MTE3", "CUBE", "VECTOR", "FIXP", "SCALAR", "DMA")


def _after(after, op: str):
    """Check a flag's ``after=``: None, "all", a pipe name or a tuple of pipe names (returned as given)."""
    if after is None or after == "all":
        return after
    pipes = (after,) if isinstance(after, str) else tuple(after) if isinstance(after, (tuple, list)) else (after,)
    bad = [p for p in pipes if p not in _PIPES]
    if bad or not pipes:
        raise ArgumentError(f"{op}: after={after!r}; use None, 'all', a pipe name or a tuple of them "
                            f"({', '.join(_PIPES)})")
    return after if isinstance(after, str) else pipes
