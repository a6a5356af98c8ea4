"""Fast paths of an instruction's issue (issue 19, the scheduler bench): each must give exactly what the general
path gives.

- ``origin.origin_at`` remembers, per bytecode offset of a core's generator frame, whether the frame yields there
  itself or delegates (``yield from``), and reads the offset through the C API: the args of every instruction are
  those ``origin_of`` finds by walking the frames.
- ``isa.cost_vector`` keys its memo by one int (bytes and the op's row): every op and byte count gets the formula's
  cost, whatever ran before it.
- ``View.__getitem__`` answers a memoised int index before its checks: the same child as a fresh slice, and the
  checks still refuse what they refused.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import cloudmatrix384
from ascend_emu.isa import OPS, Instr, cost_vector
from ascend_emu.origin import Issuer, origin_at, origin_of
from ascend_emu.timing import vector_cycles
from ascend_emu.views import Store, View

HYP = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _helper(depth: int, n: int):
    """Yields ``n`` values from a frame ``depth`` ``yield from`` levels below the caller."""
    if depth:
        yield from _helper(depth - 1, n)
    else:
        for i in range(n):
            yield ("helper", i)


def _kernel(steps):
    """A generator that mixes its own yields (at two sites) with delegations (generator helpers of any depth, a
    plain iterator) in the order ``steps`` gives."""
    for kind, arg in steps:
        if kind == 0:
            yield ("own", 0)
        elif kind == 1:
            yield ("own", 1)
        elif kind == 2:
            yield from _helper(arg, 2)
        else:
            yield from iter([("it", 0), ("it", 1)])     # a plain iterator: no generator frame to walk into


@HYP
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=12))
def test_origin_at_names_every_yield_as_origin_of_does(steps):
    gen = _kernel(steps)
    issuer = Issuer({}, "k")
    fresh = {}
    n = 0
    for _ in gen:
        got = origin_at(issuer, issuer.sites, gen, "k")
        want = origin_of(fresh, gen, "k")
        assert got == want, (n, got, want)
        n += 1
    assert n == sum(1 if k in (0, 1) else 2 for k, _ in steps)


def test_origin_at_tells_own_yields_from_delegations_at_each_offset():
    """The same offsets come round again: the memo must send a delegating offset to the frame walk every time
    (its helper's line), and an own offset to its own line."""
    gen = _kernel([(0, 0), (2, 1), (0, 0), (2, 0), (3, 0), (1, 0), (2, 1)] * 3)
    issuer = Issuer({}, "k")
    lines = []
    for _ in gen:
        o = origin_at(issuer, issuer.sites, gen, "k")
        lines.append((o["function"], "kernel_source" in o))
    own = ("_kernel", False)
    helper = ("_helper", True)
    plain = ("_kernel", False)           # a plain iterator: the kernel's own frame is the innermost
    one = [own, helper, helper, own, helper, helper, plain, plain, own, helper, helper]
    assert lines == one * 3


def _many_sites(steps):
    """Own yields at ten sites (more than ``Issuer``'s ways, so some share one) and a delegation, in ``steps``'s
    order."""
    for s in steps:
        if s == 0:
            yield 0
        elif s == 1:
            yield 1
        elif s == 2:
            yield 2
        elif s == 3:
            yield 3
        elif s == 4:
            yield 4
        elif s == 5:
            yield 5
        elif s == 6:
            yield 6
        elif s == 7:
            yield 7
        elif s == 8:
            yield 8
        elif s == 9:
            yield 9
        else:
            yield from _helper(s - 10, 1)


@HYP
@given(steps=st.lists(st.integers(0, 12), min_size=1, max_size=40))
def test_origin_at_with_more_sites_than_ways_names_each_as_origin_of_does(steps):
    gen = _many_sites(steps)
    issuer = Issuer({}, "k")
    fresh = {}
    n = 0
    for _ in gen:
        got = origin_at(issuer, issuer.sites, gen, "k")
        assert got == origin_of(fresh, gen, "k"), (n, steps)
        n += 1
    assert n == len(steps)
    # every offset answered is remembered in by_at, and a way holds only an offset it answered with that offset's args
    for at, args in zip(issuer.ats, issuer.args):
        assert at == -1 or issuer.by_at[at] is args


def _view(rows: int, cols: int) -> View:
    store = Store("v", rows * cols * 4 + 64, False, "UB", 0, 0, core=object())
    return View(store, 32, (rows, cols), (cols * 4, 4), np.dtype(np.float32))


@HYP
@given(rows=st.integers(1, 6), cols=st.integers(1, 5), keys=st.lists(st.integers(-8, 8), min_size=1, max_size=20))
def test_a_memoised_int_index_is_the_fresh_child(rows, cols, keys):
    check_int_indices(_view(rows, cols), _view(rows, cols), keys)


def check_int_indices(v, fresh, keys) -> None:
    """``v[k]`` for each of ``keys`` is ``fresh._slice(k)`` (the general path) or raises its error, and indexing
    again (by an int or a numpy int) gives the same object."""
    for k in keys:
        try:
            want = fresh._slice(k)
        except Exception as e:   # the general path refuses: so must the memoised one, with the same error
            with pytest.raises(type(e)):
                v[k]
            continue
        got = v[k]
        assert (got.offset, got.shape, got.strides, got.lo, got.hi) == \
            (want.offset, want.shape, want.strides, want.lo, want.hi)
        if k >= 0:
            assert v[k] is got and v[np.int64(k)] is got    # memoised (a negative index takes the general path)


@HYP
@given(ops=st.lists(st.tuples(st.sampled_from(sorted(n for n, s in OPS.items() if s.cost is cost_vector)),
                              st.integers(1, 6), st.integers(1, 2000)), min_size=1, max_size=24))
def test_cost_vector_memo_gives_the_formula_for_every_op_and_size(ops):
    """Ops of one byte count and byte counts of one op, in any order: an int key that mixed them up would answer
    with another op's (or size's) cost."""
    prof = cloudmatrix384(dies=1)
    for name, rows, cols in ops:
        t = _view(rows, cols)
        ins = Instr(OPS[name], (t,), (t[:1],), None)
        nbytes = max(count * (-(-block // prof.ub_align) * prof.ub_align)
                     for count, block in (v.blocks() for v in ins.dsts + ins.srcs))
        want = (prof.cycles_to_ps(vector_cycles(prof, nbytes, OPS[name].cpr)), 0)
        assert cost_vector(ins, prof) == want
        assert cost_vector(ins, prof) == want           # from the memo


def test_op_rows_are_distinct():
    """The memo key is bytes * a bound + the row: two ops of one row would share their costs."""
    rows = [s.row for s in OPS.values()]
    assert sorted(rows) == list(range(len(OPS)))
