"""The GM polls (``wait_gm``) waiting for a landing, found by address (DESIGN.md 3.3: a poll sleeps until a write to
what it watches lands).

A landing must re-check only the polls whose words it overlaps, whatever the number of cores waiting: a combine's
per-token counters have a waiter per core on distinct words, a dispatch's status records every core of a die on the
same words. So polls that check the same thing (same words, comparison and value: ``poll_key``) form one group,
checked once per landing; and a store's groups are indexed by the ``GRAIN``-byte blocks they span, so a landing looks
only at the groups of the blocks it writes. Satisfied polls come out in the order they started waiting (the order
the scheduler resumes them in).
"""
from __future__ import annotations

GRAIN = 64          # bytes per block of a store's address index
SPAN = 256          # a poll spanning more blocks than this is checked on every landing on its store
_GRAIN, _SPAN = GRAIN, SPAN     # C integers in the build (polls.pxd); GRAIN and SPAN stay importable


def poll_key(ins):
    """What a wait_gm checks: its view's place, shape and dtype, comparison and scalar value (an array value: the
    poll alone)."""
    p = ins.p
    value = p["value"]
    if value.ndim:
        return ins
    v = ins.srcs[0]
    return (v.offset, v.shape, v.strides, v.dtype, p["cmp"], p["how"], value.dtype.char, value.item())


def _blocks(v):
    """The index blocks view ``v`` spans, or None when they are more than SPAN."""
    b0 = v.lo // _GRAIN
    b1 = (v.hi - 1) // _GRAIN + 1 if v.hi > v.lo else b0
    return None if b1 - b0 > _SPAN else range(b0, b1)


class _Group:
    __slots__ = ("view", "waiting", "blocks")

    def __init__(self, view, blocks):
        self.view = view          # the view every poll of the group reads
        self.waiting = []         # (order, wait_gm) in the order they started waiting
        self.blocks = blocks      # index blocks it is filed under (None: the store's wide list)


class _StorePolls:
    __slots__ = ("groups", "index", "wide")

    def __init__(self):
        self.groups = {}          # poll key -> _Group
        self.index = {}           # block -> {poll key: None} (an ordered set)
        self.wide = {}            # poll keys of groups spanning more than SPAN blocks


class Polls:
    """Every waiting poll of a pod, by store uid."""

    __slots__ = ("stores", "order")

    def __init__(self):
        self.stores: dict = {}
        self.order = 0

    def __len__(self) -> int:
        return sum(len(g.waiting) for sp in self.stores.values() for g in sp.groups.values())

    def add(self, ins) -> None:
        """``ins`` (a wait_gm whose condition does not hold yet) waits for a landing on its view."""
        v = ins.srcs[0]
        sp = self.stores.get(v.store.uid)
        if sp is None:
            sp = self.stores[v.store.uid] = _StorePolls()
        key = poll_key(ins)
        g = sp.groups.get(key)
        if g is None:
            blocks = _blocks(v)
            g = sp.groups[key] = _Group(v, blocks)
            if blocks is None:
                sp.wide[key] = None
            else:
                index = sp.index
                for b in blocks:
                    keys = index.get(b)
                    if keys is None:
                        index[b] = {key: None}
                    else:
                        keys[key] = None
        self.order += 1
        g.waiting.append((self.order, ins))

    def landed(self, uid, lo: int, hi: int, check) -> list | None:
        """A write to [lo, hi) of store ``uid`` became visible: the polls it satisfies (``check(ins)`` on one poll
        of each group it overlaps), removed, in the order they started waiting; None if none."""
        sp = self.stores.get(uid)
        if sp is None:
            return None
        b0 = lo // _GRAIN
        b1 = (hi - 1) // _GRAIN + 1
        if b1 - b0 > _SPAN:
            cands = list(sp.groups)
        else:
            index = sp.index
            cands = None
            # the blocks written that have polls filed: walk the filed ones when they are fewer (a row of data
            # landing beside a few flags); the candidates' order does not matter (the result is sorted by order)
            blocks = range(b0, b1) if b1 - b0 <= len(index) else [b for b in index if b0 <= b < b1]
            for b in blocks:
                keys = index.get(b)
                if keys:
                    if cands is None:
                        cands = list(keys)
                    else:
                        for k in keys:
                            if k not in cands:
                                cands.append(k)
            if sp.wide:
                cands = list(sp.wide) if cands is None else cands + list(sp.wide)
            if cands is None:
                return None
        hit = None
        groups = sp.groups
        for key in cands:
            g = groups[key]
            v = g.view
            if v.lo < hi and lo < v.hi and check(g.waiting[0][1]):
                if hit is None:
                    hit = [key]
                else:
                    hit.append(key)
        if hit is None:
            return None
        done = []
        for key in hit:
            done.extend(_drop_group(sp, key).waiting)
        if len(hit) > 1:
            done.sort(key=_first)
        if not groups:
            del self.stores[uid]
        return [ins for _, ins in done]

    def remove(self, ins) -> bool:
        """``ins`` stops waiting (its bound passed and the kernel handles it); False if it was not waiting (a
        landing satisfied it already)."""
        uid = ins.srcs[0].store.uid
        sp = self.stores.get(uid)
        if sp is None:
            return False
        key = poll_key(ins)
        if key not in sp.groups:       # a key that is not equal to itself (a NaN value): find it by its poll
            key = _key_of(sp, ins)
            if key is None:
                return False
        g = sp.groups[key]
        n = len(g.waiting)
        g.waiting = [w for w in g.waiting if w[1] is not ins]
        if len(g.waiting) == n:
            return False
        if not g.waiting:
            _drop_group(sp, key)
            if not sp.groups:
                del self.stores[uid]
        return True

    def drop(self, gone) -> None:
        """Forget the polls for which ``gone(ins)`` holds (the cores of a killed die)."""
        for uid, sp in list(self.stores.items()):
            for key, g in list(sp.groups.items()):
                g.waiting = [w for w in g.waiting if not gone(w[1])]
                if not g.waiting:
                    _drop_group(sp, key)
            if not sp.groups:
                del self.stores[uid]



def _key_of(sp: _StorePolls, ins):
    """The key of the group ``ins`` waits in, or None."""
    for k, g in sp.groups.items():
        for w in g.waiting:
            if w[1] is ins:
                return k
    return None


def _drop_group(sp: _StorePolls, key) -> _Group:
    """Take the group ``key`` out of ``sp`` and its address index."""
    g = sp.groups.pop(key)
    if g.blocks is None:
        del sp.wide[key]
    else:
        index = sp.index
        for b in g.blocks:
            keys = index[b]
            del keys[key]
            if not keys:
                del index[b]
    return g


def _first(pair):
    return pair[0]
