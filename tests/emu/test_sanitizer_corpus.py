"""A corpus of deliberately broken far-memory protocols, one per check of the race sanitizer: each is caught with the
right kind on the profile's own latencies and under every jitter seed, and its fixed twin is clean and gives the
same bits under every seed. Then three racy variants whose wrong output shows only under some seeds: the sanitizer
catches them under every seed, wrong output or not.

Dies 0 and 1 are the two dies of one chip (the die-to-die link); tiles are 8 x 64 fp32 (2 KiB)."""
from __future__ import annotations

import numpy as np
import pytest

from ascend_emu import cloudmatrix384, explore, kernel

SEEDS = range(20)
ROWS, COLS = 8, 64
DATA = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1


def caught(scenario, kind, dies: int = 2):
    """Every run (the baseline and each seed) reports ``kind`` (or one of a tuple of kinds)."""
    report = explore(scenario, seeds=SEEDS, profile=cloudmatrix384(dies=dies))
    wanted = {kind} if isinstance(kind, str) else set(kind)
    for run in report.runs:
        kinds = {r.kind for r in run.races}
        assert wanted & kinds, (run.seed, run.error, [str(r) for r in run.races])
    return report


def clean(scenario, dies: int = 2):
    report = explore(scenario, seeds=SEEDS, profile=cloudmatrix384(dies=dies))
    assert report.ok, report.summary()
    return report


def checked(scenario_of, kind: str, dies: int = 2):
    """The broken variant is caught as ``kind``; the fixed one is clean."""
    caught(scenario_of(True), kind, dies)
    clean(scenario_of(False), dies)


# ------------------------------------------------------------------------------------------------ producer / consumer
@kernel(cores="aiv")
def handoff(ctx, src, dst, flag, wait: bool, after, delay: int):
    """Die 0 copies ``src`` into ``dst`` (on die 1) and raises ``flag`` (on die 1) ``after`` the copy; die 1 waits for
    the flag (or, ``wait=False``, ``delay`` scalar cycles), then doubles what arrived in place."""
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    if ctx.die == 0:
        yield ctx.copy_gm_to_ub(t, src)
        yield ctx.copy_ub_to_gm(dst, t)
        yield ctx.scalar(delay)
        yield ctx.gm_store(flag, 1, after=after)
    else:
        if wait:
            yield ctx.wait_gm(flag, "eq", 1)
        else:
            yield ctx.scalar(delay)
        yield ctx.copy_gm_to_ub(t, dst)
        yield ctx.vec.muls(t, t, 2.0)
        yield ctx.copy_ub_to_gm(dst, t)


def handoff_scenario(wait=True, after="MTE3", delay=0):
    def scenario(pod):
        src = pod.to_gm(0, DATA)
        dst = pod.to_gm(1, np.zeros_like(DATA))
        flag = pod.alloc(1, (8,), "int32")
        pod.launch(handoff, dies=[0, 1], aiv=1, args=(src, dst, flag[0:1], wait, after, delay))
        return dst.numpy()
    return scenario


def test_missing_flag_wait_is_an_unpublished_read():
    checked(lambda broken: handoff_scenario(wait=not broken, delay=4000), "unpublished-read")


def test_flag_without_after_is_flag_misuse():
    report = caught(handoff_scenario(after=None), "flag-misuse")
    assert "after='MTE3'" in report.runs[0].races[0].missing
    clean(handoff_scenario(after="MTE3"))


# ------------------------------------------------------------------------------------------------ writers
@kernel(cores="aiv")
def two_writers(ctx, src, out, shared: bool):
    """Two cores each write a tile: into the same rows (``shared``) or each into its own."""
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    yield ctx.copy_gm_to_ub(t, src)
    yield ctx.vec.adds(t, t, float(ctx.block_idx))
    row = 0 if shared else ctx.block_idx * ROWS
    yield ctx.copy_ub_to_gm(out[row:row + ROWS], t)


def test_two_cores_writing_the_same_rows_race():
    def scenario_of(broken):
        def scenario(pod):
            out = pod.to_gm(0, np.zeros((2 * ROWS, COLS), np.float32))
            pod.launch(two_writers, die=0, aiv=2, args=(pod.to_gm(0, DATA), out, broken))
            return out.numpy()
        return scenario
    checked(scenario_of, "data-race")


@kernel(cores="aiv")
def shared_window_dispatch(ctx, xs, win, flags, per_rank_offset: bool):
    """Each rank sends its tokens into rank 0's window and raises its flag there; rank 0 waits for both flags and
    reads the window. The window must be partitioned by source rank; the broken variant has both write at row 0."""
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    yield ctx.copy_gm_to_ub(t, xs[ctx.rank])
    row = ctx.rank * ROWS if per_rank_offset else 0
    yield ctx.copy_ub_to_gm(win[row:row + ROWS], t)
    yield ctx.gm_store(flags[ctx.rank:ctx.rank + 1], 1, after="MTE3")
    if ctx.rank == 0:
        yield ctx.wait_gm(flags, "eq", 1)
        r = ctx.ub.alloc((2 * ROWS, COLS), "fp32")
        yield ctx.copy_gm_to_ub(r, win)
        yield ctx.vec.muls(r, r, 3.0)
        yield ctx.copy_ub_to_gm(win, r)


def test_shared_window_dispatch_races():
    def scenario_of(broken):
        def scenario(pod):
            xs = [pod.to_gm(d, DATA + 100 * d) for d in (0, 1)]
            win = pod.to_gm(0, np.zeros((2 * ROWS, COLS), np.float32))
            flags = pod.alloc(0, (8,), "int32")
            pod.launch(shared_window_dispatch, dies=[0, 1], aiv=1, args=(xs, win, flags[0:2], not broken))
            return win.numpy()
        return scenario
    checked(scenario_of, "data-race")


@kernel(cores="aiv")
def counter_bump(ctx, counter, atomic: bool):
    """Every core adds 1 to a shared counter: an atomic, or a load and a store (lost updates)."""
    if atomic:
        yield ctx.atomic_add(counter, 1)
    else:
        v = yield ctx.gm_load(counter)
        yield ctx.gm_store(counter, int(np.asarray(v).reshape(-1)[0]) + 1)


def test_cas_less_counter_races():
    def scenario_of(broken):
        def scenario(pod):
            counter = pod.alloc(0, (8,), "int32")
            pod.launch(counter_bump, die=0, aiv=4, args=(counter[0:1], not broken))
            return counter.numpy()
        return scenario
    checked(scenario_of, "data-race")


# ------------------------------------------------------------------------------------------------ barriers, counters
@kernel(cores="aiv")
def exchange_halves(ctx, src, buf, out, barrier: bool):
    """Core i writes its half of ``buf``; after a barrier each core reads the other's half."""
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    me = ctx.block_idx
    yield ctx.copy_gm_to_ub(t, src)
    yield ctx.vec.adds(t, t, float(me))
    yield ctx.copy_ub_to_gm(buf[me * ROWS:(me + 1) * ROWS], t)
    if barrier:
        yield ctx.barrier()
    else:
        yield ctx.scalar(3000)
    other = 1 - me
    yield ctx.copy_gm_to_ub(t, buf[other * ROWS:(other + 1) * ROWS])
    yield ctx.copy_ub_to_gm(out[me * ROWS:(me + 1) * ROWS], t)


def test_missing_barrier_is_an_unpublished_read():
    def scenario_of(broken):
        def scenario(pod):
            buf = pod.alloc(0, (2 * ROWS, COLS), "fp32")
            out = pod.alloc(0, (2 * ROWS, COLS), "fp32")
            pod.launch(exchange_halves, die=0, aiv=2, args=(pod.to_gm(0, DATA), buf, out, not broken))
            return out.numpy()
        return scenario
    checked(scenario_of, "unpublished-read")


@kernel(cores="aiv")
def count_then_read(ctx, src, buf, counter, out, after):
    """Every core writes its tile into ``buf`` and counts itself done (``atomic_add ... after``); core 0 waits for
    the count and sums the tiles."""
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    me, n = ctx.block_idx, ctx.block_num
    yield ctx.copy_gm_to_ub(t, src)
    yield ctx.vec.adds(t, t, float(me))
    yield ctx.copy_ub_to_gm(buf[me], t)
    yield ctx.atomic_add(counter, 1, after=after)
    if me == 0:
        yield ctx.wait_gm(counter, "eq", n)
        acc = ctx.ub.alloc((ROWS, COLS), "fp32")
        yield ctx.vec.duplicate(acc, 0.0)
        for i in range(n):
            yield ctx.copy_gm_to_ub(t, buf[i])
            yield ctx.vec.add(acc, acc, t)
        yield ctx.copy_ub_to_gm(out, acc)


def test_counter_without_after_is_flag_misuse():
    def scenario_of(broken):
        def scenario(pod):
            buf = pod.alloc(0, (4, ROWS, COLS), "fp32")
            out = pod.alloc(0, (ROWS, COLS), "fp32")
            counter = pod.alloc(0, (8,), "int32")
            pod.launch(count_then_read, die=0, aiv=4,
                       args=(pod.to_gm(0, DATA), buf, counter[0:1], out, None if broken else "all"))
            return out.numpy()
        return scenario
    checked(scenario_of, "flag-misuse")


# ------------------------------------------------------------------------------------------------ cross-core flags
@kernel(cores="mix")
def aiv_to_aic(ctx, src, buf, out, after, waits: int):
    """Each AIV writes its tile to GM and sets cross-core flag 1 toward its AIC (``after``); the AIC waits
    ``waits`` times and copies both tiles through L1."""
    if ctx.is_aiv:
        t = ctx.ub.alloc((ROWS, COLS), "fp32")
        yield ctx.copy_gm_to_ub(t, src)
        yield ctx.vec.adds(t, t, float(ctx.sub_block_idx))
        yield ctx.copy_ub_to_gm(buf[ctx.sub_block_idx], t)
        yield ctx.cross_core_set(1, after=after)
        if waits == 0:
            yield ctx.cross_core_set(1, after=after)
    else:
        for _ in range(max(waits, 1)):
            yield ctx.cross_core_wait(1)
        l1 = ctx.l1.alloc((2, ROWS, COLS), "fp32")
        yield ctx.copy_gm_to_l1(l1, buf)
        yield ctx.pipe_barrier()


def _mix_scenario(after="MTE3", waits=1):
    def scenario(pod):
        buf = pod.alloc(0, (2, ROWS, COLS), "fp32")
        pod.launch(aiv_to_aic, die=0, aic=1, args=(pod.to_gm(0, DATA), buf, None, after, waits))
        return buf.numpy()
    return scenario


def test_cross_core_flag_after_the_wrong_pipe_is_flag_misuse():
    caught(_mix_scenario(after="MTE2"), "flag-misuse")
    clean(_mix_scenario(after="MTE3"))


def test_cross_core_flag_set_twice_and_waited_once_is_unpaired():
    report = caught(_mix_scenario(waits=0), "flag-misuse")
    assert any("never waited" in r.missing or "consumed" in r.missing for r in report.runs[0].races)
    clean(_mix_scenario(waits=1))


# ------------------------------------------------------------------------------------------------ rings
@kernel(cores="aiv")
def one_slot_ring(ctx, items, slot, full, ack, out, back_pressure: bool, ack_after, delay: int):
    """A one-slot ring from die 0 to die 1: the producer fills the slot and raises ``full`` = item number; the
    consumer copies it out and acknowledges (``ack`` = item number, ``ack_after`` its read). The producer must wait
    for the acknowledgement before refilling the slot (``back_pressure``); the broken variant waits ``delay``
    scalar cycles instead (by 20k cycles the consumer has always read the slot, but nothing guarantees it)."""
    t = ctx.ub.alloc((2, ROWS, COLS), "fp32")
    n = items.shape[0]
    for i in range(n):
        b = i % 2
        if ctx.die == 0:
            if i:
                yield ctx.wait_gm(ack, "ge", i) if back_pressure else ctx.scalar(delay)
            yield ctx.copy_gm_to_ub(t[b], items[i])
            yield ctx.copy_ub_to_gm(slot, t[b])
            yield ctx.gm_store(full, i + 1, after="MTE3")
        else:
            yield ctx.wait_gm(full, "ge", i + 1)
            yield ctx.copy_gm_to_ub(t[b], slot)
            yield ctx.copy_ub_to_gm(out[i], t[b])
            yield ctx.gm_store(ack, i + 1, after=ack_after)


def ring_scenario(back_pressure=True, ack_after="MTE2", delay=20_000):
    def scenario(pod):
        items = pod.to_gm(0, np.stack([DATA * (i + 1) for i in range(3)]))
        slot = pod.to_gm(1, np.zeros_like(DATA))
        flags = pod.alloc(1, (8,), "int32")
        ack = pod.alloc(0, (8,), "int32")
        out = pod.alloc(1, (3, ROWS, COLS), "fp32")
        pod.launch(one_slot_ring, dies=[0, 1], aiv=1,
                   args=(items, slot, flags[0:1], ack[0:1], out, back_pressure, ack_after, delay))
        return out.numpy()
    return scenario


def test_reused_ring_slot_is_slot_reuse():
    caught(ring_scenario(back_pressure=False), "slot-reuse")
    clean(ring_scenario())


def test_acknowledgement_without_after_is_slot_reuse():
    report = caught(ring_scenario(ack_after=None), "slot-reuse")
    assert "after='MTE2'" in next(r for r in report.runs[0].races if r.kind == "slot-reuse").missing
    clean(ring_scenario(ack_after="MTE2"))


# ------------------------------------------------------------------------------------------------ uninitialised data
@kernel(cores="aiv")
def row_sums(ctx, src, out, zero_first: bool):
    """out[r] = sum of the 8 rows of ``src`` accumulated in UB; the accumulator must start at zero."""
    acc = ctx.ub.alloc((COLS,), "fp32")
    t = ctx.ub.alloc((ROWS, COLS), "fp32")
    if zero_first:
        yield ctx.vec.duplicate(acc, 0.0)
    yield ctx.copy_gm_to_ub(t, src)
    for r in range(ROWS):
        yield ctx.vec.add(acc, acc, t[r])
    yield ctx.copy_ub_to_gm(out, acc)


def test_uninitialised_accumulator():
    def scenario_of(broken):
        def scenario(pod):
            out = pod.alloc(0, (COLS,), "fp32")
            pod.launch(row_sums, die=0, aiv=1, args=(pod.to_gm(0, DATA), out, not broken))
            return out.numpy()
        return scenario
    report = caught(scenario_of(True), "uninitialized-read")
    assert report.runs[0].races[0].second.tensor.endswith("(UB)")
    clean(scenario_of(False))


def test_read_of_gm_nothing_wrote():
    """The host allocated the input and never filled it (``pod.alloc`` instead of ``pod.to_gm``)."""
    def scenario_of(broken):
        def scenario(pod):
            src = pod.alloc(0, (ROWS, COLS), "fp32") if broken else pod.to_gm(0, DATA)
            out = pod.alloc(0, (COLS,), "fp32")
            pod.launch(row_sums, die=0, aiv=1, args=(src, out, True))
            return out.numpy()
        return scenario
    checked(scenario_of, "uninitialized-read")


@kernel(cores="aic")
def cube_accumulate(ctx, a, b, c, first_accumulates: bool):
    """c = a @ b over two K halves accumulated in L0C; the first mmad must not accumulate into a fresh L0C."""
    l1a = ctx.l1.alloc((16, 32), "fp16")
    l1b = ctx.l1.alloc((32, 16), "fp16")
    yield ctx.copy_gm_to_l1(l1a, a)
    yield ctx.copy_gm_to_l1(l1b, b)
    l0a = ctx.l0a.alloc((2, 16, 16), "fp16")
    l0b = ctx.l0b.alloc((2, 16, 16), "fp16")
    l0c = ctx.l0c.alloc((16, 16), "fp32")
    for k in range(2):
        yield ctx.copy_l1_to_l0a(l0a[k], l1a[:, k * 16:(k + 1) * 16])
        yield ctx.copy_l1_to_l0b(l0b[k], l1b[k * 16:(k + 1) * 16])
        yield ctx.mmad(l0c, l0a[k], l0b[k], accumulate=k > 0 or first_accumulates)
    yield ctx.copy_l0c_to_gm(c, l0c)


def test_mmad_accumulating_into_a_fresh_l0c():
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, (16, 32)).astype(np.float16)
    b = rng.integers(-3, 4, (32, 16)).astype(np.float16)

    def scenario_of(broken):
        def scenario(pod):
            c = pod.alloc(0, (16, 16), "fp32")
            pod.launch(cube_accumulate, die=0, aic=1, args=(pod.to_gm(0, a), pod.to_gm(0, b), c, broken))
            return c.numpy()
        return scenario
    caught(scenario_of(True), "uninitialized-read", dies=1)
    clean(scenario_of(False), dies=1)


# ------------------------------------------------------------------------------------------------ racy by timing
ITEMS = np.stack([DATA * (i + 1) for i in range(3)])
RACY = {   # scenario of a delay (scalar cycles), the right output, the kind the sanitizer reports
    "a delay instead of the flag wait": (lambda d: handoff_scenario(wait=False, delay=d), 2 * DATA,
                                         "unpublished-read"),
    "a flag without after= issued late": (lambda d: handoff_scenario(after=None, delay=d), 2 * DATA, "flag-misuse"),
    # a refill that lands before the consumer read the item before it makes the consumer read the next item
    # unpublished (its flag is not raised yet); one that lands after the read is the slot reused under the reader
    "a slot refilled after a delay": (lambda d: ring_scenario(back_pressure=False, delay=d), ITEMS,
                                      ("slot-reuse", "unpublished-read")),
}


def _shortest_right_delay(scenario_of, expected) -> int:
    """The shortest delay (in steps of 125 cycles) with which the broken protocol gets it right on the profile's
    own latencies: there it is right by a hair, so jitter makes it wrong under some seeds."""
    from ascend_emu import Pod
    for d in range(0, 20_000, 125):
        if np.array_equal(scenario_of(d)(Pod(cloudmatrix384(dies=2), trace=False)), expected):
            return d
    raise AssertionError("no delay makes the protocol right")


@pytest.mark.parametrize("name", sorted(RACY))
def test_racy_output_under_some_seeds_is_caught_under_all(name):
    scenario_of, expected, kind = RACY[name]
    report = caught(scenario_of(_shortest_right_delay(scenario_of, expected)), kind)
    wrong = {d.seed for d in report.differences}           # the baseline is right: these seeds got it wrong
    assert 0 < len(wrong) < len(SEEDS), wrong
