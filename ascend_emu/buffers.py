"""Core-local buffers with real capacities and alignment: UB on an AIV; L1, L0A, L0B, L0C, BT, FB on an AIC.

Allocation is a bump allocator, the way Ascend C's ``TPipe::InitBuffer`` carves a buffer once per kernel. Capacity and
alignment are checked here, when a tile is allocated, never in the hot path. Fresh storage is filled with NaN (floats)
or the byte pattern 0x5A (integers) so that reading uninitialised data shows up in results.
"""
from __future__ import annotations

import math

import numpy as np

from .arguments import check_shape
from .cube_math import settle_store
from .dtypes import as_dtype, name_of, poison_fill
from .errors import ArgumentError, CapacityError
from .tracker import Regions
from .views import Store, View, contiguous_strides


class LocalTensor(View):
    """A tile in a core-local buffer. Slice it to address slots (``t[k]`` for double buffering)."""

    __slots__ = ()


class LocalBuffer:
    """One core-local buffer: ``space`` ("UB", "L1", ...), ``capacity`` bytes, ``align`` bytes."""

    def __init__(self, space: str, capacity: int, align: int, owner: str, die: int, phantom_default: bool = False):
        self.space = space
        self.capacity = capacity
        self.align = align
        self.owner = owner            # e.g. "die 0 aiv 3"
        self.die = die
        self.phantom_default = phantom_default
        self.top = 0
        self.num_allocs = 0
        self.stores: list = []        # every tile's store, for ``retire``

    def retire(self) -> None:
        """The owning core has finished: drop its tiles' dependency records. A store and its records refer to each
        other (a record holds an instruction, which holds its operand views); unlinked, a finished core's tiles and
        instructions are freed as soon as nothing else holds them, not by a garbage-collection pass."""
        for st in self.stores:
            st.regions = None
            if st.deferred is not None:
                settle_store(st)      # land pending int8 K steps: the tile holds its final values
        self.stores = []

    @property
    def used(self) -> int:
        return self.top

    @property
    def free(self) -> int:
        return self.capacity - self.top

    def mark(self) -> int:
        """The allocation pointer (bytes), for ``release``."""
        return self.top

    def release(self, mark: int) -> None:
        """Free every tile allocated after ``mark`` (TPipe::Reset for a persistent kernel's next round). The
        caller makes sure no queued instruction still uses them (``ctx.pipe_barrier()`` first)."""
        if not 0 <= mark <= self.top:
            raise ArgumentError(f"{self.space} of {self.owner}: release to {mark} bytes, but only {self.top} are "
                                f"allocated")
        self.top = mark

    def alloc(self, shape, dtype, *, phantom: bool | None = None, name: str | None = None) -> LocalTensor:
        """Allocate a tile of ``shape`` x ``dtype``; ``phantom`` None follows the launch (timing-only -> phantom).

        Control data (flags, counts, indices) must stay real in timing-only runs: pass ``phantom=False``.
        """
        dt = as_dtype(dtype)
        shape = check_shape(shape)
        nbytes = math.prod(shape) * dt.itemsize          # exact: np.prod would wrap past 2**63
        padded = -(-max(nbytes, 1) // self.align) * self.align
        label = name or f"{self.space.lower()}{self.num_allocs}"
        if self.top + padded > self.capacity:
            raise CapacityError(
                f"{self.space} of {self.owner}: allocating {label} {shape} {name_of(dt)} needs {nbytes} bytes "
                f"({padded} aligned to {self.align}); {self.top} of {self.capacity} bytes already used, "
                f"{self.capacity - self.top} free")
        if phantom is None:
            phantom = self.phantom_default
        data = None
        if not phantom:
            data = np.empty(nbytes, dtype=np.uint8)
            uint, value = poison_fill(dt)
            data.view(uint)[...] = value
        store = Store(label, nbytes, phantom, self.space, self.die, self.top, core=self.owner, data=data)
        store.regions = Regions()
        self.stores.append(store)
        self.top += padded
        self.num_allocs += 1
        return LocalTensor(store, 0, shape, contiguous_strides(shape, dt.itemsize), dt)
