"""Per-tile dependency tracking (DESIGN.md 3.3): which instructions of a core last wrote and read each byte range.

A ``Region`` is one byte range [lo, hi) of one store (a core-local buffer, or a GM tensor as one core sees it) with
its last writer and its readers since. A new instruction that reads a range waits for the writers of the regions it
overlaps (read after write); one that writes waits for their writers and readers too (write after write, write after
read), the way Ascend C queues and the compiler's auto-sync order a core's pipes. Cross-core ordering is explicit
(flags, barriers) and not tracked here.

``Regions`` holds the regions of one store for one core and finds the ones a new range overlaps by address (a sorted
list and a bisection, wide regions on the side), so an instruction costs the same however many ranges its core has
touched before. Regions whose instructions have all finished before the core's current time can no longer delay
anything the core issues and are dropped now and then.

The install compiles this module with Cython (``tracker.pxd`` declares its types); this is the code that runs either
way.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

try:                # the install compiles this module (tracker.pxd declares the list call track makes)
    import cython
    _COMPILED = cython.compiled
except ImportError:  # pragma: no cover - Cython is a build requirement
    _COMPILED = False

from .isa import OPS

_GM_STORE = OPS["gm_store"]
WIDE = 1 << 16          # regions wider than this (bytes) are kept unsorted beside the sorted narrow ones
SCAN = 8                # up to this many narrow regions a lookup scans them all instead of bisecting
PRUNE_AT = 64           # regions kept before finished ones are dropped (grows when most are still live)


class Region:
    """Byte range [lo, hi) of a store, ``pattern`` its (step, block bytes) when the view is evenly spaced blocks (a
    column block, NZ pages) else None; ``writer`` its last writer (None: only read so far), ``readers`` the latest
    reader of each pipe since, ``read_end`` the latest busy end of readers replaced by a newer one of their pipe."""

    __slots__ = ("lo", "hi", "pattern", "writer", "readers", "read_end")

    def __init__(self, lo: int, hi: int, pattern, writer, readers: list):
        self.lo = lo
        self.hi = hi
        self.pattern = pattern
        self.writer = writer
        self.readers = readers
        self.read_end = 0

    def __repr__(self):
        return f"<Region [{self.lo}, {self.hi}) pattern={self.pattern} writer={self.writer} readers={self.readers}>"

    def live(self, t: int) -> bool:
        """Whether an instruction issued at ``t`` or later can still have to wait for this region."""
        w = self.writer
        if w is not None and (w.end < 0 or w.end > t):
            return True
        if self.read_end > t:
            return True
        for rd in self.readers:
            if rd.busy_end < 0 or rd.busy_end > t:
                return True
        return False


class Regions:
    """The regions of one store as one core tracks them (see the module docstring)."""

    __slots__ = ("narrow", "starts", "wide", "prune_at", "span")

    def __init__(self):
        self.narrow = []          # regions of at most WIDE bytes, by lo
        self.starts = []          # their lo, for bisection
        self.wide = None          # the wider ones, unsorted (None until there is one: most stores have none)
        self.prune_at = PRUNE_AT
        # the widest narrow region added so far (bytes): a region overlapping [lo, hi) starts after lo - span. A
        # lookup that went back WIDE bytes instead scanned every small record of that stretch (a core's 32-byte
        # scale rows: two thousand of them per lookup once it had streamed far enough)
        self.span = 0

    def __len__(self) -> int:
        return len(self.narrow) + (len(self.wide) if self.wide else 0)

    def __iter__(self):
        return iter(self.narrow + (self.wide or []))

    def track(self, ins, lo: int, hi: int, pattern, write: bool, now: int, san=None) -> None:
        """Record that ``ins`` reads (``write`` False) or writes [lo, hi) (``pattern`` as Region's) and add its
        dependencies on earlier instructions: raise ``ins.ready`` to the times already known, register it as a
        waiter of the instructions whose times are not (``ins.pending`` counts them). ``now``: the issuing core's
        time (regions finished by then are dropped when there are many). ``san``: the race sanitizer, told of every
        dependency found (None on the fast path)."""
        if len(self.narrow) > self.prune_at or (self.wide and len(self.narrow) + len(self.wide) > self.prune_at):
            self.prune(now)
        narrow = self.narrow
        n = len(narrow)
        if n <= SCAN:
            i0 = 0
            i1 = n
        else:
            starts = self.starts
            i1 = bisect_left(starts, hi)
            i0 = bisect_right(starts, lo - self.span, 0, i1)
        # the candidates: narrow[i0:i1], then the wide ones, walked in place (a list of them per lookup was a
        # measurable part of every instruction's cost)
        wide = self.wide
        n_narrow = i1 - i0
        n_cands = n_narrow + (len(wide) if wide else 0)
        ready = ins.ready
        hit = None
        covered = 0
        # posted scalar stores from one core to one address arrive in issue order (same path, FIFO), so a
        # store after a store only waits for the first to issue, not to land
        posted = write and ins.spec is _GM_STORE
        for i in range(n_cands):
            r = narrow[i0 + i] if i < n_narrow else wide[i - n_narrow]
            if r.hi <= lo or r.lo >= hi:
                continue
            if pattern is not None and r.pattern is not None and not _collide(r.lo, r.pattern, lo, pattern):
                continue
            if lo <= r.lo and r.hi <= hi:
                covered += 1
            w = r.writer
            if w is not None and w is not ins:
                if san is not None:
                    san.depends(ins, w)
                use_end = not (posted and w.spec is _GM_STORE)
                if w.end >= 0:
                    e = w.end if use_end else w.busy_end
                    if e > ready:
                        ready = e
                else:
                    ws = w.waiters
                    if ws is None:
                        ws = w.waiters = []
                    ws.append(ins)
                    ws.append(use_end)
                    ins.pending += 1
            if write:
                if r.read_end > ready:
                    ready = r.read_end
                for rd in r.readers:
                    if rd is ins:
                        continue
                    if san is not None:
                        san.depends(ins, rd)
                    if rd.busy_end >= 0:
                        if rd.busy_end > ready:
                            ready = rd.busy_end
                    else:
                        ws = rd.waiters
                        if ws is None:
                            ws = rd.waiters = []
                        ws.append(ins)
                        ws.append(False)
                        ins.pending += 1
            if r.lo == lo and r.hi == hi and (r.pattern is pattern or r.pattern == pattern):
                hit = r
        ins.ready = ready
        if write:
            if hit is not None and (covered == 1 or pattern is not None):
                # the common rewrite of one tile: the new writer takes over its record in place (it waited for the
                # old writer and readers already; a patterned write removes nothing, a contiguous one only this)
                hit.writer = ins
                rs = hit.readers
                if rs:                      # the list is the region's own: emptied, not replaced by a new one
                    if _COMPILED:           # the C call ``del rs[:]`` ends in, without making a slice object
                        PyList_SetSlice(rs, 0, len(rs), cython.NULL)
                    else:
                        del rs[:]
                hit.read_end = 0
                return
            if covered and pattern is None:   # a write covers an older record only when it is one contiguous run
                self._drop_within(lo, hi)
            self._add(Region(lo, hi, pattern, ins, []))
        elif hit is None:
            self._add(Region(lo, hi, pattern, None, [ins]))
        else:
            # a pipe runs in order, so a region needs only the latest reader of each pipe for its WAR checks
            rs = hit.readers
            pipe = ins.spec.pipe
            for i in range(len(rs)):
                rd = rs[i]
                if rd.spec.pipe is pipe:
                    if rd.busy_end >= 0 and rd.busy_end > hit.read_end:
                        hit.read_end = rd.busy_end
                    rs[i] = ins
                    break
            else:
                rs.append(ins)

    def _add(self, r: Region) -> None:
        if r.hi - r.lo > WIDE:
            if self.wide is None:
                self.wide = [r]
            else:
                self.wide.append(r)
            return
        if r.hi - r.lo > self.span:
            self.span = r.hi - r.lo
        i = bisect_right(self.starts, r.lo)
        self.starts.insert(i, r.lo)
        self.narrow.insert(i, r)

    def _drop_within(self, lo: int, hi: int) -> None:
        """Forget the regions inside [lo, hi) (a contiguous write covered them)."""
        starts = self.starts
        i0 = bisect_left(starts, lo)
        i1 = bisect_left(starts, hi)
        if i1 > i0:
            keep = [r for r in self.narrow[i0:i1] if r.hi > hi]
            self.narrow[i0:i1] = keep
            starts[i0:i1] = [r.lo for r in keep]
        if self.wide:
            self.wide = [r for r in self.wide if not (lo <= r.lo and r.hi <= hi)]

    def prune(self, t: int) -> None:
        """Drop the regions no instruction issued at ``t`` or later can wait for; with most of them still live,
        wait for twice as many before trying again (a scan that frees nothing would otherwise repeat per access)."""
        self.narrow = [r for r in self.narrow if r.live(t)]
        self.starts = [r.lo for r in self.narrow]
        if self.wide:
            self.wide = [r for r in self.wide if r.live(t)]
        left = len(self.narrow) + (len(self.wide) if self.wide else 0)
        self.prune_at = left * 2 if left * 2 > PRUNE_AT else PRUNE_AT


def _collide(a0: int, pa: tuple, b0: int, pb: tuple) -> bool:
    """Whether two evenly blocked byte patterns (first block at a0 / b0, (step, block)) can share a byte; exact
    for equal steps, conservative otherwise (their extents are already known to overlap)."""
    if pa[0] != pb[0]:
        return True
    step = pa[0]
    d = (b0 - a0) % step
    return d < pa[1] or d + pb[1] > step
