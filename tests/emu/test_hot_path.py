"""Structures of the scheduler's hot path checked against the computation they replace (issue 19): the L2's bit count,
the trace's compact transfer records."""
import json

from hypothesis import given, settings, strategies as st

from ascend_emu.cache import popcount
from ascend_emu.trace import Trace


@given(x=st.integers(0, (1 << 64) - 1))
@settings(max_examples=500, deadline=None)
def test_popcount_counts_the_set_bits_of_any_64_bit_mask(x):
    assert popcount(x) == bin(x).count("1")


def test_popcount_of_the_extremes():
    assert [popcount(0), popcount(1), popcount(1 << 63), popcount((1 << 64) - 1)] == [0, 1, 1, 64]


_origin = st.sampled_from([{"kernel": "k", "function": "f", "source": "a.py:3"},
                           {"kernel": "k", "function": "g", "source": "a.py:9", "kernel_source": "a.py:2"}])
_record = st.tuples(
    st.integers(0, 3), st.sampled_from(["aiv0", "aiv1", "aic0"]), st.sampled_from(["MTE2", "MTE3", "VECTOR"]),
    st.sampled_from(["copy_gm_to_ub", "muls"]), st.integers(0, 10_000), st.integers(0, 500), _origin,
    st.integers(0, 1 << 20), st.sampled_from([None, "aiv0", "aiv3"]),   # bytes; by (None: not a DMA engine's)
    st.booleans())                                                     # compact or already a slice


def _forms(rec):
    """(the compact record the engine appends, the slice it stands for)."""
    d, u, t, n, s, dur, origin, nbytes, by, compact = rec
    args = dict(origin, bytes=nbytes) if by is None else dict(origin, bytes=nbytes, by=by)
    plain = (d, u, t, n, s, s + dur, args)
    if not compact:
        return plain, plain
    return (d, u, t, n, s, s + dur, origin, nbytes) + (() if by is None else (by,)), plain


@given(records=st.lists(_record, max_size=40), cut=st.integers(0, 40))
@settings(max_examples=150, deadline=None)
def test_compact_records_read_and_export_as_the_slices_they_stand_for(records, cut):
    """A trace the engine filled with compact transfer records (read part way through, then appended to, as a
    partitioned run's windows do) has the slices, Chrome export and digest of one built from the slices."""
    compact, plain = Trace(), Trace()
    for i, rec in enumerate(records):
        if i == cut:
            assert compact.slices == plain.slices       # a read mid-run expands what is there so far
        c, p = _forms(rec)
        compact.records.append(c)
        plain.add_slice(*p)
    assert len(compact) == len(plain) == len(records)
    assert compact.slices == plain.slices
    assert all(len(s) == 7 for s in compact.slices)
    assert json.dumps(compact.to_chrome()) == json.dumps(plain.to_chrome())
    assert compact.digest() == plain.digest()


def test_each_expanded_transfer_has_its_own_args_and_the_sites_args_stay_shared():
    origin = {"kernel": "k", "function": "f", "source": "a.py:3"}
    tr = Trace()
    tr.records.append((0, "aiv0", "MTE2", "copy_gm_to_ub", 0, 10, origin, 64))
    tr.records.append((0, "aiv0", "MTE2", "copy_gm_to_ub", 10, 20, origin, 128))
    tr.add_slice(0, "aiv0", "VECTOR", "muls", 20, 30, origin)
    a, b, c = (s[6] for s in tr.slices)
    assert a == dict(origin, bytes=64) and b == dict(origin, bytes=128) and a is not b
    assert c is origin and origin == {"kernel": "k", "function": "f", "source": "a.py:3"}
    tr.slices = [tr.slices[0]]                 # assigning replaces the records
    assert len(tr) == 1 and tr.slices[0][6] == dict(origin, bytes=64)


@given(rel=st.integers(0, 1 << 16), pages=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4),
       count=st.integers(1, 300), block=st.integers(1, 5000), gap=st.integers(0, 9000),
       line=st.sampled_from([32, 128, 512]))
@settings(max_examples=150, deadline=None)
def test_a_pattern_moved_by_whole_pages_reuses_its_footprint(rel, pages, count, block, gap, line):
    """The memoised footprint of an evenly spaced pattern, moved to other pages, is the one computed block by block
    there (the memo is keyed by the offset within the first page)."""
    import numpy as np

    from ascend_emu import cache
    step = block + gap
    page_bytes = 64 * line              # cache.PAGE_LINES lines a page (a C constant of the build)
    for p in pages:
        a = p * page_bytes + rel
        starts = a + step * np.arange(count, dtype=np.int64)
        assert cache._pattern_footprint(a, count, step, block, line) == cache._numpy_blocks_footprint(starts, block,
                                                                                                      line)
