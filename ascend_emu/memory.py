"""Global memory: one HBM arena per die, all of them one pod address space ``(die, byte offset)``.

Any core of any die may read or write any die's GM (the Unified-Bus fabric makes the pod one address space); what a
remote access costs is the timing model's business, not this module's. Allocations are 512-byte aligned segments of
a die's arena, zero-filled like ``aclrtMemset`` would leave them (flags and counters start at 0). A phantom allocation
reserves address space and has shape and dtype but no bytes: copies to and from it are timed and move nothing.
"""
from __future__ import annotations

import bisect
import math
import mmap

import numpy as np

from .arguments import check_die, check_int, check_shape, is_int
from .dtypes import as_dtype, bf16, fp64
from .errors import AddressError, ArgumentError, CapacityError, DTypeError, ShapeError
from .views import Store, View, contiguous_strides

GM_ALIGN = 512
SPARSE_MIN_BYTES = 1 << 20      # GM allocations from this size on get bytes only where they are touched (zeroed_bytes)


def zeroed_bytes(nbytes: int, dense: bool = False) -> np.ndarray:
    """``nbytes`` zero bytes (uint8) for a GM allocation.

    From ``SPARSE_MIN_BYTES`` on, an anonymous private mapping without transparent huge pages: the OS zeroes each
    4 KiB page when it is first touched, so an allocation written sparsely (a communication window sized for the worst
    case, a few rows written per slot) costs what is touched. numpy asks for huge pages on its large allocations;
    touching one byte of one then makes the kernel zero 2 MiB (a fused dispatch's windows spent most of its run there).
    ``dense``: the allocation will be written through (a ring filled slot by slot): numpy's zeroed array, whose
    pages come in large steps (first touches of 4 KiB pages cost several times copying their bytes).
    """
    if dense or nbytes < SPARSE_MIN_BYTES or not hasattr(mmap, "MAP_PRIVATE"):   # small, dense, or no POSIX mmap
        return np.zeros(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):        # Linux: huge pages even where the system turns them on for all
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)


class GMTensor(View):
    """A strided view of global memory on one die. Slicing gives views; ``numpy()`` copies the data out."""

    __slots__ = ()

    @property
    def die(self) -> int:
        return self.store.die

    def write(self, values) -> None:
        """Host-side write (outside simulated time, e.g. before a launch)."""
        self.arr[...] = self.host_values(values)
        self._host_wrote()

    def _host_wrote(self) -> None:
        shadow = self.store.shadow
        if shadow is not None:          # a sanitized pod: the host initialised these bytes
            shadow.owner.host_wrote(self)

    def host_values(self, values) -> np.ndarray:
        """``values`` checked and converted for a host write into this tensor (numeric, broadcasting to its shape,
        converted like the die converts: ``host_cast``)."""
        if self.arr is None:
            raise AddressError(f"{self.describe()} is a phantom tensor: it cannot hold host data")
        v = _numeric(values, "values")
        if not _broadcasts(v.shape, self.shape):
            raise ShapeError(f"host write of shape {v.shape} into {self.describe()}: the shapes do not match")
        return v if v.dtype == self.dtype else host_cast(v, self.dtype)


def _numeric(values, arg: str) -> np.ndarray:
    v = np.asarray(values)
    if v.dtype.kind not in "biuf" and v.dtype != bf16:
        raise DTypeError(f"{arg}: host data of dtype {v.dtype} is not numeric (bool, integer or float arrays)")
    return v


def _broadcasts(src: tuple, dst: tuple) -> bool:
    return len(src) <= len(dst) and all(s in (1, d) for s, d in zip(reversed(src), reversed(dst)))


def host_cast(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Host data converted the way the die's own cast converts (``numerics.cast``, rint): floats round to nearest
    even, and every conversion to an integer saturates (300.7 -> int8 127, not 44; NaN -> 0). float64 reaches a
    narrow float through float32, as torch's ``.to`` does."""
    from .numerics import cast
    if dtype.kind == "f" or dtype == bf16:
        if v.dtype.kind == "f" or v.dtype == bf16:
            if dtype == fp64:
                return v.astype(dtype)
            return cast(np.ascontiguousarray(v, dtype=np.float32), dtype)
        wide = v.astype(np.float64)
        return wide.astype(dtype) if dtype == fp64 else cast(wide, dtype)
    info = np.iinfo(dtype)
    if v.dtype.kind == "f" or v.dtype == bf16:
        with np.errstate(invalid="ignore"):
            r = np.rint(v.astype(np.float64))
            r = np.where(np.isnan(r), 0.0, r)
            # float64 cannot hold int64's top; clip there, then set the ends exactly
            out = np.clip(r, -2.0 ** 63, 2.0 ** 63 - 1024).astype(np.int64)
        out = np.where(r >= 2.0 ** 63 - 1024, np.int64(2 ** 63 - 1), out) if info.max > 2 ** 62 else out
        v = out
    if v.dtype.kind == "b":
        return v.astype(dtype)
    src = np.iinfo(v.dtype)
    return np.clip(v, max(info.min, src.min), min(info.max, src.max)).astype(dtype)


class GMArena:
    """The GM of one die: a bump allocator over ``capacity`` bytes of address space."""

    def __init__(self, die: int, capacity: int):
        self.die = die
        self.capacity = capacity
        self.top = 0
        self._bases: list[int] = []
        self._stores: list[Store] = []

    def alloc(self, shape, dtype, *, phantom: bool = False, name: str | None = None, uid: int = 0,
              data: np.ndarray | None = None, dense: bool = False) -> GMTensor:
        """``dense``: host memory for every byte at once (``zeroed_bytes``), for allocations written through."""
        dt = as_dtype(dtype)
        shape = check_shape(shape)
        nbytes = math.prod(shape) * dt.itemsize          # exact: np.prod would wrap past 2**63
        padded = -(-max(nbytes, 1) // GM_ALIGN) * GM_ALIGN
        if self.top + padded > self.capacity:
            raise CapacityError(f"GM of die {self.die}: allocating {nbytes} bytes for {name or 'tensor'} needs "
                                f"{self.top + padded} bytes, capacity is {self.capacity} bytes")
        if data is None and not phantom:
            data = zeroed_bytes(nbytes, dense)
        store = Store(name or f"gm{len(self._stores)}", nbytes, phantom, "GM", self.die, self.top, uid=uid, data=data)
        self._bases.append(self.top)
        self._stores.append(store)
        self.top += padded
        return GMTensor(store, 0, shape, contiguous_strides(shape, dt.itemsize), dt)

    def at(self, addr: int, shape, dtype) -> GMTensor:
        """A view at a raw byte address; it must lie inside one allocation."""
        dt = as_dtype(dtype)
        shape = check_shape(shape)
        addr = check_int(addr, "addr", 0)
        nbytes = math.prod(shape) * dt.itemsize          # exact: np.prod would wrap past 2**63
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0 or addr + nbytes > self._bases[i] + self._stores[i].nbytes:
            raise AddressError(f"GM address 0x{addr:x}+{nbytes} bytes on die {self.die} is outside every "
                               f"allocation (arena top 0x{self.top:x}, capacity {self.capacity} bytes)")
        store = self._stores[i]
        return GMTensor(store, addr - store.base, shape, contiguous_strides(shape, dt.itemsize), dt)

    @property
    def used(self) -> int:
        return self.top


class GlobalMemory:
    """The pod address space: GM arenas created on first use, one per die."""

    def __init__(self, num_dies: int, die_capacity: int):
        self.num_dies = num_dies
        self.die_capacity = die_capacity
        self._arenas: dict[int, GMArena] = {}
        self._next_uid = 1
        self.on_alloc = None        # callback(tensor) for each allocation (the race sanitizer shadows it)

    def arena(self, die: int) -> GMArena:
        a = self._arenas.get(die) if is_int(die) else None
        if a is None:
            die = check_die(die, self.num_dies)
            a = self._arenas[die] = GMArena(die, self.die_capacity)
        return a

    def alloc(self, die: int, shape, dtype, *, phantom: bool = False, name: str | None = None,
              data: np.ndarray | None = None, dense: bool = False) -> GMTensor:
        uid = self._next_uid
        self._next_uid += 1
        t = self.arena(die).alloc(shape, dtype, phantom=phantom, name=name, uid=uid, data=data, dense=dense)
        if self.on_alloc is not None:
            self.on_alloc(t)
        return t

    def from_array(self, die: int, array, *, name: str | None = None, dtype=None, copy: bool = True) -> GMTensor:
        """Allocate on ``die`` and copy a host array (numpy or torch) in; ``copy=False``: the GM tensor's bytes are
        the array's own (no copy), which needs ``aliasable(array, dtype)``; ArgumentError says why not."""
        a = _numeric(_to_numpy(array), "array")
        dt = as_dtype(dtype) if dtype is not None else as_dtype(a.dtype, "array dtype")
        if not copy:
            why = _not_aliasable(a, dt)
            if why:
                raise ArgumentError(f"to_gm(copy=False): {why}; pass copy=True to copy it in")
            t = self.alloc(die, a.shape, dt, name=name, data=a.reshape(-1).view(np.uint8))
            t._host_wrote()                 # the array's bytes are the host's write
            return t
        t = self.alloc(die, a.shape, dt, name=name)
        t.write(a)
        return t

    def at(self, die: int, addr: int, shape, dtype) -> GMTensor:
        return self.arena(die).at(addr, shape, dtype)


def _to_numpy(array) -> np.ndarray:
    if type(array).__module__.startswith("torch"):
        import torch
        if array.dtype == torch.bfloat16:
            import ml_dtypes
            return array.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return array.detach().cpu().numpy()
    return np.asarray(array)


def aliasable(array, dtype=None) -> bool:
    """Whether ``from_array(array, dtype=dtype, copy=False)`` can use the host array's bytes as GM: a CPU array
    (numpy or torch) of that dtype, C-contiguous, writeable, not empty."""
    a = _to_numpy(array)
    try:
        dt = as_dtype(dtype) if dtype is not None else as_dtype(a.dtype, "array dtype")
    except DTypeError:
        return False
    return not _not_aliasable(a, dt)


def _not_aliasable(a: np.ndarray, dt: np.dtype) -> str:
    """Why GM cannot alias host array ``a`` as dtype ``dt`` ('' if it can)."""
    if a.dtype != dt:
        return f"the array's dtype {a.dtype} is not the GM dtype {dt} (a conversion makes new bytes)"
    if not a.flags.c_contiguous:
        return f"the array (shape {a.shape}, strides {a.strides}) is not C-contiguous"
    if not a.flags.writeable:
        return "the array is read-only (kernels may write GM)"
    if a.size == 0:
        return "the array is empty"
    return ""
