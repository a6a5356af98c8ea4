"""Synchronisation semantics: ordering of flags and data, atomics, barriers, cross-core flags, deadlock detection,
streams and persistent kernels. Times are modeled (deterministic), so the tests assert on exact orderings."""
from __future__ import annotations

import numpy as np
import pytest

from ascend_emu import DeadlockError, HazardError, Pod, cloudmatrix384, kernel
from ascend_emu.errors import ArgumentError

PROF = cloudmatrix384(dies=2)
US_PER_CYCLE = 1 / (PROF.clock_ghz * 1000)


def cycles(us: float) -> int:
    return int(round(us / US_PER_CYCLE))


# ---------------------------------------------------------------------------------------------- flag after data
@kernel(cores="aiv")
def producer_consumer(ctx, src, data, flag, out, order):
    """rank 0 (die 0) pushes 64 KiB into die 1's GM then raises a flag there; rank 1 (die 1) waits for the flag
    and reads the data."""
    t = ctx.ub.alloc(src.shape, src.dtype)
    if ctx.rank == 0:
        yield ctx.copy_gm_to_ub(t, src)
        yield ctx.copy_ub_to_gm(data, t)                  # remote write, lands at its end time
        if order == "after":
            yield ctx.gm_store(flag, 1, after="MTE3")     # waits until the MTE3 write is visible
        elif order == "pipe_barrier":
            yield ctx.pipe_barrier()
            yield ctx.gm_store(flag, 1)
        else:
            yield ctx.gm_store(flag, 1)                   # posted at once: races the data
    else:
        yield ctx.wait_gm(flag, "eq", 1)
        yield ctx.copy_gm_to_ub(t, data)
        yield ctx.copy_ub_to_gm(out, t)


def run_producer_consumer(order):
    pod = Pod(cloudmatrix384(dies=2))
    values = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) + 1
    src = pod.to_gm(0, values)
    data = pod.alloc(1, (128, 128), "fp32", name="data")
    flag = pod.alloc(1, (1,), "int32", name="flag")
    out = pod.alloc(1, (128, 128), "fp32", name="out")
    run = pod.launch(producer_consumer, dies=[0, 1], aiv=1, args=(src, data, flag, out, order))
    return values, out.numpy(), run


@pytest.mark.parametrize("order", ["after", "pipe_barrier"])
def test_ordered_flag_publishes_data(order):
    values, seen, _ = run_producer_consumer(order)
    assert np.array_equal(seen, values)


def test_unordered_flag_overtakes_remote_data():
    """The real-hardware race: a scalar flag store posted right after a big remote copy lands first, so the
    consumer reads the stale (zero) buffer."""
    values, seen, unordered = run_producer_consumer("none")
    assert (seen == 0).all()
    _, _, ordered = run_producer_consumer("after")
    assert unordered.modeled_us < ordered.modeled_us     # ordering costs the copy's flight time


@kernel(cores="aiv")
def two_pipe_producer(ctx, src, big, small, flag, out_big, out_small, after):
    """rank 0 moves a 4 MiB block to die 1 by DMA and a small one by the mtu, then raises one flag; rank 1 reads
    both behind the flag."""
    t = ctx.ub.alloc(small.shape, small.dtype)
    if ctx.rank == 0:
        yield ctx.dma_copy(big, src)
        yield ctx.copy_gm_to_ub(t, src[:small.shape[0]])
        yield ctx.copy_ub_to_gm(small, t)
        yield ctx.gm_store(flag, 1, after=after)
    else:
        yield ctx.wait_gm(flag, "eq", 1)
        yield ctx.dma_copy(out_big, big)
        yield ctx.copy_gm_to_ub(t, small)
        yield ctx.copy_ub_to_gm(out_small, t)


@pytest.mark.parametrize("after", [("DMA", "MTE3"), "MTE3"])
def test_flag_after_several_pipes_waits_for_each(after):
    pod = Pod(cloudmatrix384(dies=2))
    values = np.arange(8192 * 128, dtype=np.float32).reshape(8192, 128) + 1
    src = pod.to_gm(0, values)
    big = pod.alloc(1, values.shape, "fp32", name="big")
    small = pod.alloc(1, (8, 128), "fp32", name="small")
    flag = pod.alloc(1, (1,), "int32", name="flag")
    out_big = pod.alloc(1, values.shape, "fp32", name="out_big")
    out_small = pod.alloc(1, small.shape, "fp32", name="out_small")
    pod.launch(two_pipe_producer, dies=[0, 1], aiv=1, args=(src, big, small, flag, out_big, out_small, after))
    assert np.array_equal(out_small.numpy(), values[:8])           # the mtu write is ordered either way
    if after == "MTE3":                                            # the DMA (4 MiB at 196 GB/s) is still in flight
        assert (out_big.numpy() == 0).all()
    else:
        assert np.array_equal(out_big.numpy(), values)


@kernel(cores="aiv")
def far_then_near(ctx, src, far, near, flag, out, how):
    """aiv 0 writes 64 KiB to a die on another server, then 32 bytes to its own die, on one MTE3 pipe, then
    publishes a flag on its own die; aiv 1 (same die) waits for the flag and reads the far data."""
    t = ctx.ub.alloc(src.shape, src.dtype)
    if ctx.block_idx == 0:
        yield ctx.copy_gm_to_ub(t, src)
        yield ctx.copy_ub_to_gm(far, t)                   # long remote write: lands a fabric latency later
        yield ctx.copy_ub_to_gm(near, t[0, :8])           # short local write: lands before the remote one
        if how == "gm_store":
            yield ctx.gm_store(flag, 1, after="MTE3")
        elif how == "tuple":
            yield ctx.gm_store(flag, 1, after=("MTE2", "MTE3"))
        else:
            yield ctx.atomic_add(flag, 1, after="MTE3")
    else:
        yield ctx.wait_gm(flag, "eq", 1)
        yield ctx.copy_gm_to_ub(t, far)
        yield ctx.copy_ub_to_gm(out, t)


@pytest.mark.parametrize("how", ["gm_store", "tuple", "atomic_add"])
def test_flag_after_a_pipe_waits_for_every_earlier_write_of_it(how):
    """after="MTE3" orders every earlier MTE3 write, not only the last one: the last (local) write lands before
    the first (remote) one, and a flag ordered only after it would let the reader see stale data."""
    pod = Pod(cloudmatrix384(dies=17))
    assert pod.profile.server_of(16) != pod.profile.server_of(0)
    values = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) + 1
    src = pod.to_gm(0, values)
    far = pod.alloc(16, values.shape, "fp32", name="far")
    near = pod.alloc(0, (8,), "fp32", name="near")
    flag = pod.alloc(0, (1,), "int32", name="flag")
    out = pod.alloc(0, values.shape, "fp32", name="out")
    pod.launch(far_then_near, aiv=2, args=(src, far, near, flag, out, how))
    assert np.array_equal(out.numpy(), values)


@pytest.mark.parametrize("after", ["V", ("MTE3", "S"), (), 3])
def test_flag_after_names_the_pipes_it_accepts(after):
    pod = Pod(cloudmatrix384(dies=1))
    flag = pod.alloc(0, (1,), "int32")

    @kernel(cores="aiv")
    def k(ctx):
        yield ctx.gm_store(flag, 1, after=after)
    with pytest.raises(ArgumentError, match=r"gm_store: after=.*MTE3.*DMA"):
        pod.launch(k, aiv=1)


# ---------------------------------------------------------------------------------------------- atomics
@pytest.mark.parametrize("dies", [[0], [0, 1]], ids=["one-die", "two-dies"])
def test_atomic_add_from_every_aiv(dies):
    olds = []

    @kernel(cores="aiv")
    def count(ctx, counter, total):
        old = yield ctx.atomic_add(counter, 1)
        olds.append(old)
        yield ctx.atomic_add(total, 0.5)

    pod = Pod(cloudmatrix384(dies=2))
    counter = pod.alloc(1, (1,), "int32", name="counter")      # remote for die 0's cores
    total = pod.alloc(1, (1,), "fp32", name="total")
    pod.launch(count, dies=dies, aiv=48, args=(counter, total))
    n = 48 * len(dies)
    assert counter.numpy()[0] == n
    assert sorted(olds) == list(range(n))
    assert total.numpy()[0] == 0.5 * n


@kernel(cores="aiv")
def critical_section(ctx, lock, counter, reads, use_lock):
    if use_lock:
        while True:
            old = yield ctx.atomic_cas(lock, 0, 1)
            if old == 0:
                break
            yield ctx.wait_gm(lock, "eq", 0)
    v = yield ctx.gm_load(counter)
    reads.append(int(v[0]))
    yield ctx.scalar(200)                                          # work inside the critical section
    yield ctx.gm_store(counter, int(v[0]) + 1)
    if use_lock:
        yield ctx.gm_store(lock, 0, after="all")                   # release once the counter store is visible


@pytest.mark.parametrize("use_lock", [True, False], ids=["cas-lock", "no-lock"])
def test_atomic_cas_spin_lock(use_lock):
    pod = Pod(cloudmatrix384(dies=2))
    lock = pod.alloc(0, (1,), "int32", name="lock")
    counter = pod.alloc(0, (1,), "int32", name="counter")
    reads = []
    pod.launch(critical_section, dies=[0, 1], aiv=6, args=(lock, counter, reads, use_lock))
    if use_lock:
        assert sorted(reads) == list(range(12))                    # every core saw its predecessor's increment
        assert counter.numpy()[0] == 12
        assert lock.numpy()[0] == 0
    else:                                                          # the race the lock prevents
        assert counter.numpy()[0] < 12
        assert len(set(reads)) < 12


def test_ticket_lock_serves_in_ticket_order():
    entries = []

    @kernel(cores="aiv")
    def ticket(ctx, next_ticket, serving, counter):
        my = yield ctx.atomic_add(next_ticket, 1)
        yield ctx.wait_gm(serving, "eq", my)
        v = yield ctx.gm_load(counter)
        entries.append((ctx.now_us, my, int(v[0])))
        yield ctx.gm_store(counter, int(v[0]) + 1)
        yield ctx.gm_store(serving, my + 1, after="all")

    pod = Pod(cloudmatrix384(dies=1))
    nt, sv, cnt = (pod.alloc(0, (1,), "int32", name=n) for n in ("next", "serving", "counter"))
    pod.launch(ticket, aiv=16, args=(nt, sv, cnt))
    entries.sort()
    assert [e[1] for e in entries] == list(range(16))              # entered in ticket order
    assert [e[2] for e in entries] == list(range(16))              # and saw every predecessor's store
    assert cnt.numpy()[0] == 16 and sv.numpy()[0] == 16


# ---------------------------------------------------------------------------------------------- barriers
@pytest.mark.parametrize("dies, aiv", [([0], 8), ([0, 1], 4)], ids=["one-die", "two-dies"])
def test_barrier_releases_nobody_before_the_last_arrives(dies, aiv):
    log = []

    @kernel(cores="aiv")
    def staggered(ctx):
        yield ctx.scalar(cycles(1.0) * (ctx.block_idx + 3 * ctx.rank))   # arrive at different times
        before = ctx.now_us
        yield ctx.barrier()
        log.append((ctx.die, ctx.block_idx, before, ctx.now_us))

    pod = Pod(cloudmatrix384(dies=2))
    pod.launch(staggered, dies=dies, aiv=aiv)
    assert len(log) == len(dies) * aiv
    before = [b for *_, b, _ in log]
    after = [a for *_, a in log]
    last = max(before)
    assert last - min(before) > 2.0                                 # the stagger is real
    barrier_us = PROF.barrier_ns / 1e3 + (2 * PROF.fabric_latency_ns / 1e3 if len(dies) > 1 else 0)
    assert min(after) >= last
    for a in after:
        assert a == pytest.approx(last + barrier_us, abs=1e-6)


@pytest.mark.parametrize("mover", ["MTE3", "DMA", "gm_store"])
@pytest.mark.parametrize("group", ["all", "die"])
def test_barrier_orders_the_cores_own_gm_writes(mover, group):
    """SyncAll starts with PipeBarrier<PIPE_ALL>: what a core wrote before the barrier has landed when any core
    leaves it, so a peer reading right after the barrier sees the new data without a pipe_barrier of its own."""
    @kernel(cores="aiv")
    def publish_then_read(ctx, src, far, out):
        t = ctx.ub.alloc(src.shape, src.dtype)
        if ctx.block_idx == 0:
            if mover == "MTE3":
                yield ctx.copy_gm_to_ub(t, src)
                yield ctx.copy_ub_to_gm(far, t)           # lands a fabric latency after the pipe is free
            elif mover == "DMA":
                yield ctx.dma_copy(far, src)
            else:
                yield ctx.gm_store(far[0, :8], np.arange(1, 9, dtype=np.float32))
        yield ctx.barrier(group)
        if ctx.block_idx == 1:
            yield ctx.copy_gm_to_ub(t, far)
            yield ctx.copy_ub_to_gm(out, t)

    pod = Pod(cloudmatrix384(dies=17))
    values = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) + 1
    src = pod.to_gm(0, values)
    far = pod.alloc(16, values.shape, "fp32", name="far")
    out = pod.alloc(0, values.shape, "fp32", name="out")
    pod.launch(publish_then_read, aiv=2, args=(src, far, out))
    expect = values if mover != "gm_store" else np.pad(values[:1, :8], ((0, 127), (0, 120)))
    assert np.array_equal(out.numpy(), expect)


def test_aiv_barrier_in_a_mix_launch_leaves_the_aics_out():
    log = []

    @kernel(cores="mix")
    def aiv_only(ctx):
        if ctx.is_aiv:
            yield ctx.scalar(cycles(1.0) * (ctx.block_idx + 1))
            before = ctx.now_us
            yield ctx.barrier("aiv")
            log.append(("aiv", before, ctx.now_us))
        else:
            yield ctx.scalar(1)
            log.append(("aic", 0.0, ctx.now_us))

    Pod(cloudmatrix384(dies=1)).launch(aiv_only, aic=2)
    aiv = [x for x in log if x[0] == "aiv"]
    aic = [x for x in log if x[0] == "aic"]
    assert len(aiv) == 4 and len(aic) == 2
    last = max(b for _, b, _ in aiv)
    assert all(a == pytest.approx(last + PROF.barrier_ns / 1e3, abs=1e-6) for *_, a in aiv)
    assert all(a < PROF.launch_single_op_us + 0.01 for *_, a in aic)        # never held by the barrier


def test_a_core_reads_back_its_own_remote_write():
    """Per-core GM dependency tracking: a read of a range this core wrote waits for the write to land."""
    @kernel(cores="aiv")
    def write_then_read(ctx, y, out):
        t = ctx.ub.alloc((8, 64), "fp32")
        t2 = ctx.ub.alloc((8, 64), "fp32")
        yield ctx.vec.duplicate(t, 3.0)
        yield ctx.copy_ub_to_gm(y, t)                  # remote (die 1)
        yield ctx.copy_gm_to_ub(t2, y)                 # must see 3.0, not the zeros
        yield ctx.copy_ub_to_gm(out, t2)

    pod = Pod(cloudmatrix384(dies=2))
    y, out = pod.alloc(1, (8, 64), "fp32"), pod.alloc(0, (8, 64), "fp32")
    pod.launch(write_then_read, aiv=1, args=(y, out))
    assert (out.numpy() == 3.0).all()


# ---------------------------------------------------------------------------------------------- cross-core flags
def test_cross_core_flags_aic_to_both_aivs_and_back():
    log = {}

    @kernel(cores="mix")
    def handshake(ctx):
        if ctx.is_aic:
            yield ctx.scalar(cycles(2.0))
            log["aic_set"] = ctx.now_us
            yield ctx.cross_core_set(0)
            yield ctx.cross_core_wait(1)                  # needs both AIVs
            log["aic_woke"] = ctx.now_us
        else:
            yield ctx.cross_core_wait(0)
            log[f"aiv{ctx.sub_block_idx}_woke"] = ctx.now_us
            yield ctx.scalar(cycles(1.0 + 3.0 * ctx.sub_block_idx))
            log[f"aiv{ctx.sub_block_idx}_set"] = ctx.now_us
            yield ctx.cross_core_set(1)

    pod = Pod(cloudmatrix384(dies=1))
    pod.launch(handshake, aic=1)
    flag_us = PROF.flag_latency_ns / 1e3
    for sub in (0, 1):
        assert log[f"aiv{sub}_woke"] >= log["aic_set"] + flag_us
        assert log[f"aiv{sub}_woke"] < log["aic_set"] + flag_us + 0.01
    last_set = max(log["aiv0_set"], log["aiv1_set"])
    assert log["aiv1_set"] - log["aiv0_set"] > 2.9
    assert last_set + flag_us <= log["aic_woke"] < last_set + flag_us + 0.01     # waited for the slower AIV


def test_aic_wait_needs_both_aivs():
    @kernel(cores="mix")
    def one_sided(ctx):
        if ctx.is_aic:
            yield ctx.cross_core_wait(2)
        elif ctx.sub_block_idx == 0:
            yield ctx.cross_core_set(2)

    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(DeadlockError) as ei:
        pod.launch(one_sided, aic=1)
    assert "cross_core_wait flag 2" in str(ei.value)
    assert "die 0 aic 0" in str(ei.value)


@pytest.mark.parametrize("sets", [15, 16])
def test_cross_core_flag_counter_limit(sets):
    """Nobody waits: 15 pending sets fit the 4-bit counter, the 16th hangs real hardware -> HazardError."""
    @kernel(cores="mix")
    def overset(ctx, n):
        if ctx.is_aic:
            for _ in range(n):
                yield ctx.cross_core_set(3)
        else:
            yield ctx.scalar(1)

    pod = Pod(cloudmatrix384(dies=1))
    if sets <= 15:
        pod.launch(overset, aic=2, args=(sets,))
        return
    with pytest.raises(HazardError) as ei:
        pod.launch(overset, aic=2, args=(sets,))
    msg = str(ei.value)
    assert "16 times" in msg and "holds 15" in msg
    assert "flag 3" in msg and "die 0 aic 0" in msg


def test_cross_core_waits_consume_pending_sets():
    """15 sets, then the AIVs consume them one wait at a time: no hazard, every wait returns."""
    woke = []

    @kernel(cores="mix")
    def drain(ctx):
        if ctx.is_aic:
            for _ in range(15):
                yield ctx.cross_core_set(4)
        else:
            for _ in range(15):
                yield ctx.cross_core_wait(4)
            woke.append(ctx.sub_block_idx)

    Pod(cloudmatrix384(dies=1)).launch(drain, aic=1)
    assert sorted(woke) == [0, 1]


def test_cross_core_flag_limit_counts_sets_landing_before_a_later_wait():
    @kernel(cores="mix")
    def overset_then_wait(ctx):
        if ctx.is_aic:
            for _ in range(16):                            # all 16 land by ~0.1 us
                yield ctx.cross_core_set(3)
        else:
            yield ctx.scalar(cycles(5.0))                  # the waits only start at 5 us
            for _ in range(15):
                yield ctx.cross_core_wait(3)

    pod = Pod(cloudmatrix384(dies=1))
    try:
        pod.launch(overset_then_wait, aic=1)
    except HazardError as e:
        assert "16 times" in str(e)
    else:
        raise AssertionError("16 sets landed before any wait started, yet no HazardError")


def test_stream_order_holds_with_early_cross_core_sets():
    @kernel(cores="mix")
    def k(ctx):
        if ctx.is_aic:
            yield ctx.cross_core_set(0)
            yield ctx.cross_core_set(0)                    # one set stays pending
        elif ctx.sub_block_idx == 0:
            yield ctx.scalar(cycles(5.0))
            yield ctx.cross_core_wait(0)
        else:
            t = ctx.ub.alloc((64, 256), "fp32")
            for _ in range(200):                           # ~30 us of vector work
                yield ctx.vec.muls(t, t, 0.5)

    pod = Pod(cloudmatrix384(dies=1))
    s = pod.stream(0, aic=1)
    first = s.launch(k, name="first")
    s.launch(k, name="second")
    a, b = pod.synchronize().launches
    assert first.n_done == len(first.cores) == 3
    assert b.start_us >= a.end_us + PROF.launch_single_op_us - 1e-6


# ---------------------------------------------------------------------------------------------- deadlock detection
@kernel(cores="aiv")
def waits_forever(ctx, flag, timeout):
    yield ctx.wait_gm(flag, "eq", 1, timeout_us=timeout)


@pytest.mark.parametrize("timeout", [-1.0, None], ids=["default-bound", "unbounded"])
def test_unsatisfiable_wait_raises_deadlock_naming_core_tensor_condition(timeout):
    pod = Pod(cloudmatrix384(dies=2))
    flag = pod.alloc(1, (1,), "int32", name="ready_flag")
    with pytest.raises(DeadlockError) as ei:
        pod.launch(waits_forever, die=1, aiv=[5], args=(flag, timeout))
    msg = str(ei.value)
    assert "die 1 aiv 5" in msg
    assert "ready_flag" in msg and "eq 1" in msg and "now [0]" in msg
    assert "waits_forever" in msg
    assert len(ei.value.blocked) == 1
    if timeout is None:
        assert "no event can make progress" in msg


def test_barrier_a_core_never_reaches_raises_deadlock():
    @kernel(cores="aiv")
    def early_exit(ctx):
        if ctx.block_idx == 2:
            return                                         # this core skips the barrier
        yield ctx.barrier()

    pod = Pod(cloudmatrix384(dies=1))
    with pytest.raises(DeadlockError) as ei:
        pod.launch(early_exit, aiv=4)
    msg = str(ei.value)
    assert "barrier 'all' (3 of 4 cores arrived)" in msg
    assert len(ei.value.blocked) == 3


@pytest.mark.parametrize("writer", ["host", "kernel"])
@pytest.mark.parametrize("timeout_us", [5.0, 100.0])
def test_wait_timeout(writer, timeout_us):
    seen = []

    @kernel(cores="aiv")
    def late(ctx, flag):
        if ctx.block_idx == 0:
            v = yield ctx.wait_gm(flag, "eq", 7, timeout_us=timeout_us)
            seen.append((int(v[0]), ctx.now_us))
        elif writer == "kernel":
            yield ctx.scalar(cycles(50.0))                 # 50 us of work first
            yield ctx.gm_store(flag, 7)

    pod = Pod(cloudmatrix384(dies=1))
    flag = pod.alloc(0, (1,), "int32", name="late_flag")
    if writer == "host":
        pod.host_write(flag, 7, at_us=50.0 + PROF.launch_single_op_us)
    if timeout_us < 50:
        with pytest.raises(DeadlockError) as ei:
            pod.launch(late, aiv=2, args=(flag,))
        msg = str(ei.value)
        assert "wait bound exceeded" in msg and "late_flag" in msg and "eq 7" in msg
        assert "die 0 aiv 0" in msg
        t = float(msg.split("wait bound exceeded at ")[1].split(" us")[0])
        assert t == pytest.approx(PROF.launch_single_op_us + timeout_us, abs=0.1)
    else:
        pod.launch(late, aiv=2, args=(flag,))
        assert seen[0][0] == 7
        assert seen[0][1] >= PROF.launch_single_op_us + 50.0


# ---------------------------------------------------------------------------------------------- streams
@kernel(cores="aiv")
def busy_vector(ctx, n):
    t = ctx.ub.alloc((64, 256), "fp32")
    yield ctx.vec.duplicate(t, 1.0)
    for _ in range(n):
        yield ctx.vec.muls(t, t, 0.5)            # ~0.15 us each, local work only (no shared servers)


def test_streams_on_disjoint_cores_run_concurrently():
    pod = Pod(cloudmatrix384(dies=1))
    alone = pod.launch(busy_vector, aiv=range(8), args=(80,))
    pod = Pod(cloudmatrix384(dies=1))
    pod.stream(0, aiv=range(0, 8)).launch(busy_vector, (80,))
    pod.stream(0, aiv=range(8, 16)).launch(busy_vector, (80,))
    both = pod.synchronize()
    a, b = both.launches
    assert alone.kernel_us > 10
    assert a.start_us == b.start_us == PROF.launch_single_op_us
    assert both.kernel_us == pytest.approx(alone.kernel_us, rel=1e-9)        # max, not the sum
    assert both.modeled_us == pytest.approx(alone.modeled_us, rel=1e-9)


def test_launches_on_one_stream_run_in_order():
    pod = Pod(cloudmatrix384(dies=1))
    s = pod.stream(0, aiv=4)
    s.launch(busy_vector, (20,), name="first")
    s.launch(busy_vector, (5,), name="second")
    res = pod.synchronize()
    first, second = res.launches
    assert (first.name, second.name) == ("first", "second")
    assert second.start_us == pytest.approx(first.end_us + PROF.launch_single_op_us, abs=1e-6)
    assert first.duration_us > 3 * second.duration_us > 0
    g = pod.stream(0, aiv=4, mode="graph")
    g.launch(busy_vector, (5,), name="g1")
    g.launch(busy_vector, (5,), name="g2")
    g1, g2 = pod.synchronize().launches
    assert g2.start_us == pytest.approx(g1.end_us + PROF.launch_graph_us, abs=1e-6)


def test_launch_on_busy_cores_waits_for_them():
    pod = Pod(cloudmatrix384(dies=1))
    pod.stream(0, aiv=[0, 1, 2, 3]).launch(busy_vector, (20,), name="long")
    pod.stream(0, aiv=[2, 3, 4, 5]).launch(busy_vector, (5,), name="overlapping")
    pod.stream(0, aiv=[6, 7]).launch(busy_vector, (5,), name="disjoint")
    res = pod.synchronize()
    info = {la.name: la for la in res.launches}
    assert info["overlapping"].start_us >= info["long"].end_us
    assert info["overlapping"].start_us == pytest.approx(info["long"].end_us, abs=1e-3)
    assert info["disjoint"].start_us == PROF.launch_single_op_us               # not held up
    assert info["disjoint"].end_us < info["long"].end_us


# ---------------------------------------------------------------------------------------------- persistent kernels
@kernel(cores="aiv")
def server_loop(ctx, ctl, results):
    """Polls an 8-byte control word [work counter, stop flag] (int32 x 2 seen as one int64: a write to either
    half wakes the poll); serves each new work item, exits on stop."""
    word = ctl.view_as("int64")
    seen = 0
    while True:
        v = yield ctx.wait_gm(word, "ne", seen)
        seen = int(v[0])
        work, stop = np.array([seen], np.int64).view(np.int32)
        if stop:
            break
        old = yield ctx.atomic_add(results[0:1], 1)            # one served item
        yield ctx.gm_store(results[1:2], int(work) * 10 + old)


def test_persistent_kernel_parks_and_stops_on_host_flag():
    pod = Pod(cloudmatrix384(dies=1))
    ctl = pod.alloc(0, (2,), "int32", name="ctl")
    work, stop = ctl[0:1], ctl[1:2]
    results = pod.alloc(0, (2,), "int32", name="results")
    pod.host_write(work, 1)
    pod.stream(0, aiv=[0]).launch(server_loop, (ctl, results), persistent=True, name="server")
    r1 = pod.synchronize()
    assert r1.parked == ["server"]
    assert r1.launches[0].end_us is None
    assert results.numpy().tolist() == [1, 10]
    pod.host_write(work, 2)
    r2 = pod.synchronize()
    assert r2.parked == ["server"]
    assert results.numpy().tolist() == [2, 21]
    pod.host_write(stop, 1)
    r3 = pod.synchronize()
    assert r3.parked == []
    assert r3.launches[0].name == "server" and r3.launches[0].end_us is not None
    assert r3.launches[0].end_us >= r2.end_us
    assert results.numpy().tolist() == [2, 21]                      # stop served no work


def test_wait_gm_any_wakes_on_the_first_of_several_flags():
    """how="any": a server waits for work from any of several clients (one slot each)."""
    got = []

    @kernel(cores="aiv")
    def clients_and_server(ctx, slots):
        if ctx.block_idx == 0:
            seen = yield ctx.wait_gm(slots, "ne", 0, how="any")
            got.append((ctx.now_us, [int(v) for v in seen]))
        else:
            yield ctx.scalar(1850 * ctx.block_idx)           # client b writes after b us (1.85 GHz)
            yield ctx.gm_store(slots[ctx.block_idx - 1], ctx.block_idx)

    pod = Pod(cloudmatrix384(dies=1))
    slots = pod.alloc(0, (3,), "int32")
    pod.launch(clients_and_server, aiv=4, args=(slots,), mode="graph")
    (t, seen), = got
    assert seen == [1, 0, 0]                     # woken by client 1 alone, before clients 2 and 3 wrote
    assert t < 2.0 + 1.5 + pod.profile.launch_graph_us


def test_wait_timeout_can_return_to_the_kernel():
    """on_timeout="return": the poll yields None at its bound, and the kernel decides (here: it records a resend)."""
    seen = []

    @kernel(cores="aiv")
    def client(ctx, reply):
        v = yield ctx.wait_gm(reply, "ne", 0, timeout_us=5.0, on_timeout="return")
        seen.append((v, round(ctx.now_us, 3)))

    pod = Pod(cloudmatrix384(dies=1))
    reply = pod.alloc(0, (1,), "int32")
    run = pod.launch(client, aiv=1, args=(reply,), mode="graph")
    (v, t), = seen
    assert v is None and t == pytest.approx(pod.profile.launch_graph_us + 5.0, abs=0.01)
    assert not run.parked


def test_die_barrier_syncs_only_the_cores_of_one_die():
    passed = {}

    @kernel(cores="aiv")
    def k(ctx):
        if ctx.die == 1:
            yield ctx.scalar(20 * 1850)                          # die 1 is 20 us late (1.85 GHz)
        yield ctx.barrier("die")
        passed[(ctx.die, ctx.block_idx)] = ctx.now_us

    pod = Pod(cloudmatrix384(dies=2))
    pod.launch(k, dies=[0, 1], aiv=4, mode="graph")
    die0 = [t for (d, _), t in passed.items() if d == 0]
    die1 = [t for (d, _), t in passed.items() if d == 1]
    assert max(die0) < 5 and min(die1) > 20                     # die 0 did not wait for die 1
    assert len(set(round(t, 6) for t in die0)) == 1             # but its four cores left together


def test_kill_die_stops_its_cores_and_peers_see_it_only_through_the_protocol():
    """A server on die 1 answers requests until it is killed; a client polling with a bound notices the silence."""
    log = []

    @kernel(cores="aiv")
    def service(ctx, req, rsp):
        if ctx.die == 1:                                        # server: answer request n with n
            n = 0
            while True:
                got = yield ctx.wait_gm(req, "gt", n, timeout_us=None)
                n = int(got[0])
                yield ctx.gm_store(rsp, n)
        else:                                                   # client: 5 requests, one per 10 us
            for n in range(1, 6):
                yield ctx.gm_store(req, n)
                v = yield ctx.wait_gm(rsp, "ge", n, timeout_us=8.0, on_timeout="return")
                log.append((n, None if v is None else int(v[0])))
                yield ctx.scalar(10 * 1850)

    pod = Pod(cloudmatrix384(dies=2))
    req, rsp = pod.alloc(1, (1,), "int32"), pod.alloc(0, (1,), "int32")
    pod.kill_die(1, at_us=2.0 + 25.0)                            # graph launch at 2 us, then 25 us of service
    run = pod.launch(service, dies=[0, 1], aiv=1, args=(req, rsp), mode="graph")
    answered = [n for n, v in log if v == n]
    lost = [n for n, v in log if v is None]
    assert answered == [1, 2] and lost == [3, 4, 5]           # request 3 goes out at ~26 us: no answer before the kill
    assert [c.die for c in pod.killed] == [1] and not run.parked


def test_a_die_killed_before_a_launch_starts_stays_dead_for_it():
    """Killed at 1 us, before the graph launch's cores start (2 us): die 1's cores never run, and die 0 waiting for
    its flag gets a deadlock error that names the wait, instead of die 1 answering from the grave."""
    @kernel(cores="aiv")
    def ping(ctx, flag):
        if ctx.die == 1:
            yield ctx.gm_store(flag, 1)
        else:
            yield ctx.wait_gm(flag, "eq", 1, timeout_us=50.0)

    pod = Pod(cloudmatrix384(dies=2))
    flag = pod.alloc(0, (1,), "int32")
    pod.kill_die(1, at_us=1.0)
    with pytest.raises(DeadlockError, match="wait_gm"):
        pod.launch(ping, dies=[0, 1], aiv=1, args=(flag,), mode="graph")
    assert int(flag.numpy()[0]) == 0


def test_a_parked_persistent_kernel_books_its_work_to_the_run_that_did_it():
    """Copy, scale, store, then park on a flag: the first run reports that pipe time and names the parked wait."""
    @kernel(cores="aiv")
    def k(ctx, src, dst, flag):
        t = ctx.ub.alloc((1024,), "fp32")
        yield ctx.copy_gm_to_ub(t, src)
        yield ctx.vec.muls(t, t, 2.0)
        yield ctx.copy_ub_to_gm(dst, t)
        yield ctx.wait_gm(flag, "eq", 1, timeout_us=None)

    pod = Pod(cloudmatrix384(dies=1))
    src, dst = pod.alloc(0, (1024,), "fp32"), pod.alloc(0, (1024,), "fp32")
    flag = pod.alloc(0, (8,), "int32")
    pod.stream(0, aiv=[0]).launch(k, (src, dst, flag), persistent=True)
    run = pod.synchronize()
    assert run.parked == ["k"] and run.pipe_busy[(0, "aiv0", "MTE2")] > 0 and run.pipe_busy[(0, "aiv0", "VECTOR")] > 0
    assert "wait_gm" in pod.blocked()[0] and "aiv 0" in pod.blocked()[0]
    pod.host_write(flag, np.ones(8, np.int32))
    again = pod.synchronize()
    assert not again.parked and (0, "aiv0", "MTE2") not in again.pipe_busy       # not booked twice


@kernel(cores="aiv")
def scale_rows(ctx, x_gm, y_gm):
    rows = x_gm.shape[0] // ctx.block_num
    lo = ctx.block_idx * rows
    t = ctx.ub.alloc((rows, x_gm.shape[1]), "fp32")
    yield ctx.copy_gm_to_ub(t, x_gm[lo:lo + rows])
    yield ctx.vec.muls(t, t, 2.0)
    yield ctx.copy_ub_to_gm(y_gm[lo:lo + rows], t)


def test_on_done_host_functions_run_at_the_launch_end_and_queue_from_there():
    """Launch.on_done: called at the launch's end time (not when the engine first knows it: before, it ran before
    the last stores had landed and read stale rows); a launch it queues starts one launch overhead later, knows the
    host's GM writes made before it was queued (the sanitizer reported the read of a host function's input as an
    unpublished read), and the run's result lists it."""
    pod = Pod(cloudmatrix384(dies=1), sanitize=True)
    x = pod.to_gm(0, np.arange(8 * 64, dtype=np.float32).reshape(8, 64))
    y, z = pod.alloc(0, (8, 64), "fp32"), pod.alloc(0, (8, 64), "fp32")
    s = pod.stream(0, aiv=4)
    first = s.launch(scale_rows, (x, y), name="first")
    seen, queued = [], []

    def host(launch):
        seen.append((y.numpy().copy(), pod.now_us))
        # a new input written by the host now: the launch it queues after the write reads it without a race
        copy = pod.to_gm(0, y.numpy())
        queued.append(s.launch(scale_rows, (copy, z), name="second"))
    first.on_done.append(host)
    run = pod.synchronize()
    rows, at = seen[0]
    assert (rows == 2 * x.numpy()).all() and at == pytest.approx(first.end_ps / 1e6)
    assert queued[0].start_ps / 1e6 == pytest.approx(at + PROF.launch_single_op_us)
    assert (z.numpy() == 4 * x.numpy()).all() and [la.name for la in run.launches] == ["first", "second"]


def test_gm_store_of_an_array_in_the_store_dtype_lands_the_values_at_issue():
    """An int32 record stored to int32 GM skips the range checks (it fits by its dtype) but is still sampled when
    the store is made: changing the host array afterwards changes nothing that lands."""

    @kernel(cores="aiv")
    def store(ctx, dst):
        rec = np.arange(8, dtype=np.int32).reshape(1, 8)
        ins = ctx.gm_store(dst, rec)
        rec[...] = -1
        yield ins

    pod = Pod(cloudmatrix384(dies=1))
    dst = pod.alloc(0, (4, 8), "int32")
    pod.launch(store, aiv=1, args=(dst,))
    assert np.array_equal(dst.numpy(), np.tile(np.arange(8, dtype=np.int32), (4, 1)))


@kernel(cores="aiv")
def _torch_threads_seen(ctx, seen):
    import torch
    seen.append(torch.get_num_threads())
    yield ctx.pipe_barrier()


def test_numeric_runs_pin_torch_to_one_thread_also_for_a_launch_a_host_function_queues():
    """The run sets torch's thread count to 1 while numeric work runs, whether the numeric launch was queued before
    the run or by a host function of a timing-only launch during it, and gives the old count back after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        pod = Pod(cloudmatrix384(dies=1))
        s = pod.stream(0, aiv=1)
        seen = []
        first = s.launch(_torch_threads_seen, (seen,), numeric=False)
        first.on_done.append(lambda la: s.launch(_torch_threads_seen, (seen,), numeric=True))
        pod.synchronize()
        assert torch.get_num_threads() == 3
        s.launch(_torch_threads_seen, (seen,), numeric=True)
        pod.synchronize()
        assert seen == [3, 1, 1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_timing_only_run_does_not_load_torch():
    """torch (about 2 s of CPU to import) loads for numeric runs only: a timing-only command, from the command
    modules' import to the end of its run, never imports it."""
    import subprocess
    import sys
    code = ("import sys; from ascend_emu.cli import main;"
            "rc = main(['model', 'a2e', '--attn-dies', '2', '--expert-dies', '2', '--batch-per-die', '4', '--hidden',"
            " '256', '--topk', '1', '--json']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["0", "False"]
