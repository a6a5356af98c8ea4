"""Strided views over a byte store: the common shape of GM tensors and core-local tiles.

A view is (store, byte offset, shape, byte strides, dtype). The store owns the bytes (a flat uint8 array) or owns none
(a phantom store: timing-only runs). Slicing never silently clamps: an index or slice past the end raises
``AddressError`` naming the tensor, the dimension and the limit, because a clamped copy on real hardware would read or
write a neighbour's memory instead.
"""
from __future__ import annotations

import math

import numpy as np

try:                # the install compiles this module (views.pxd declares the C calls View._int_kid makes)
    import cython
    _COMPILED = cython.compiled
except ImportError:  # pragma: no cover - Cython is a build requirement
    _COMPILED = False

from .dtypes import as_dtype, name_of
from .errors import AddressError, ShapeError


class Store:
    """Bytes of one allocation (GM segment or local buffer allocation); ``data`` is None for a phantom store."""

    __slots__ = ("name", "nbytes", "data", "space", "die", "base", "core", "uid", "regions", "lent", "loads",
                 "shadow", "deferred")

    def __init__(self, name: str, nbytes: int, phantom: bool, space: str, die: int, base: int, core=None, uid: int = 0,
                 data: np.ndarray | None = None):
        self.name = name
        self.nbytes = nbytes
        # ``data``: a uint8 buffer of ``nbytes`` to use as the store's bytes (shared, not copied: GM aliasing a host
        # array, memory.GlobalMemory.from_array(copy=False))
        self.data = None if phantom else np.zeros(nbytes, dtype=np.uint8) if data is None else data
        self.space = space        # "GM", "UB", "L1", "L0A", "L0B", "L0C", "BT", "FB"
        self.die = die
        self.base = base          # byte address of the store in its space (GM: offset in the die's arena)
        self.core = core          # owning core for local stores, None for GM
        self.uid = uid
        self.regions = None       # dependency-tracking records of the owning core (local stores only)
        self.lent = None          # transfers in flight that will copy from this store at their landing (a set)
        self.loads = None         # lazy loads into this store (a tile) not yet copied (a set; engine.py)
        self.shadow = None        # the race sanitizer's record of who wrote and read it (None: not sanitized)
        self.deferred = None      # L0C: int8 mmads not yet landed (cube_math.DeferredAccumulators), else None

    @property
    def phantom(self) -> bool:
        return self.data is None


MEMO_LOCAL = 4096      # child views memoised per core-local tile (views of GM: MEMO_GM) before the memo restarts
MEMO_GM = 64
MEMO_INTS = 64         # a dim 0 up to this long keeps its int-indexed children in a list (View._ints)
_MULTI = object()     # marks a memo key of a multi-dim index (never equal to a dim-0 key)
_RESHAPE = object()   # marks a memo key of a reshape
_VIEW_AS = object()   # marks a memo key of a view_as
_TYPED = object()     # marks a memo key of a typed tile
_INT64 = np.int64
_U8 = np.dtype(np.uint8)


class View:
    __slots__ = ("store", "offset", "shape", "strides", "dtype", "lo", "hi", "_arr", "_kids", "_ints", "_blk",
                 "_l2fp", "__weakref__")

    def __init__(self, store: Store, offset: int, shape: tuple, strides: tuple, dtype: np.dtype,
                 lo: int | None = None, hi: int | None = None):
        self.store = store
        self.offset = offset
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self._arr = None
        self._kids = None          # memo of views sliced off dim 0 (views are immutable, so sharing is safe)
        self._ints = None          # the int-indexed ones of a short dim 0, by index (a list: no hash probe)
        self._blk = None           # memo of ``_layout()``
        self._l2fp = None          # memo of the L2 lines it touches (cache.footprint), for GM views
        if lo is not None:
            self.lo = lo
            self.hi = hi
            return
        lo = hi = offset
        empty = False
        for n, s in zip(shape, strides):
            if n == 0:
                empty = True
                break
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        self.lo = lo
        self.hi = lo if empty else hi + dtype.itemsize

    # ------------------------------------------------------------------ properties
    @property
    def arr(self) -> np.ndarray | None:
        """The numpy view of the data, or None for a phantom tensor."""
        a = self._arr
        if a is None:
            data = self.store.data
            if data is None:
                return None
            if self.hi > self.lo and self.is_contiguous:
                # a C-contiguous run of bytes: a slice of the store, retyped, costs a fraction of the buffer
                # constructor below (a copy's operands are often views made for it and used once)
                a = data[self.lo:self.hi]
                if self.dtype is not _U8:
                    a = a.view(self.dtype)
                if len(self.shape) != 1:
                    a = a.reshape(self.shape)
            else:
                # an empty view holds no byte: its offset may lie past the store (the end of a stepped slice)
                a = np.ndarray(self.shape, dtype=self.dtype, buffer=data,
                               offset=self.offset if self.hi > self.lo else 0, strides=self.strides)
            self._arr = a
        return a

    @property
    def phantom(self) -> bool:
        return self.store.data is None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        shape = self.shape
        if len(shape) == 1:           # the common case (a byte run, a row) without the loop
            return shape[0] == 1 or self.strides[0] == self.dtype.itemsize
        expect = self.dtype.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def _layout(self) -> tuple:
        """(blocks, bytes per block, pattern), memoised on the view (views are immutable; copies and the scheduler
        ask for it on every instruction)."""
        blk = self._blk
        if blk is None:
            key = (self.shape, self.strides, self.dtype.itemsize)
            blk = _BLOCKS.get(key)
            if blk is None:
                blk = _BLOCKS[key] = _blocks(*key)
            self._blk = blk
        return blk

    def blocks(self) -> tuple[int, int]:
        """(number of contiguous blocks, bytes per block): how a copy engine bursts this view."""
        blk = self._layout()
        return blk[0], blk[1]

    @property
    def pattern(self) -> tuple[int, int] | None:
        """(step, block bytes) when the view is evenly spaced blocks (a column block of a matrix, NZ pages);
        None when it is one contiguous run or an irregular pattern (then only its extent [lo, hi) is known)."""
        return self._layout()[2]

    @property
    def addr(self) -> int:
        """Byte address of the first element in the view's space."""
        return self.store.base + self.offset

    def describe(self) -> str:
        return (f"{self.store.name}[{self.store.space}"
                f"{'' if self.store.die is None else f' die {self.store.die}'} @0x{self.addr:x}, "
                f"{tuple(self.shape)} {name_of(self.dtype)}]")

    def __repr__(self) -> str:
        kind = "phantom " if self.phantom else ""
        return f"<{kind}{type(self).__name__} {self.describe()}>"

    # ------------------------------------------------------------------ view arithmetic
    def _new(self, offset, shape, strides, dtype=None):
        return self.__class__(self.store, offset, tuple(shape), tuple(strides), dtype or self.dtype)

    def __getitem__(self, key):
        # hot cases (a slot of a multi-buffered tile, rows of a GM matrix): index or slice dim 0; the byte
        # extent follows from the parent's without a loop when dim 0's stride is non-negative
        kc = type(key)                # not key.__class__: an attribute lookup to Cython, type() is a field
        if kc is _INT64:              # a numpy index (a plan's row, slot): the int path below
            key = int(key)
            kc = int
        if kc is int and self._ints is not None:
            # a child seen before: the memo holds only children the checks below let through, on fields that never
            # change, so it answers before them
            hit = self._int_kid(key)
            if hit is not None:
                return hit
        if (kc is int or kc is slice) and self.shape and self.hi > self.lo and self.strides[0] >= 0:
            kids = self._kids
            memo = key if kc is int else (key.start, key.stop, key.step)
            if kids is not None:
                hit = kids.get(memo)
                if hit is not None:
                    return hit
            n = self.shape[0]
            s0 = self.strides[0]
            child = None
            if kc is int:
                if 0 <= key < n:
                    child = self.__class__(self.store, self.offset + key * s0, self.shape[1:], self.strides[1:],
                                           self.dtype, self.lo + key * s0, self.hi - (n - 1 - key) * s0)
            elif key.step is None:
                a = 0 if key.start is None else key.start
                b = n if key.stop is None else key.stop
                if 0 <= a < b <= n:
                    child = self.__class__(self.store, self.offset + a * s0, (b - a,) + self.shape[1:],
                                           self.strides, self.dtype, self.lo + a * s0, self.hi - (n - b) * s0)
            if child is not None:
                self._remember(memo, child)
                return child
        if kc is tuple:
            # multi-dim keys recur in tile loops (t[b, :n], y[r0:r1, c0:c1]): memoised like the dim-0 cases; a
            # slice is not hashable before Python 3.12, so the memo key spells it out
            parts = [_MULTI]
            for k in key:       # a loop, not a generator expression: this runs for every multi-dim index
                parts.append((k.start, k.stop, k.step) if type(k) is slice else k)
            memo = tuple(parts)
            kids = self._kids
            if kids is not None:        # a hit without the call (_memoised looks again on a miss)
                try:
                    hit = kids.get(memo)
                except TypeError:       # an unhashable index (an array)
                    hit = None
                if hit is not None:
                    return hit
            return self._memoised(memo, self._slice, key)
        return self._slice(key)

    def _memoised(self, memo, make, arg):
        """The child view ``make(arg)``, kept in this view's memo under ``memo`` (views are immutable)."""
        kids = self._kids
        if kids is not None:
            try:
                hit = kids.get(memo)
            except TypeError:          # an unhashable index (an array): no memo
                return make(arg)
            if hit is not None:
                return hit
        child = make(arg)
        self._remember(memo, child)
        return child

    def _int_kid(self, key):
        """The memoised child at int index ``key`` of a short dim 0, or None (compiled: a C index, no int hash)."""
        if _COMPILED:
            i = PyLong_AsSsize_t(key)
            if i == -1:             # -1 is never memoised; past any C integer, the checks answer it
                PyErr_Clear()
                return None
        else:
            i = key
        ints = self._ints
        return ints[i] if 0 <= i < len(ints) else None

    def _remember(self, memo, child) -> None:
        if type(memo) is int and self.shape[0] <= MEMO_INTS:
            # a dim-0 index of a short dim 0 (a tile's buffer slots, a tensor's rows per core): by index in a
            # list; its length bounds it
            ints = self._ints
            if ints is None:
                ints = self._ints = [None] * self.shape[0]
            ints[memo] = child
            return
        kids = self._kids
        if kids is None:
            kids = self._kids = {}
        elif len(kids) > (MEMO_LOCAL if self.store.core is not None else MEMO_GM):
            # a long sweep over a big tensor: keep the memo bounded. A tile loop re-slices a core's tiles all the
            # time; slices of GM (rows, window slots) are mostly taken once per pass, and a big memo would keep
            # every one alive, with its L2 footprint, for as long as the tensor lives
            kids.clear()
        try:
            kids[memo] = child
        except TypeError:          # an unhashable index (an array): no memo
            pass

    def _slice(self, key):
        """The child view at ``key``, by the general path."""
        try:
            return self._cut(key)
        except OverflowError:   # compiled: an index or bound past any C integer (the sources' checks refuse it)
            raise AddressError(f"index {key!r} out of range for {self.describe()}") from None

    def _cut(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        ellipsis = False
        for k in key:
            if k is Ellipsis:
                ellipsis = True
        if ellipsis:
            i = key.index(Ellipsis)
            fill = len(self.shape) - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > len(self.shape):
            raise AddressError(f"too many indices ({len(key)}) for {self.describe()}")
        offset = self.offset
        # the child's byte extent [lo, hi) is summed here, dim by dim, so its constructor need not loop again
        lo = hi = 0
        empty = False
        shape, strides = [], []
        dim = 0
        for k in key:
            n = self.shape[dim]
            s = self.strides[dim]
            if k.__class__ is slice:
                step = 1 if k.step is None else k.step
                if step <= 0:
                    raise AddressError(f"slice step {step} not supported (dim {dim} of {self.describe()})")
                start = 0 if k.start is None else (k.start + n if k.start < 0 else k.start)
                stop = n if k.stop is None else (k.stop + n if k.stop < 0 else k.stop)
                if not (0 <= start <= n and start <= stop <= n):
                    raise AddressError(f"slice {k.start}:{k.stop} out of range for dim {dim} of size {n} "
                                       f"of {self.describe()}")
                offset += start * s
                m = (stop - start + step - 1) // step
                if m < 0:
                    m = 0
                shape.append(m)
                strides.append(s * step)
                if empty:           # past an empty dim the constructor's sum stops: so does this one
                    pass
                elif m == 0:
                    empty = True
                elif s * step >= 0:
                    hi += (m - 1) * s * step
                else:
                    lo += (m - 1) * s * step
            else:
                i = int(k)
                if not -n <= i < n:
                    raise AddressError(f"index {i} out of range for dim {dim} of size {n} of {self.describe()}")
                offset += (i + n if i < 0 else i) * s
            dim += 1
        while dim < len(self.shape):
            n = self.shape[dim]
            s = self.strides[dim]
            shape.append(n)
            strides.append(s)
            if empty:
                pass
            elif n == 0:
                empty = True
            elif s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
            dim += 1
        lo += offset
        hi = lo if empty else offset + hi + self.dtype.itemsize
        return self.__class__(self.store, offset, tuple(shape), tuple(strides), self.dtype, lo, hi)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        # memoised like slices: a tile loop reshapes the same tile every pass, and the child keeps its own memo
        return self._memoised((_RESHAPE,) + tuple(shape), self._reshape, shape)

    def _reshape(self, shape):
        shape = list(shape)
        if -1 in shape:
            known = 1
            for d in shape:
                if d != -1:
                    known *= d
            shape[shape.index(-1)] = self.numel // max(known, 1)
        n = 1
        for d in shape:
            n *= d
        if n != self.numel:
            raise ShapeError(f"cannot reshape {self.describe()} ({self.numel} elements) to {tuple(shape)}")
        if not self.is_contiguous:
            raise ShapeError(f"reshape needs a contiguous view; {self.describe()} is strided")
        strides, acc = [], self.dtype.itemsize
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return self._new(self.offset, shape, reversed(strides))

    def view_as(self, dtype):
        """Reinterpret the bytes of a contiguous view as another dtype (last dim rescaled)."""
        dt = as_dtype(dtype)
        # memoised like slices: a tile loop re-types the same byte region every pass (kernels.tiles.typed)
        return self._memoised((_VIEW_AS, dt), self._view_as, dt)

    def _view_as(self, dt):
        if not self.is_contiguous or (self.shape[-1] * self.dtype.itemsize) % dt.itemsize:
            raise ShapeError(f"cannot view {self.describe()} as {name_of(dt)}")
        shape = list(self.shape)
        shape[-1] = shape[-1] * self.dtype.itemsize // dt.itemsize
        return self._new(self.offset, shape, contiguous_strides(shape, dt.itemsize), dt)

    def typed(self, shape: tuple, dtype):
        """The contiguous tile of ``shape`` x ``dtype`` at the start of this contiguous view's bytes (a byte region
        reused for tiles of several shapes, kernels.tiles.typed): ``view_as(dtype)[:n].reshape(shape)``, memoised
        as one entry (a tile loop re-types the same region for every instruction)."""
        if type(shape) is not tuple:
            shape = tuple(shape)
        return self._memoised((_TYPED, shape, dtype), self._typed, (shape, dtype))

    def _typed(self, arg):
        shape, dtype = arg
        return self.view_as(dtype)[:math.prod(shape)].reshape(shape)

    def flatten(self):
        return self.reshape(self.numel)

    # ------------------------------------------------------------------ host access
    def numpy(self) -> np.ndarray:
        """A copy of the data (host-side read, outside simulated time)."""
        a = self.arr
        if a is None:
            raise AddressError(f"{self.describe()} is a phantom tensor: it has shape and dtype but no data")
        return np.array(a, copy=True)


_BLOCKS: dict = {}


def _blocks(shape, strides, itemsize) -> tuple:
    """(blocks, bytes per block, pattern): trailing dims that are contiguous merge into one block; the pattern is
    (step, block) when the remaining dims place the blocks at one even step, else None."""
    if not shape:
        return 1, itemsize, None
    block = itemsize
    count = 1
    for n in shape:
        count *= n
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    while dims and dims[-1][1] == block:
        n, _ = dims.pop()
        block *= n
        count //= n
    count = max(count, 1)
    pattern = None
    if dims:
        # outer dims that nest evenly (stride_i = n_{i+1} * stride_{i+1}) act as one run of blocks at one step
        step = dims[-1][1]
        regular = step > block
        for (n_o, s_o), (n_i, s_i) in zip(dims[:-1], dims[1:]):
            if s_o != n_i * s_i:
                regular = False
        pattern = (step, block) if regular else None
    return count, block, pattern


def contiguous_strides(shape, itemsize: int) -> tuple:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))
