"""Shadow state of the race sanitizer: who last wrote and who read each word of GM, and which bytes of a core's
local buffers were ever written.

GM, per allocation (``GmShadow``): runs of 4-byte words with one state, a Python int packing two int32 ids of the
sanitizer's access records (``pack``): the last writer (0: never written; a negative id names a set of unordered
atomic writers) and the reads since the last write (0: none; a negative id names a set of reads that are not ordered
with each other). A run starts at ``starts[i]`` and ends where the next starts (the last at the allocation's end);
a check reads the distinct states of the runs an access overlaps and writes each one's successor back
(``distinct`` / ``assign``), so its cost and the shadow's memory grow with the runs an access touches (about one per
transfer), not with its bytes. Local buffers, per allocation (``LocalShadow``): the byte ranges ever written,
merged (a flag per byte once they are many).

modeled as: GM is shadowed in 4-byte words (a copy or store that covers part of a word counts for the whole word);
an allocation of more than 2^26 words (a paper-scale phantom tensor in a timing-only run) is shadowed in coarser
power-of-two units so that an access's unit list stays small, and two cores writing neighbouring bytes of one unit
are then reported as a race.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

from .cache import _block_starts

WORD_BYTES = 4
MAX_UNITS = 1 << 26
MAX_LOCAL_RANGES = 64   # written ranges of a local allocation beyond which it gets a flag per byte
MAX_SPANS = 16          # pieces of one access beyond which a shadow goes dense (GmShadow.select)
_MEMO_LIMIT = 4096


class GmShadow:
    """Writers and readers of every word of one GM allocation (``store``), as runs of words with one state."""

    __slots__ = ("store", "owner", "unit", "starts", "states", "state", "_inverse", "_memo")

    def __init__(self, store, owner):
        self.store = store
        self.owner = owner            # the Sanitizer (host writes through GMTensor.write report to it)
        unit = WORD_BYTES
        while -(-store.nbytes // unit) > MAX_UNITS:
            unit *= 2
        self.unit = unit
        self.starts = [0]             # first unit of each run, ascending
        self.states = [0]             # pack(writer, readers) of each run
        self.state = None             # once dense: one int64 state per unit (the runs are dropped)
        self._inverse = None          # dense: each selected unit's index in the last ``distinct`` answer
        self._memo: dict = {}

    def written(self) -> bool:
        """Whether any access touched it yet."""
        return self.state is not None or len(self.starts) > 1 or self.states[0] != 0

    def select(self, view, rows=None) -> tuple:
        """(the units ``view`` touches (rows ``rows`` of it): a slice or index array (``units``), the same as
        ascending (first, end) pairs). An access of more than ``MAX_SPANS`` pieces (a strided tile, a gather) makes
        the shadow dense: a tile's rows would each be a run, and one numpy pass over its words is cheaper."""
        idx = self.units(view, rows)
        if isinstance(idx, slice):
            return idx, ((idx.start, idx.stop),) if idx.stop > idx.start else ()
        if self.state is not None:
            return idx, None
        if isinstance(idx, Strided):
            spans = idx.spans() if idx.count <= MAX_SPANS else None
        else:
            spans = _spans(idx)
        if spans is None or len(spans) > MAX_SPANS:
            self._densify()
            return idx, None
        return idx, spans

    def _densify(self) -> None:
        state = np.zeros(self._units_total(), dtype=np.int64)    # pages nothing touched stay unmapped
        ends = self.starts[1:] + [state.size]
        for a, b, v in zip(self.starts, ends, self.states):
            if v:
                state[a:b] = v
        self.state = state
        self.starts = self.states = None

    def distinct(self, idx, spans) -> list:
        """The distinct states of the units selected (``select``'s answer), in the order first met (dense: sorted)."""
        if self.state is not None:
            a = self._take(idx)
            self._inverse = None
            if a.size == 0:
                return []
            first = a.flat[0]
            if a.size == 1 or not (a != first).any():
                return [int(first)]
            values, inverse = np.unique(a.reshape(-1), return_inverse=True)
            self._inverse = inverse.reshape(a.shape)
            return values.tolist()
        starts, states = self.starts, self.states
        if len(starts) == 1:
            return [states[0]] if spans else []
        out = []
        for a, b in spans:
            i0 = bisect_right(starts, a) - 1
            i1 = bisect_left(starts, b, i0 + 1)
            for v in states[i0:i1]:
                if v not in out:
                    out.append(v)
        return out

    def assign(self, idx, spans, old: list, new: list) -> None:
        """Give the units selected whose state is ``old[i]`` the state ``new[i]`` (``old``: ``distinct``'s answer
        for the same selection, just before)."""
        if self.state is not None:
            if isinstance(idx, Strided):
                target = idx.of(self.state)
                if self._inverse is None:
                    if new:
                        target[...] = new[0]
                else:
                    target[...] = np.array(new, dtype=np.int64)[self._inverse]
            elif self._inverse is None:
                if new:
                    self.state[idx] = new[0]
            else:
                self.state[idx] = np.array(new, dtype=np.int64)[self._inverse]
            return
        succ = dict(zip(old, new)) if len(old) > 1 else None
        starts, states = self.starts, self.states
        for a, b in spans:
            i0 = bisect_right(starts, a) - 1
            i1 = bisect_left(starts, b, i0 + 1)
            end = starts[i1] if i1 < len(starts) else self._units_total()
            run_s, run_v = [], []
            if starts[i0] < a:                    # the first run's part before the span keeps its state
                run_s.append(starts[i0])
                run_v.append(states[i0])
            for j in range(i0, i1):
                v = new[0] if succ is None else succ[states[j]]
                s = starts[j] if starts[j] > a else a
                if run_v and run_v[-1] == v:
                    continue
                run_s.append(s)
                run_v.append(v)
            if end > b and run_v[-1] != states[i1 - 1]:   # the last run's part after the span keeps its state
                run_s.append(b)
                run_v.append(states[i1 - 1])
            if i0 > 0 and states[i0 - 1] == run_v[0]:   # merge with the neighbours of equal state
                i0 -= 1
                run_s[0] = starts[i0]
            if i1 < len(starts) and states[i1] == run_v[-1]:
                i1 += 1
            starts[i0:i1] = run_s
            states[i0:i1] = run_v

    def _take(self, idx) -> np.ndarray:
        """The dense states of ``idx`` (a view for a slice or ``Strided``)."""
        return idx.of(self.state) if isinstance(idx, Strided) else self.state[idx]

    def _units_total(self) -> int:
        return max(1, -(-self.store.nbytes // self.unit))

    def dense(self, idx) -> np.ndarray:
        """The state of each unit of ``idx`` (a slice or index array), as int64 (for per-row questions)."""
        if self.state is not None:
            return self._take(idx).reshape(-1)
        if isinstance(idx, Strided):
            idx = idx.indices()
        if isinstance(idx, slice):
            idx = np.arange(idx.start, idx.stop, dtype=np.int64)
        pos = np.searchsorted(np.asarray(self.starts, dtype=np.int64), idx, side="right") - 1
        return np.asarray(self.states, dtype=np.int64)[pos]

    def compact(self, old: int) -> None:
        """Every state becomes ``old`` where written, 0 where not (``Sanitizer._compact``)."""
        if self.state is not None:
            written = (self.state & 0xFFFFFFFF) != 0
            self.state[...] = 0
            self.state[written] = old
            return
        run_s, run_v = [], []
        for s, v in zip(self.starts, self.states):
            v = old if v & 0xFFFFFFFF else 0
            if not run_v or run_v[-1] != v:
                run_s.append(s)
                run_v.append(v)
        self.starts, self.states = run_s, run_v

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
            if pattern is not None and pattern[0] % u == 0:
                step = pattern[0] // u
                span = (lo % u + block - 1) // u + 1
                if span <= step:                # rows of units that do not overlap: a strided view of the state
                    return Strided(lo // u, count, step, span)
            # the units of a layout shifted by whole units are the same shifted: memoise them relative to lo's unit
            key = (lo % u, view.shape, view.strides, view.dtype.itemsize)
            rel = self._memo.get(key)
            if rel is None:
                if pattern is not None:
                    starts = lo + pattern[0] * np.arange(count, dtype=np.int64)
                else:
                    starts = _block_starts(view) - view.store.base
                rel = _units(starts, block, u) - lo // u
                if len(self._memo) > _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[key] = rel
            return rel + lo // u
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


class Strided:
    """Units ``first + i * step + j`` for i < ``count``, j < ``span`` (``span`` <= ``step``): a tile of evenly spaced
    rows, selected as a strided view of a dense state instead of an index array."""

    __slots__ = ("first", "count", "step", "span")

    def __init__(self, first: int, count: int, step: int, span: int):
        self.first, self.count, self.step, self.span = first, count, step, span

    @property
    def size(self) -> int:
        return self.count * self.span

    def of(self, state: np.ndarray) -> np.ndarray:
        """The (count, span) strided view of ``state``."""
        base = state[self.first:]
        return np.lib.stride_tricks.as_strided(base, (self.count, self.span),
                                               (self.step * state.itemsize, state.itemsize))

    def spans(self) -> tuple:
        return tuple((self.first + i * self.step, self.first + i * self.step + self.span) for i in range(self.count))

    def indices(self) -> np.ndarray:
        return (self.first + self.step * np.arange(self.count, dtype=np.int64)[:, None]
                + np.arange(self.span, dtype=np.int64)[None, :]).reshape(-1)


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
    """Which bytes of one local allocation were ever written (by an instruction of its core): the written byte
    ranges, merged (``starts`` / ``ends``), or, once more than ``MAX_LOCAL_RANGES`` of them are apart (column blocks
    written one by one), one flag per byte (``written``)."""

    __slots__ = ("nbytes", "starts", "ends", "written", "ready")

    def __init__(self, store):
        self.nbytes = max(store.nbytes, 1)
        self.starts: list = []        # first byte of each written range, ascending
        self.ends: list = []
        self.written = None           # once dense: one bool per byte
        self.ready = set()            # views known to be written in full (written bytes never become unwritten)

    def _bytes(self, view, flags, base: int = 0) -> np.ndarray:
        """``view``'s bytes in ``flags`` (one flag per byte of the allocation from byte ``base`` on)."""
        item = view.dtype.itemsize
        return np.ndarray(tuple(view.shape) + (item,), dtype=np.bool_, buffer=flags, offset=view.offset - base,
                          strides=tuple(view.strides) + (1,))

    def unwritten(self, view) -> tuple:
        """(rows of ``view`` of which nothing wrote a single byte, rows): a row is its last dimension, so a tile
        read with unwritten padding inside its rows is not counted, a row nothing filled is."""
        if view in self.ready:
            return 0, 0
        if self.written is not None:
            b = self._bytes(view, self.written)
        else:
            lo, hi = view.lo, view.hi
            i = bisect_right(self.starts, lo) - 1
            if i >= 0 and self.ends[i] >= hi:         # one written range holds it all
                self.ready.add(view)
                return 0, 0
            flags = np.zeros(max(hi - lo, 1), dtype=np.bool_)
            for j in range(max(i, 0), bisect_left(self.starts, hi)):
                a, e = max(self.starts[j], lo), min(self.ends[j], hi)
                if a < e:
                    flags[a - lo:e - lo] = True
            b = self._bytes(view, flags, lo)
        if b.all():
            self.ready.add(view)
            return 0, 0
        rows = b.reshape(-1, b.shape[-2] * b.shape[-1]) if b.ndim > 1 else b.reshape(1, -1)
        return int(np.count_nonzero(~rows.any(axis=1))), rows.shape[0]

    def mark(self, view) -> None:
        if view in self.ready:
            return
        self.ready.add(view)
        if self.written is None:
            count, block, pattern = view._layout()
            if count == 1:
                self._add(view.lo, view.hi)
                return
            if count <= MAX_LOCAL_RANGES:
                if pattern is not None:
                    firsts = [view.lo + i * pattern[0] for i in range(count)]
                else:
                    firsts = (_block_starts(view) - view.store.base).tolist()
                for a in firsts:
                    self._add(a, a + block)
                if len(self.starts) <= MAX_LOCAL_RANGES:
                    return
            self._densify()
        self._bytes(view, self.written)[...] = True

    def _add(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) were written: merge them into the ranges (touching ranges become one)."""
        starts, ends = self.starts, self.ends
        i = bisect_left(ends, lo)
        j = bisect_right(starts, hi)
        if i < j:
            lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
        starts[i:j] = [lo]
        ends[i:j] = [hi]

    def _densify(self) -> None:
        self.written = np.zeros(self.nbytes, dtype=np.bool_)
        for a, e in zip(self.starts, self.ends):
            self.written[a:e] = True
        self.starts = self.ends = None


def _spans(idx: np.ndarray) -> tuple:
    """Ascending (first, end) pairs of the distinct units in ``idx``."""
    if idx.size == 0:
        return ()
    u = np.sort(idx)
    breaks = np.flatnonzero(np.diff(u) > 1) + 1
    firsts = u[np.concatenate(([0], breaks))]
    ends = u[np.concatenate((breaks - 1, [u.size - 1]))] + 1
    return tuple(zip(firsts.tolist(), ends.tolist()))
