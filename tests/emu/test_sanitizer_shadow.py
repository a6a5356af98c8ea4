"""The sanitizer's GM shadow (``ascend_emu.shadow.GmShadow``) as runs of words gives, for any sequence of accesses,
the states a plain array of one state per word gives; a local buffer's written ranges (``LocalShadow``) answer as a
flag per byte does; and vector clocks (``happens_before``) join as the elementwise max of their rows."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu.happens_before import EMPTY, ISSUED, VectorClock, join_all, join_vc
from ascend_emu.shadow import GmShadow, LocalShadow
from ascend_emu.views import Store, View

WORDS = 64


class _Store:
    nbytes = WORDS * 4


def _spans(first: int, end: int, pieces: int, stride: int) -> tuple:
    out = []
    for i in range(pieces):
        a, b = first + i * stride, min(end + i * stride, WORDS)
        if a < b and (not out or a >= out[-1][1]):
            out.append((a, b))
    return tuple(out)


access = st.tuples(st.integers(0, WORDS - 1), st.integers(1, 8), st.integers(1, 4), st.integers(8, 16),
                   st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(access, min_size=1, max_size=30))
def test_runs_match_one_state_per_word(accesses):
    """Each access maps every distinct old state of its words to a new one (as the checks do); the runs and a dense
    array agree on the distinct states seen and on every word afterwards."""
    sh = GmShadow(_Store(), None)
    dense = np.zeros(WORDS, dtype=np.int64)
    for step, (first, length, pieces, stride, salt) in enumerate(accesses, 1):
        spans = _spans(first, first + length, pieces, stride)
        idx = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, np.int64)
        seen = sh.distinct(idx, spans)
        want = list(dict.fromkeys(dense[idx].tolist()))
        assert sorted(seen) == sorted(want)
        new = [(v * 7 + step * 3 + salt) % 5 for v in seen]    # a few states, so that runs merge and split
        sh.assign(idx, spans, seen, new)
        succ = dict(zip(seen, new))
        dense[idx] = [succ[v] for v in dense[idx].tolist()]
        assert sh.dense(np.arange(WORDS)).tolist() == dense.tolist()
        assert all(a < b for a, b in zip(sh.starts, sh.starts[1:]))
        assert all(a != b for a, b in zip(sh.states, sh.states[1:]))    # neighbouring runs differ


rows = st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 50), min_size=8, max_size=8)), max_size=4)


def _clock(entries, gen=1, extra=None) -> VectorClock:
    """A clock of rows ``entries`` ((clock id, row), joined) and ``extra``: one more row kept as an overlay."""
    table = None
    if entries:
        table = np.zeros((max(c for c, _ in entries) + 1, ISSUED + 1), dtype=np.int32)
        for c, row in entries:
            table[c] = np.maximum(table[c], row)
    overlay = None
    if extra:
        cid, row = extra
        if table is not None and cid < table.shape[0]:
            row = np.maximum(table[cid], row)
        overlay = {cid: tuple(int(x) for x in row)}
    if table is None and overlay is None:
        return EMPTY
    return VectorClock(table, gen, overlay)


def _dense(vc: VectorClock) -> dict:
    return {c: [vc.know(c, f) for f in range(ISSUED + 1)] for c in range(8)}


extra_row = st.one_of(st.none(), st.tuples(st.integers(0, 7), st.lists(st.integers(0, 50), min_size=8, max_size=8)))


@settings(max_examples=300, deadline=None)
@given(rows, rows, extra_row, extra_row)
def test_vector_clock_joins_are_elementwise_max(a, b, extra_a, extra_b):
    """``join_vc`` and ``join_all`` give every clock's row as the max of the inputs' (overlay rows included), and
    ``join_vc`` returns its first argument itself when the second adds nothing."""
    va = _clock(a, extra=extra_a)
    vb = _clock(b, extra=extra_b)
    want = {c: [max(x, y) for x, y in zip(_dense(va)[c], _dense(vb)[c])] for c in range(8)}
    assert _dense(join_vc(va, vb)) == want
    assert _dense(join_all([va, vb])) == want
    joined = join_vc(va, vb)
    assert join_vc(joined, vb) is joined
    assert join_vc(joined, va) is joined


def test_an_older_generation_adds_only_its_host_entry():
    """Clock ids are handed out again after a run boundary: rows of an older generation never reach a newer one."""
    new = _clock([(0, [1] * 8)], gen=2)
    old = VectorClock(np.full((3, ISSUED + 1), 9, np.int32), 1, None, None, (4, 1))
    joined = join_vc(new, old)
    assert _dense(joined) == _dense(new)
    assert joined.host == (4, 1)


local_access = st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 16), st.integers(0, 31), st.integers(1, 32))


@settings(max_examples=200, deadline=None)
@given(st.lists(local_access, min_size=1, max_size=40))
def test_local_ranges_match_one_flag_per_byte(accesses):
    """Marks and reads of tiles (row and column blocks of a 16 x 32 fp32 buffer): the merged written ranges answer
    ``unwritten`` as a flag per byte does, before and after they go dense."""
    store = Store("ub", 16 * 32 * 4, False, "UB", 0, 4096)
    whole = View(store, 0, (16, 32), (128, 4), np.dtype(np.float32))
    sh = LocalShadow(store)
    flags = np.zeros(store.nbytes, dtype=np.bool_)
    for write, r0, nr, c0, nc in accesses:
        tile = whole[r0:min(r0 + nr, 16), c0:min(c0 + nc, 32)]
        if tile.shape[0] == 0 or tile.shape[1] == 0:
            continue
        b = np.ndarray(tuple(tile.shape) + (4,), dtype=np.bool_, buffer=flags, offset=tile.offset,
                       strides=tuple(tile.strides) + (1,))
        if write:
            sh.mark(tile)
            b[...] = True
        else:
            rows = b.reshape(tile.shape[0], -1)
            missing = int(np.count_nonzero(~rows.any(axis=1)))
            assert sh.unwritten(tile) == ((missing, tile.shape[0]) if not rows.all() else (0, 0))
