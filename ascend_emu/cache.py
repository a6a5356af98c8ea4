"""The L2 of each die: memory-side, write-allocate, write-back, LRU, in front of that die's HBM (DESIGN.md 3.5).

Every GM access of a die (its own cores', a remote die's, a DMA engine's) goes through the owning die's L2. The cache
is kept over lines of ``l2_line_bytes`` grouped in pages of 64 lines; a page holds two 64-bit masks, the lines
present and the dirty ones, and pages sit in LRU order. An access is a *footprint* (the pages and line masks a view
touches, computed from its addresses once per view) and yields the lines that hit, the lines that missed (read from
HBM) and the dirty lines its allocations evicted (written to HBM). Addresses decide everything, never data, so
phantom (timing-only) tensors hit and miss exactly like real ones.

modeled as: LRU over pages of 64 lines: a page's lines share one recency and eviction drops a whole page (the real L2
replaces single lines; with thousands of pages per cache the difference is at most a page of residency).
modeled as: a write allocates its lines without reading the rest of the line from HBM (byte-masked lines), and a
dirty line costs one whole line of HBM write when it is evicted. Nothing is flushed at the end of a run: dirty lines
are written back when they are evicted, possibly by a later run on the same pod.
modeled as: host writes (``to_gm``, ``host_write``) land in HBM and leave the L2 as it was; scalar control accesses
(flags, polls, atomics: a few 32-byte words) are L2 hits and do not change its state.

The install compiles this module with Cython (``cache.pxd`` declares its types); this is the code that runs either way.
"""
from __future__ import annotations

from array import array

import numpy as np

PAGE_LINES = 64
try:                # the install compiles this module: its typed loops beat numpy up to thousands of blocks
    import cython
    COMPILED = cython.compiled
except ImportError:  # pragma: no cover - Cython is a build requirement
    COMPILED = False
# a footprint of up to this many blocks is a loop (_sorted_blocks_footprint), not numpy: compiled, the loop wins up
# to thousands of blocks (a gather's rows); as Python only up to a few dozen
LOOP_BLOCKS = 4096 if COMPILED else 64
_FULL = 0xFFFFFFFFFFFFFFFF
# the SWAR masks as module names: ``cache.pxd`` types them unsigned 64-bit, so the build computes ``popcount`` in C
# (a literal above 2**63 - 1 is a Python int to Cython, and every step of the count would box it)
_M1 = 0x5555555555555555
_M2 = 0x3333333333333333
_M4 = 0x0F0F0F0F0F0F0F0F
_H01 = 0x0101010101010101


def popcount(x) -> int:
    """Set bits of a 64-bit mask (SWAR; the masks keep the Python build exact, the build's product wraps at 2**64)."""
    x = x - ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return ((x * _H01) & _FULL) >> 56


class L2:
    """One die's L2. ``access`` updates it and leaves the access's line counts in ``hit``, ``miss``, ``evicted``.

    Counters over a run (lines): ``read_hit``, ``read_miss``, ``write_lines``, ``writeback`` (dirty lines evicted).

    Pages live in slots of flat arrays (array.array: typed buffers in the build, plain ints from source): a page's
    key, its valid and dirty masks (bit i = line i of the page), and the slots before and after it in LRU order (a
    ring through slot 0: ``_next[0]`` is the least recently used page, ``_prev[0]`` the most recent). An open-addressed
    table (linear probing, at most half full) maps a page to its slot: an access costs a few typed loads per page
    instead of a dict lookup, a move to the end and a Page object per page.
    """

    __slots__ = ("die", "line_bytes", "capacity_lines", "resident", "dirty", "hit", "miss", "evicted",
                 "read_hit", "read_miss", "write_lines", "writeback", "n_pages", "_free", "_key", "_valid",
                 "_dirty", "_prev", "_next", "_table", "_tmask", "_shift")

    def __init__(self, die: int, capacity_bytes: int, line_bytes: int):
        self.die = die
        self.line_bytes = line_bytes
        self.capacity_lines = max(1, capacity_bytes // line_bytes)
        self.hit = self.miss = self.evicted = 0
        self.read_hit = self.read_miss = self.write_lines = self.writeback = 0
        self._clear(_SLOTS0)

    def _clear(self, slots: int) -> None:
        """Empty, with room for ``slots - 1`` pages before the arrays grow."""
        self.resident = 0              # lines present
        self.dirty = 0                 # lines present and dirty
        self.n_pages = 0
        self._key = array("q", bytes(8 * slots))
        self._valid = array("Q", bytes(8 * slots))
        self._dirty = array("Q", bytes(8 * slots))
        self._prev = array("q", bytes(8 * slots))       # slot 0 is the ring's head: empty, it points at itself
        self._next = array("q", range(1, slots + 1))    # free slots chain through _next from _free (0: none)
        self._next[0] = 0
        self._next[slots - 1] = 0
        self._free = 1
        self._table = array("q", bytes(16 * slots))      # page -> slot, 0 = empty; 2 x slots entries: half full
        self._tmask = 2 * slots - 1
        self._shift = 64 - (2 * slots).bit_length() + 1

    def access(self, fp: tuple, write: bool) -> None:
        """Touch a footprint (flat page, mask pairs). A read counts hits and misses; a write allocates the lines it
        does not find and marks them all dirty. Evicts least recently used pages while over capacity."""
        hit = 0
        miss = 0
        dirty = 0
        for i in range(0, len(fp), 2):
            key = fp[i]
            mask = fp[i + 1]
            s = self._slot(key)
            if s == 0:
                s = self._insert(key)
                new = mask
            else:
                new = mask & ~self._valid[s]
                if self._prev[0] != s:     # not the most recent already: unlink, then link at the end
                    self._link_last(s, True)
            n_new = popcount(new)
            hit += popcount(mask) - n_new
            miss += n_new
            self._valid[s] |= mask
            if write:
                dirty += popcount(mask & ~self._dirty[s])
                self._dirty[s] |= mask
        self.resident += miss
        evicted = 0
        while self.resident > self.capacity_lines:
            s = self._next[0]
            self.resident -= popcount(self._valid[s])
            evicted += popcount(self._dirty[s])
            self._drop(s)
        self.dirty += dirty - evicted
        self.hit = hit
        self.miss = miss
        self.evicted = evicted
        if write:
            self.write_lines += hit + miss
        else:
            self.read_hit += hit
            self.read_miss += miss
        self.writeback += evicted

    def _home(self, key: int) -> int:
        """The table entry where ``key``'s probe starts (Fibonacci hashing: the product's top bits)."""
        return ((key * _GOLDEN) & _FULL) >> self._shift

    def _slot(self, key: int) -> int:
        """``key``'s slot, 0 if the page is absent."""
        h = self._home(key)
        s = self._table[h]
        while s != 0 and self._key[s] != key:
            h = (h + 1) & self._tmask
            s = self._table[h]
        return s

    def _insert(self, key: int) -> int:
        """A new, empty page for ``key`` (absent) at the most recent end; returns its slot."""
        if self._free == 0:
            self._grow()
        s = self._free
        self._free = self._next[s]
        self._key[s] = key
        self._valid[s] = 0
        self._dirty[s] = 0
        self._link_last(s, False)
        h = self._home(key)
        while self._table[h] != 0:
            h = (h + 1) & self._tmask
        self._table[h] = s
        self.n_pages += 1
        return s

    def _link_last(self, s: int, linked: bool) -> None:
        """Slot ``s`` to the most recent end of the ring (out of its place first when ``linked``)."""
        if linked:
            self._next[self._prev[s]] = self._next[s]
            self._prev[self._next[s]] = self._prev[s]
        last = self._prev[0]
        self._prev[s] = last
        self._next[s] = 0
        self._next[last] = s
        self._prev[0] = s

    def _drop(self, s: int) -> None:
        """Slot ``s``'s page out of the ring and the table (backward-shift deletion keeps every probe chain whole),
        the slot onto the free chain."""
        self._next[self._prev[s]] = self._next[s]
        self._prev[self._next[s]] = self._prev[s]
        i = self._home(self._key[s])
        while self._table[i] != s:
            i = (i + 1) & self._tmask
        j = i
        while True:
            j = (j + 1) & self._tmask
            t = self._table[j]
            if t == 0:
                break
            k = self._home(self._key[t])
            # t stays unless its home lies cyclically outside (i, j]: then moving it back to i keeps it findable
            if (k <= i or k > j) if i <= j else (k <= i and k > j):
                self._table[i] = t
                i = j
        self._table[i] = 0
        self._next[s] = self._free
        self._free = s
        self.n_pages -= 1

    def _grow(self) -> None:
        """Twice the slots, the pages kept in LRU order (the table is rebuilt for its new size)."""
        resident, dirty = self.resident, self.dirty
        self._refill(self.pages(), self._tmask + 1)
        self.resident, self.dirty = resident, dirty

    def pages(self) -> list:
        """[(page, valid mask, dirty mask)] from the least recently used page to the most recent."""
        out = []
        s = self._next[0]
        while s != 0:
            out.append((self._key[s], self._valid[s], self._dirty[s]))
            s = self._next[s]
        return out

    def load(self, pages: list) -> None:
        """Replace the pages by ``pages`` (``pages()``'s form, least recent first); ``resident`` and ``dirty`` are
        the caller's to set."""
        slots = _SLOTS0
        while slots <= len(pages):
            slots *= 2
        self._refill(pages, slots)

    def _refill(self, pages: list, slots: int) -> None:
        """Empty with ``slots`` slots (more than ``pages``), then ``pages`` in their order."""
        self._clear(slots)
        for key, valid, dirty in pages:
            s = self._insert(key)
            self._valid[s] = valid
            self._dirty[s] = dirty

    def invalidate(self) -> None:
        """Forget every line (dirty ones without a write-back): a cold cache."""
        self._clear(_SLOTS0)

    def take_stats(self) -> dict:
        """This run's counters in bytes, and the bytes present (and dirty) now; resets the counters."""
        lb = self.line_bytes
        out = {"read_hit_bytes": self.read_hit * lb, "read_miss_bytes": self.read_miss * lb,
               "write_bytes": self.write_lines * lb, "writeback_bytes": self.writeback * lb,
               "resident_bytes": self.resident * lb, "dirty_bytes": self.dirty * lb}
        self.read_hit = self.read_miss = self.write_lines = self.writeback = 0
        return out


_SLOTS0 = 64                   # an L2's first arrays (slot 0 is the ring's head); they double when full
_GOLDEN = 0x9E3779B97F4A7C15   # 2**64 / the golden ratio: Fibonacci hashing spreads consecutive pages


class Caches:
    """The L2 of every die of a pod, made on first use."""

    __slots__ = ("capacity", "line_bytes", "by_die")

    def __init__(self, capacity_bytes: int, line_bytes: int):
        self.capacity = capacity_bytes
        self.line_bytes = line_bytes
        self.by_die = {}

    def of(self, die: int) -> L2:
        c = self.by_die.get(die)
        if c is None:
            c = self.by_die[die] = L2(die, self.capacity, self.line_bytes)
        return c

    def invalidate(self) -> None:
        """Every die's L2 cold (routes keep their cache objects, so these are emptied, not replaced)."""
        for c in self.by_die.values():
            c.invalidate()

    def take_stats(self) -> dict:
        """{die: this run's L2 counters} for the dies whose L2 saw traffic in the run (see ``L2.take_stats``)."""
        out = {}
        for die in sorted(self.by_die):
            c = self.by_die[die]
            if c.read_hit or c.read_miss or c.write_lines or c.writeback:
                out[die] = c.take_stats()
        return out


# ------------------------------------------------------------------------------------------------ footprints
def footprint(view, line_bytes: int) -> tuple:
    """The (page, mask) pairs of the lines a GM view touches, memoised on the view (views are immutable)."""
    fp = view._l2fp
    if fp is None:
        fp = view._l2fp = _view_footprint(view, line_bytes)
    return fp


def rows_footprint(view, rows, line_bytes: int) -> tuple:
    """The footprint of rows ``rows`` of a GM view (a gather's sources or a scatter's targets)."""
    if len(rows) == 0:
        return ()
    row = view[0]
    count, block, _ = row._layout()
    base = view.store.base + view.offset
    stride = view.strides[0]
    if count == 1 and len(rows) <= LOOP_BLOCKS:       # a tile's rows: a sorted list, without numpy's passes
        values = rows.tolist() if rows.__class__ is np.ndarray else rows
        return _sorted_blocks_footprint(sorted([base + int(r) * stride for r in values]), block, line_bytes)
    starts = base + np.asarray(rows, dtype=np.int64) * stride
    if count == 1:
        return _blocks_footprint(starts, block, line_bytes)
    inner = _block_starts(row) - (row.store.base + row.offset)
    return _blocks_footprint((starts[:, None] + inner[None, :]).reshape(-1), block, line_bytes)


def _view_footprint(view, line_bytes: int) -> tuple:
    if view.hi <= view.lo:
        return ()
    count, block, pattern = view._layout()
    base = view.store.base
    if count == 1:
        return _range_footprint(base + view.lo, base + view.hi, line_bytes)
    if pattern is not None and pattern[0] >= 0:
        step = pattern[0]
        if count <= LOOP_BLOCKS:
            return _pattern_footprint(base + view.lo, count, step, block, line_bytes)
        starts = base + view.lo + step * np.arange(count, dtype=np.int64)
        return _blocks_footprint(starts, block, line_bytes)
    return _blocks_footprint(_block_starts(view), block, line_bytes)


def _range_footprint(a: int, b: int, line_bytes: int) -> tuple:
    """Lines of the byte range [a, b) of a die's GM."""
    first = int(a) // line_bytes           # int: a view sliced with numpy integers has numpy offsets (Python build)
    last = (int(b) - 1) // line_bytes
    out = []
    page = first // PAGE_LINES
    while page * PAGE_LINES <= last:
        out.append(page)
        out.append(_page_mask(first, last, page))
        page += 1
    return tuple(out)


def _page_mask(first: int, last: int, page: int) -> int:
    """The mask of lines first..last (die-wide line numbers) that fall in ``page``."""
    base = page * PAGE_LINES
    lo = first - base if first > base else 0
    top = last - base
    hi = top if top < PAGE_LINES - 1 else PAGE_LINES - 1
    width = hi - lo + 1
    one = 1                                # typed unsigned in the build: 1 << 63 must not overflow
    return _FULL if width == PAGE_LINES else ((one << width) - one) << lo


def _pattern_footprint(a: int, count: int, step: int, block: int, line_bytes: int) -> tuple:
    """Lines of ``count`` blocks of ``block`` bytes, the first at byte ``a``, one every ``step`` bytes (``step`` >= 0),
    as (page, mask) pairs in page order (``_blocks_footprint``'s answer): a tile's rows of a GM matrix, a slot's
    column block.

    A pattern moved by whole pages has the same masks on pages moved as much, and a kernel's tiles repeat a few
    patterns at a few offsets within a page (the K steps of a weight tile, the experts' matrices): the footprint is
    worked out once per (offset within its first page, count, step, block, line) and moved to ``a``'s page, so a
    strided tile costs its pages, not its blocks."""
    page_bytes = PAGE_LINES * line_bytes
    first = a // page_bytes
    rel = a - first * page_bytes
    key = (rel, count, step, block, line_bytes)
    fp = _PATTERN_MEMO.get(key)
    if fp is None:
        if len(_PATTERN_MEMO) >= PATTERN_MEMO_MAX:
            _PATTERN_MEMO.clear()
        fp = _PATTERN_MEMO[key] = _sorted_blocks_footprint(
            range(rel, rel + count * step, step) if step else [rel] * count, block, line_bytes)
    if first == 0:
        return fp
    out = list(fp)
    for i in range(0, len(out), 2):
        out[i] = out[i] + first
    return tuple(out)


_PATTERN_MEMO: dict = {}        # (offset in the first page, count, step, block, line bytes) -> footprint at page 0
PATTERN_MEMO_MAX = 4096


def _sorted_blocks_footprint(starts, block: int, line_bytes: int) -> tuple:
    """``_blocks_footprint`` of ascending ``starts`` (a list or range of ints) as one typed loop: where numpy's
    per-call cost would dominate (a gather's rows, a few blocks). Equal blocks at ascending starts also end in
    ascending lines, so a block's pages are new ones or among the last few already out (found walking back)."""
    out = []
    cur_page = -1                          # the page being merged, not yet out, and its mask
    cur_mask = 0
    for s in starts:
        first = s // line_bytes
        last = (s + block - 1) // line_bytes
        page = first // PAGE_LINES
        while page * PAGE_LINES <= last:
            mask = _page_mask(first, last, page)
            if page == cur_page:
                cur_mask |= mask
            elif page > cur_page:
                if cur_page >= 0:
                    out.append(cur_page)
                    out.append(cur_mask)
                cur_page = page
                cur_mask = mask
            else:                          # a page an earlier block reached: it is among the last ones out
                j = len(out) - 2
                while out[j] != page:
                    j -= 2
                out[j + 1] = out[j + 1] | mask
            page += 1
    if cur_page >= 0:
        out.append(cur_page)
        out.append(cur_mask)
    return tuple(out)


def _block_starts(view) -> np.ndarray:
    """Byte address of every contiguous block of a view (any strides)."""
    count, block, _ = view._layout()
    dims = [(n, s) for n, s in zip(view.shape, view.strides) if n != 1]
    run = view.dtype.itemsize
    while dims and dims[-1][1] == run and run < block:      # the contiguous trailing dims form the block
        n, _ = dims.pop()
        run *= n
    starts = np.array([view.store.base + view.offset], dtype=np.int64)
    for n, s in dims:
        starts = (starts[:, None] + s * np.arange(n, dtype=np.int64)[None, :]).reshape(-1)
    return starts


def _blocks_footprint(starts: np.ndarray, block: int, line_bytes: int) -> tuple:
    """Lines touched by blocks of ``block`` bytes at ``starts``, as (page, mask) pairs in page order."""
    if len(starts) <= LOOP_BLOCKS:
        return _sorted_blocks_footprint(np.sort(starts).tolist(), block, line_bytes)
    return _numpy_blocks_footprint(starts, block, line_bytes)


def _numpy_blocks_footprint(starts: np.ndarray, block: int, line_bytes: int) -> tuple:
    """``_blocks_footprint`` in a fixed number of numpy passes (many blocks)."""
    first = starts // line_bytes
    last = (starts + (block - 1)) // line_bytes
    span = int((last - first).max()) + 1
    if span == 1:                          # every block within one line (rows of a gather, small blocks)
        lines = np.sort(first)
    else:
        lines = (first[:, None] + np.arange(span, dtype=np.int64)[None, :])
        lines = np.sort(lines[lines <= last[:, None]])
    # sorted: distinct lines where a line differs from the one before, pages start where a page number changes
    # (np.unique, twice, cost more than the rest of a gather's bookkeeping)
    if len(lines) > 1:
        lines = lines[np.concatenate(([True], lines[1:] != lines[:-1]))]
    pages = lines // PAGE_LINES
    bits = np.left_shift(np.uint64(1), (lines % PAGE_LINES).astype(np.uint64))
    idx = np.flatnonzero(np.concatenate(([True], pages[1:] != pages[:-1])))
    keys = pages[idx]
    masks = np.bitwise_or.reduceat(bits, idx)
    out = []
    for k, m in zip(keys.tolist(), masks.tolist()):
        out.append(k)
        out.append(m)
    return tuple(out)
