"""Waiting polls found by address (ascend_emu/polls.py, issue 19): a landing checks only the polls it overlaps, each
distinct poll once, and satisfied polls resume in the order they started waiting."""
import numpy as np
from hypothesis import given, settings, strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.polls import GRAIN, SPAN, Polls
from ascend_emu.views import Store, View


def _Store(uid, nbytes):
    return Store("s", nbytes, False, "GM", 0, 0, uid=uid)


class _Poll:
    """A stand-in wait_gm on ``words`` int32 words of a store from word ``w0``."""

    def __init__(self, store, w0, words, value, name):
        self.srcs = (View(store, 4 * w0, (words,), (4,), np.dtype(np.int32)),)
        self.p = {"value": np.asarray(value, np.int32), "cmp": "eq", "how": "all"}
        self.name = name


def test_a_landing_checks_each_overlapping_distinct_poll_once():
    store = _Store(1, 4096)
    polls = Polls()
    same = [_Poll(store, 0, 1, 1, f"same{i}") for i in range(5)]          # five cores on one word
    other = [_Poll(store, 100 + i, 1, 1, f"other{i}") for i in range(40)]  # one core each on its own word
    for p in same + other:
        polls.add(p)
    checked = []

    def check(ins):
        checked.append(ins.name)
        return True
    done = polls.landed(1, 400, 404, check)                 # word 100
    assert checked == ["other0"] and [p.name for p in done] == ["other0"]
    checked.clear()
    done = polls.landed(1, 0, 4, check)                     # word 0: one check for the five
    assert checked == ["same0"] and [p.name for p in done] == [f"same{i}" for i in range(5)]
    assert polls.landed(1, 0, 4, check) is None and len(polls) == 39
    assert polls.landed(2, 0, 4, check) is None              # another store


@settings(max_examples=40, deadline=None)
@given(polls=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 80)), min_size=1, max_size=12),
       landing=st.tuples(st.integers(0, 600), st.integers(1, 3000)), seed=st.integers(0, 2 ** 16))
def test_landings_complete_what_a_scan_of_every_poll_would_in_waiting_order(polls, landing, seed):
    """Against the plain rule: every poll whose words the landing overlaps and whose condition holds completes, in
    the order the polls started waiting (wide polls, over SPAN blocks, included)."""
    rng = np.random.default_rng(seed)
    store = _Store(7, 4 * 4096)
    index = Polls()
    waiting = []
    for i, (w0, words) in enumerate(polls):
        words = words * (SPAN * GRAIN // 4 // 40 + 1) if rng.random() < 0.2 else words     # some wide ones
        p = _Poll(store, w0, min(words, 4096 - w0), int(rng.integers(0, 2)), f"p{i}")
        index.add(p)
        waiting.append(p)
    ok = {p.name: bool(p.p["value"]) for p in waiting}
    lo = 4 * landing[0]
    hi = min(lo + landing[1], store.nbytes)
    done = index.landed(7, lo, hi, lambda ins: ok[ins.name]) or []
    want = [p.name for p in waiting if p.srcs[0].lo < hi and lo < p.srcs[0].hi and ok[p.name]]
    assert [p.name for p in done] == want
    assert len(index) == len(waiting) - len(want)


@kernel(cores="aiv")
def _count_up(ctx, counters, flags, rounds):
    """Core 0 bumps every core's counter word ``rounds`` times; every core waits for its own word to reach
    ``rounds``, then raises its flag; core 0 waits for all the flags."""
    me = ctx.block_idx
    if me == 0:
        one = ctx.ub.alloc((8,), "int32", phantom=False)
        yield ctx.vec.duplicate(one, 1)
        for _ in range(rounds):
            for c in range(ctx.block_num):
                yield ctx.copy_ub_to_gm(counters[c:c + 1], one[0:1], atomic="add", pad=True)
    yield ctx.wait_gm(counters[me:me + 1], "ge", rounds)
    yield ctx.gm_store(flags[me:me + 1], 1)
    if me == 0:
        yield ctx.wait_gm(flags, "eq", 1)


def test_many_cores_polling_distinct_words_all_resume():
    pod = Pod(cloudmatrix384(dies=1))
    counters = pod.alloc(0, (48,), "int32")
    flags = pod.alloc(0, (48,), "int32")
    run = pod.launch(_count_up, aiv=48, args=(counters, flags, 3))
    assert np.array_equal(counters.numpy(), np.full(48, 3)) and np.array_equal(flags.numpy(), np.ones(48))
    assert not pod.engine.polls.stores and run.modeled_us > 0


def test_remove_and_drop_take_polls_out_of_their_groups_and_the_index():
    store = _Store(3, 4096)
    polls = Polls()
    a, b = _Poll(store, 0, 1, 1, "a"), _Poll(store, 0, 1, 1, "b")       # one group
    nan = _Poll(store, 8, 1, 0, "nan")
    nan.srcs = (View(store, 32, (1,), (4,), np.dtype(np.float32)),)
    nan.p = {"value": np.asarray(np.nan, np.float32), "cmp": "eq", "how": "all"}   # a key unequal to itself
    far = _Poll(store, 64, 1, 1, "far")
    for p in (a, b, nan, far):
        polls.add(p)
    assert len(polls) == 4
    assert polls.remove(a) and not polls.remove(a) and len(polls) == 3
    assert polls.remove(nan) and not polls.remove(nan) and len(polls) == 2
    assert polls.landed(3, 32, 36, lambda ins: True) is None           # nan's word: its group is gone
    polls.drop(lambda ins: ins.name == "far")
    assert len(polls) == 1
    assert polls.landed(3, 256, 260, lambda ins: True) is None         # far's word: gone from the index
    assert [p.name for p in polls.landed(3, 0, 4, lambda ins: True)] == ["b"]
    assert len(polls) == 0 and polls.stores == {}
