"""The L2's page structure (slots in flat arrays, a hash table, an intrusive LRU ring) against a plain reference
model: an OrderedDict of pages in LRU order, the structure the L2 had before."""
from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from ascend_emu.cache import L2, popcount


class RefL2:
    """The reference: page -> [valid, dirty] in an OrderedDict, least recently used first."""

    def __init__(self, capacity_lines: int):
        self.capacity_lines = capacity_lines
        self.pages = OrderedDict()
        self.resident = self.dirty = self.writeback = 0

    def access(self, fp: tuple, write: bool) -> tuple:
        hit = miss = dirty = 0
        for i in range(0, len(fp), 2):
            key, mask = fp[i], fp[i + 1]
            pg = self.pages.get(key)
            if pg is None:
                pg = self.pages[key] = [0, 0]
            else:
                self.pages.move_to_end(key)
            new = mask & ~pg[0]
            hit += popcount(mask) - popcount(new)
            miss += popcount(new)
            pg[0] |= mask
            if write:
                dirty += popcount(mask & ~pg[1])
                pg[1] |= mask
        self.resident += miss
        evicted = 0
        while self.resident > self.capacity_lines:
            _, (valid, dirt) = self.pages.popitem(False)
            self.resident -= popcount(valid)
            evicted += popcount(dirt)
        self.dirty += dirty - evicted
        self.writeback += evicted
        return hit, miss, evicted


masks = st.one_of(st.just(0xFFFFFFFFFFFFFFFF), st.integers(1, 0xFFFFFFFFFFFFFFFF), st.sampled_from([1, 1 << 63]))
# pages from a small set (hits, reuse) and a wide one (the table's probe chains, wrapping, deletion)
keys = st.one_of(st.integers(0, 40), st.integers(0, 1 << 40))
footprints = st.lists(st.tuples(keys, masks), min_size=1, max_size=12, unique_by=lambda p: p[0])


@settings(max_examples=300, deadline=None)
@given(capacity_pages=st.integers(1, 300), accesses=st.lists(st.tuples(footprints, st.booleans()), max_size=80),
       invalidate_at=st.integers(-1, 80))
def test_l2_is_the_ordered_dict_model(capacity_pages, accesses, invalidate_at):
    """Every access's hits, misses and evictions, the resident, dirty and written-back lines, and the pages in LRU
    order with their masks equal the reference's, across evictions, growth of the arrays and an invalidation."""
    line = 128
    c = L2(0, capacity_pages * 64 * line // 3, line)      # capacities that are not whole pages too; past 63 pages the arrays grow
    ref = RefL2(c.capacity_lines)
    for n, (pairs, write) in enumerate(accesses):
        if n == invalidate_at:
            c.invalidate()
            ref.pages.clear()
            ref.resident = ref.dirty = 0
        fp = tuple(x for p in sorted(pairs) for x in p)
        want = ref.access(fp, write)
        c.access(fp, write)
        assert (c.hit, c.miss, c.evicted) == want
        assert (c.resident, c.dirty, c.writeback, c.n_pages) == (ref.resident, ref.dirty, ref.writeback,
                                                                 len(ref.pages))
    assert c.pages() == [(k, v, d) for k, (v, d) in ref.pages.items()]


@given(pages=st.lists(st.tuples(keys, masks, masks), max_size=200, unique_by=lambda p: p[0]))
def test_load_restores_the_pages_in_lru_order(pages):
    """``load(pages())`` gives back the same pages in the same order, and the next access sees them."""
    c = L2(0, 1 << 30, 128)
    c.load(pages)
    assert c.pages() == pages
    for key, valid, _ in pages:
        c.access((key, valid), False)
        assert (c.hit, c.miss) == (popcount(valid), 0)
