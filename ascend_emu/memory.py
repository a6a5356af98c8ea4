"""Global memory: one HBM arena per die, all of them one pod address space ``(die, byte offset)``.

Any core of any die may read or write any die's GM (the Unified-Bus fabric makes the pod one address space); what a
remote access costs is the timing model's business, not this module's. Allocations are 512-byte aligned segments of
a die's arena, zero-filled like ``aclrtMemset`` would leave them (flags and counters start at 0). A phantom allocation
reserves address space and has shape and dtype but no bytes: copies to and from it are timed and move nothing.
"""
from __future__ import annotations

import bisect

import numpy as np

from .dtypes import as_dtype, name_of
from .errors import AddressError, CapacityError
from .views import Store, View, contiguous_strides

GM_ALIGN = 512


class GMTensor(View):
    """A strided view of global memory on one die. Slicing gives views; ``numpy()`` copies the data out."""

    __slots__ = ()

    @property
    def die(self) -> int:
        return self.store.die

    def write(self, values) -> None:
        """Host-side write (outside simulated time, e.g. before a launch)."""
        a = self.arr
        if a is None:
            raise AddressError(f"{self.describe()} is a phantom tensor: it cannot hold host data")
        v = np.asarray(values)
        if v.dtype != self.dtype:
            v = _host_cast(v, self.dtype)
        a[...] = v


def _host_cast(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if v.dtype.kind == "f" and dtype.kind == "f" or name_of(dtype) == "bf16":
        from .numerics import cast  # bit-exact rounding, same as the die's own casts
        return cast(np.ascontiguousarray(v, dtype=np.float32), dtype)
    return v.astype(dtype)


class GMArena:
    """The GM of one die: a bump allocator over ``capacity`` bytes of address space."""

    def __init__(self, die: int, capacity: int):
        self.die = die
        self.capacity = capacity
        self.top = 0
        self._bases: list[int] = []
        self._stores: list[Store] = []

    def alloc(self, shape, dtype, *, phantom: bool = False, name: str | None = None, uid: int = 0) -> GMTensor:
        dt = as_dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise AddressError(f"shape {shape} has a negative dimension")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        padded = -(-max(nbytes, 1) // GM_ALIGN) * GM_ALIGN
        if self.top + padded > self.capacity:
            raise CapacityError(f"GM of die {self.die}: allocating {nbytes} bytes for {name or 'tensor'} needs "
                                f"{self.top + padded} bytes, capacity is {self.capacity} bytes")
        store = Store(name or f"gm{len(self._stores)}", nbytes, phantom, "GM", self.die, self.top, uid=uid)
        self._bases.append(self.top)
        self._stores.append(store)
        self.top += padded
        return GMTensor(store, 0, shape, contiguous_strides(shape, dt.itemsize), dt)

    def at(self, addr: int, shape, dtype) -> GMTensor:
        """A view at a raw byte address; it must lie inside one allocation."""
        dt = as_dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
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

    def arena(self, die: int) -> GMArena:
        a = self._arenas.get(die)
        if a is None:
            if not (isinstance(die, (int, np.integer)) and 0 <= die < self.num_dies):
                raise AddressError(f"die {die} out of range: this pod has dies 0..{self.num_dies - 1}")
            a = self._arenas[die] = GMArena(int(die), self.die_capacity)
        return a

    def alloc(self, die: int, shape, dtype, *, phantom: bool = False, name: str | None = None) -> GMTensor:
        uid = self._next_uid
        self._next_uid += 1
        return self.arena(die).alloc(shape, dtype, phantom=phantom, name=name, uid=uid)

    def from_array(self, die: int, array, *, name: str | None = None, dtype=None) -> GMTensor:
        """Allocate on ``die`` and copy a host array (numpy or torch) in."""
        a = _to_numpy(array)
        dt = as_dtype(dtype) if dtype is not None else as_dtype(a.dtype)
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
