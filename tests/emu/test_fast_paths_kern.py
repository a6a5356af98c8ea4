"""Fast paths of a copy's issue and of its L2 lookup (issue 19, the kernel's own cost per instruction): each must
give exactly what the general path gives.

- ``KernelContext._xfer`` answers the last read's and the last write's route before its memo by mover and die: every
  copy gets the route ``Paths.path`` gives for its mover and dies, whatever dies the copies before it used.
- ``View.__getitem__`` answers an int index of a short dim 0 from a list by index (a long one from its dict): the
  child of the general path either way.
- ``KernelContext._space_align`` answers the last space's alignment by identity: every operand is checked against
  its own space's.
- ``Engine._footprint`` takes a GM view's memoised footprint off the GC's lists: it is the footprint a fresh
  computation gives, and (compiled) no collection walks it.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import ENGINE_BUILD, Pod, cloudmatrix384, kernel
from ascend_emu.cache import _view_footprint
from ascend_emu.errors import AddressError, AlignmentError
from ascend_emu.views import MEMO_INTS, Store, View

from .test_fast_paths_issue import check_int_indices

H = 64
HYP = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@kernel(cores="aiv")
def _hops(ctx, gms, steps, got):
    """Per step a copy from (read) or to (write) the GM tensor on die ``die``; ``got`` records whether each copy's
    route is the one ``Paths.path`` gives."""
    t = ctx.ub.alloc((8, H), "fp32")
    for read, die in steps:
        g = gms[die][ctx.block_idx]
        if read:
            ins = ctx.copy_gm_to_ub(t, g)
            want = ctx._paths.path("MTE2", ctx.die, die, None)
        else:
            ins = ctx.copy_ub_to_gm(g, t, atomic="add" if die == 1 else None)
            want = ctx._paths.path("MTE3", ctx.die, None, die)
        got.append(ins.path is want)
        yield ins


@HYP
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(0, 2)), min_size=1, max_size=16))
def test_every_copy_gets_the_route_of_its_mover_and_dies(steps):
    pod = Pod(cloudmatrix384(dies=3))
    gms = [pod.alloc(d, (2, 8, H), "fp32", phantom=True) for d in range(3)]
    got: list = []
    pod.launch(_hops, aiv=2, args=(gms, tuple(steps), got))
    assert got == [True] * (2 * len(steps))


@kernel(cores="aiv")
def _rows(ctx, x_gm, y_gm):
    t = ctx.ub.alloc((8, H), "fp32")
    for r in range(x_gm.shape[0]):
        yield ctx.copy_gm_to_ub(t, x_gm[r])
        yield ctx.copy_ub_to_gm(y_gm[r, :, 8:40], t[:, 8:40], pad=True)


def test_a_memoised_footprint_is_the_fresh_one_and_untracked():
    pod = Pod(cloudmatrix384(dies=1))
    x = pod.alloc(0, (5, 8, H), "fp32", phantom=True)
    y = pod.alloc(0, (5, 8, H), "fp32", phantom=True)
    pod.launch(_rows, aiv=1, args=(x, y))
    line = pod.engine.line_bytes
    views = [x[r] for r in range(5)] + [y[r, :, 8:40] for r in range(5)]
    for v in views:
        fp = v._l2fp
        assert fp is not None and len(fp) > 0
        assert fp == _view_footprint(v, line)
        if ENGINE_BUILD == "compiled":
            assert not gc.is_tracked(fp)


def _rows_view(rows: int, cols: int) -> View:
    return View(Store("t", rows * cols * 4, True, "UB", 0, 0, core="c"), 0, (rows, cols), (cols * 4, 4),
                np.dtype(np.float32))


@HYP
@given(rows=st.sampled_from([1, 2, MEMO_INTS - 1, MEMO_INTS, MEMO_INTS + 1, 200]),
       keys=st.lists(st.one_of(st.integers(-3, 210), st.sampled_from([1 << 64, -(1 << 64), 1 << 40])),
                     min_size=1, max_size=30))
def test_an_int_index_memoised_by_list_or_dict_is_the_fresh_child(rows, keys):
    """``View.__getitem__`` keeps a short dim 0's int-indexed children in a list, a long one's in its dict: either
    way the child of the general path, the same object when indexed again, and the same error past the end."""
    check_int_indices(_rows_view(rows, 3), _rows_view(rows, 3), keys)


@pytest.mark.parametrize("key", [1 << 64, -(1 << 70), (0, 1 << 64), (slice(0, 1 << 64), 0), slice(1 << 63, None),
                                 (Ellipsis, 1 << 64)])
def test_an_index_past_any_c_integer_is_an_address_error(key):
    """Compiled, such an index overflows the C integers of the slicing path; it is out of range like any other."""
    with pytest.raises(AddressError, match="out of range"):
        _rows_view(4, 3)[key]


@kernel(cores="aic")
def _checks(ctx, steps, got):
    """Per step, ``ctx._local`` on a slice of one of the AIC's spaces at an element offset: ``got`` records whether
    it refused the alignment, and whether it should have (the space's alignment from the profile's table)."""
    tiles = {"L1": ctx.l1.alloc((256,), "fp32"), "L0A": ctx.l0a.alloc((256,), "fp32"),
             "L0B": ctx.l0b.alloc((256,), "fp32"), "L0C": ctx.l0c.alloc((256,), "fp32")}
    for space, off in steps:
        v = tiles[space][off:off + 8]
        try:
            ctx._local(v, (space,), "x")
            refused = False
        except AlignmentError:
            refused = True
        got.append((refused, (v.store.base + v.offset) % ctx._align_of[space] != 0))
    yield ctx.pipe_barrier()


@HYP
@given(steps=st.lists(st.tuples(st.sampled_from(["L1", "L0A", "L0B", "L0C"]), st.integers(0, 64)), min_size=1,
                      max_size=20))
def test_each_space_is_checked_against_its_own_alignment(steps):
    """``KernelContext._space_align`` answers the last space's alignment by identity before its table: whatever
    order the spaces come in, each operand is checked against its own space's."""
    pod = Pod(cloudmatrix384(dies=1))
    got: list = []
    pod.launch(_checks, aic=1, args=(tuple(steps), got))
    assert len(got) == len(steps) and all(refused == want for refused, want in got)
