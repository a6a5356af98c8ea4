"""Shadow state of the race sanitizer: who last wrote and who read each word of GM, and which bytes of a core's
local buffers were ever written.

GM, per allocation (``GmShadow``): one int64 per 4-byte word (allocated on first access) packing two int32 ids of
the sanitizer's access records (``pack``): the last writer (0: never written; a negative id names a set of unordered
atomic writers) and the reads since the last write (0: none; a negative id names a set of reads that are not ordered
with each other). One array keeps a check to one pass over the words. Local buffers, per allocation
(``LocalShadow``): one flag per byte, set once written.

modeled as: GM is shadowed in 4-byte words (a copy or store that covers part of a word counts for the whole word);
an allocation of more than 2^26 words (a paper-scale phantom tensor in a timing-only run) is shadowed in coarser
power-of-two units so that its shadow stays within 512 MiB, and two cores writing neighbouring bytes of one unit
are then reported as a race.
"""
from __future__ import annotations

import numpy as np

from .cache import _block_starts

WORD_BYTES = 4
MAX_UNITS = 1 << 26
_MEMO_LIMIT = 4096


class GmShadow:
    """Writers and readers of every word of one GM allocation (``store``)."""

    __slots__ = ("store", "owner", "unit", "state", "_memo")

    def __init__(self, store, owner):
        self.store = store
        self.owner = owner            # the Sanitizer (host writes through GMTensor.write report to it)
        unit = WORD_BYTES
        while -(-store.nbytes // unit) > MAX_UNITS:
            unit *= 2
        self.unit = unit
        self.state = None             # int64 per unit: pack(writer, readers)
        self._memo: dict = {}

    def words(self) -> np.ndarray:
        if self.state is None:
            self.state = np.zeros(max(1, -(-self.store.nbytes // self.unit)), dtype=np.int64)
        return self.state

    def units(self, view, rows=None):
        """The units a GM view touches (rows ``rows`` of it for a gather / scatter): a slice when contiguous,
        else an index array (memoised per layout)."""
        u = self.unit
        if rows is None:
            lo, hi = view.lo, view.hi
            if hi <= lo:
                return slice(0, 0)
            count, block, pattern = view._layout()
            if count == 1:
                return slice(lo // u, -(-hi // u))
            key = (view.offset, view.shape, view.strides, view.dtype.itemsize)
            idx = self._memo.get(key)
            if idx is None:
                if pattern is not None:
                    starts = lo + pattern[0] * np.arange(count, dtype=np.int64)
                else:
                    starts = _block_starts(view) - view.store.base
                idx = _units(starts, block, u)
                if len(self._memo) > _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[key] = idx
            return idx
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0 or view.shape[0] == 0:
            return slice(0, 0)
        row = view[0]
        count, block, _ = row._layout()
        starts = view.offset + rows * view.strides[0]
        if count > 1:
            inner = _block_starts(row) - (row.store.base + row.offset)
            starts = (starts[:, None] + inner[None, :]).reshape(-1)
        return _units(starts, block, u)


def pack(writer: int, readers: int) -> int:
    """One word's state: the writer id in the low 32 bits, the readers id in the high 32 (both signed)."""
    return (readers << 32) | (writer & 0xFFFFFFFF)


def unpack(state: int) -> tuple:
    """(writer id, readers id) of a packed word state."""
    w = state & 0xFFFFFFFF
    return (w - (1 << 32) if w & 0x80000000 else w), state >> 32


def _units(starts: np.ndarray, block: int, unit: int) -> np.ndarray:
    """Indices of the ``unit``-byte units touched by blocks of ``block`` bytes at byte offsets ``starts``."""
    first = starts // unit
    last = (starts + (block - 1)) // unit
    span = int((last - first).max()) + 1 if len(starts) else 0
    idx = first[:, None] + np.arange(span, dtype=np.int64)[None, :]
    if (last - first == span - 1).all():
        return idx.reshape(-1)
    return idx[idx <= last[:, None]]


class LocalShadow:
    """Which bytes of one local allocation were ever written (by an instruction of its core)."""

    __slots__ = ("written", "ready")

    def __init__(self, store):
        self.written = np.zeros(max(store.nbytes, 1), dtype=np.bool_)
        self.ready = set()            # views known to be written in full (written bytes never become unwritten)

    def _bytes(self, view) -> np.ndarray:
        item = view.dtype.itemsize
        return np.ndarray(tuple(view.shape) + (item,), dtype=np.bool_, buffer=self.written, offset=view.offset,
                          strides=tuple(view.strides) + (1,))

    def unwritten(self, view) -> tuple:
        """(rows of ``view`` of which nothing wrote a single byte, rows): a row is its last dimension, so a tile
        read with unwritten padding inside its rows is not counted, a row nothing filled is."""
        if view in self.ready:
            return 0, 0
        b = self._bytes(view)
        if b.all():
            self.ready.add(view)
            return 0, 0
        rows = b.reshape(-1, b.shape[-2] * b.shape[-1]) if b.ndim > 1 else b.reshape(1, -1)
        return int(np.count_nonzero(~rows.any(axis=1))), rows.shape[0]

    def mark(self, view) -> None:
        if view not in self.ready:
            self._bytes(view)[...] = True
            self.ready.add(view)
