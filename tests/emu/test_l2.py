"""The die's memory hierarchy on modeled time and per-server bytes: the L2 in front of HBM, per-core mover rates by
where the bytes come from, latency-bound remote traffic, vector cost by the blocks an operand touches."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.cache import L2, footprint
from ascend_emu.demo import run_copy
from ascend_emu.timing import vector_cycles

MiB = 1 << 20
CHUNK = 64 * 1024           # bytes per copy


@kernel(cores="aiv")
def stream_read(ctx, src, chunk_rows, passes):
    """Each core reads its rows of ``src`` [rows, 4096] uint8 ``passes`` times, CHUNK bytes per copy, ping-pong."""
    t = ctx.ub.alloc((2, chunk_rows, src.shape[1]), src.dtype)
    mine = range(ctx.block_idx * chunk_rows, src.shape[0], ctx.block_num * chunk_rows)
    i = 0
    for _ in range(passes):
        for r in mine:
            yield ctx.copy_gm_to_ub(t[i % 2], src[r:r + chunk_rows])
            i += 1


@kernel(cores="aiv")
def stream_write(ctx, dst, chunk_rows):
    t = ctx.ub.alloc((chunk_rows, dst.shape[1]), dst.dtype)
    for r in range(ctx.block_idx * chunk_rows, dst.shape[0], ctx.block_num * chunk_rows):
        yield ctx.copy_ub_to_gm(dst[r:r + chunk_rows], t)


def _rows(nbytes):
    return nbytes // 4096


def _read(pod, src, cores=1, passes=1, die=0):
    return pod.launch(stream_read, die=die, aiv=cores, args=(src, CHUNK // 4096, passes), numeric=False,
                      mode="graph")


def _mte2_rate(run, prof):
    """Bytes per cycle one core's MTE2 moved while busy, start-ups excluded."""
    copies = [s for s in run.trace.slices if s[2] == "MTE2"]
    busy_ps = sum(e - s for (_, _, _, _, s, e, _) in copies) - len(copies) * prof.cycles_to_ps(prof.mte_startup_cycles)
    return len(copies) * CHUNK / (busy_ps * prof.clock_ghz / 1000)


def test_one_core_streams_from_hbm_at_32_and_from_l2_at_110_bytes_per_cycle():
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof)
    src = pod.alloc(0, (_rows(8 * MiB), 4096), "uint8", phantom=True)
    cold = _read(pod, src)
    warm = _read(pod, src)
    assert _mte2_rate(cold, prof) == pytest.approx(prof.hbm_read_bytes_per_cycle, rel=0.01)
    assert _mte2_rate(warm, prof) == pytest.approx(prof.l2_read_bytes_per_cycle, rel=0.01)
    assert cold.l2[0]["read_miss_bytes"] == 8 * MiB and cold.hbm_bytes() == 8 * MiB
    assert warm.l2[0]["read_hit_bytes"] == 8 * MiB and warm.hbm_bytes() == 0


def test_48_cores_streaming_from_hbm_share_its_bandwidth():
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof, trace=False)
    src = pod.alloc(0, (_rows(96 * MiB), 4096), "uint8", phantom=True)
    run = _read(pod, src, cores=48)
    gbps = 96 * MiB / (run.kernel_us * 1e3)
    assert 48 * prof.hbm_read_bytes_per_cycle * prof.clock_ghz > 1.5 * prof.hbm_gbps    # the cores could go faster
    assert gbps == pytest.approx(prof.hbm_gbps, rel=0.05)
    assert run.servers["hbm0"]["utilization"] > 0.95


@pytest.mark.parametrize("factor, second_pass_misses", [(0.5, 0.0), (2.0, 1.0)])
def test_a_working_set_larger_than_the_l2_misses_on_every_pass(factor, second_pass_misses):
    """LRU over a sequential stream: half the L2 is read from HBM once; twice the L2 is read from HBM every pass."""
    prof = cloudmatrix384(dies=1)
    nbytes = int(prof.l2_bytes * factor)
    pod = Pod(prof, trace=False)
    src = pod.alloc(0, (_rows(nbytes), 4096), "uint8", phantom=True)
    first = _read(pod, src, cores=48)
    second = _read(pod, src, cores=48)
    assert first.hbm_bytes() == nbytes
    assert second.hbm_bytes() == pytest.approx(second_pass_misses * nbytes, abs=prof.l2_line_bytes * 64)
    if second_pass_misses:
        assert second.kernel_us == pytest.approx(first.kernel_us, rel=0.02)
    else:
        assert second.kernel_us < 0.5 * first.kernel_us


def test_a_write_then_a_read_within_the_l2_costs_no_hbm_read():
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof)
    buf = pod.alloc(0, (_rows(16 * MiB), 4096), "uint8", phantom=True)
    w = pod.launch(stream_write, aiv=48, args=(buf, CHUNK // 4096), numeric=False, mode="graph")
    r = _read(pod, buf, cores=48)
    assert w.hbm_bytes() == 0 and w.l2[0]["write_bytes"] == 16 * MiB and w.l2[0]["dirty_bytes"] == 16 * MiB
    assert r.hbm_bytes() == 0 and r.l2[0]["read_hit_bytes"] == 16 * MiB


def test_dirty_evictions_cost_hbm_writes():
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof, trace=False)
    nbytes = prof.l2_bytes + 64 * MiB
    buf = pod.alloc(0, (_rows(nbytes), 4096), "uint8", phantom=True)
    w = pod.launch(stream_write, aiv=48, args=(buf, CHUNK // 4096), numeric=False, mode="graph")
    assert w.l2[0]["writeback_bytes"] == pytest.approx(64 * MiB, abs=48 * CHUNK)
    assert w.hbm_bytes() == w.l2[0]["writeback_bytes"]
    assert w.l2[0]["dirty_bytes"] == w.l2[0]["resident_bytes"] <= prof.l2_bytes


def test_a_remote_access_goes_through_the_owners_l2():
    prof = cloudmatrix384(dies=2)
    pod = Pod(prof)
    src = pod.alloc(1, (_rows(4 * MiB), 4096), "uint8", phantom=True)
    cold = _read(pod, src, cores=8, die=0)
    warm = _read(pod, src, cores=8, die=0)
    assert cold.servers["l2.1"]["bytes"] == 4 * MiB and cold.hbm_bytes(1) == 4 * MiB and "l2.0" not in cold.servers
    assert warm.hbm_bytes() == 0 and warm.l2[1]["read_hit_bytes"] == 4 * MiB


def test_phantom_and_real_tensors_hit_and_miss_alike():
    def run(phantom):
        pod = Pod(cloudmatrix384(dies=1))
        src = pod.alloc(0, (_rows(2 * MiB), 4096), "uint8", phantom=phantom)
        a = pod.launch(stream_read, aiv=4, args=(src, 4, 2), numeric=not phantom, mode="graph")
        return a.modeled_us, a.l2, a.trace.digest()
    assert run(True) == run(False)


def test_strided_views_touch_only_their_lines():
    """A column block of a matrix touches the lines of its rows' blocks, not every line of its extent."""
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof)
    m = pod.alloc(0, (64, 4096), "int8", phantom=True)
    col = m[:, 0:128]                                  # 64 blocks of 128 B, 4 KiB apart
    c = L2(0, prof.l2_bytes, prof.l2_line_bytes)
    c.access(footprint(col, prof.l2_line_bytes), False)
    assert (c.hit, c.miss) == (0, 64)
    c.access(footprint(m[:, 512:640], prof.l2_line_bytes), False)   # the next 512-byte line of each row
    assert (c.hit, c.miss) == (0, 64)
    c.access(footprint(m[:, 128:256], prof.l2_line_bytes), False)   # lines the first read already fetched
    assert (c.hit, c.miss) == (64, 0)
    c.access(footprint(m[0:2], prof.l2_line_bytes), False)          # two whole rows: 16 lines, 4 of them present
    assert (c.hit, c.miss) == (4, 12)


def test_lru_keeps_the_recently_used_pages():
    c = L2(0, 4 * 64 * 512, 512)                       # room for 4 pages of 64 lines
    page = lambda p: (p, 0xFFFFFFFFFFFFFFFF)           # noqa: E731
    for p in range(4):
        c.access(page(p), True)
    c.access(page(0), False)                           # page 0 becomes the most recent
    c.access(page(4), False)                           # evicts page 1 (dirty: 64 lines written back)
    assert c.evicted == 64
    c.access(page(0), False)
    assert (c.hit, c.miss) == (64, 0)
    c.access(page(1), False)
    assert (c.hit, c.miss) == (0, 64)


def test_more_cores_help_a_remote_copy_until_the_port_saturates():
    """A core keeps remote_outstanding_bytes in flight per round trip: 2 cores are latency-bound, 48 fill the port."""
    prof = cloudmatrix384(dies=17)
    two = run_copy(9 * MiB, cores=2, dst_die=16)
    many = run_copy(9 * MiB, cores=48, dst_die=16)
    route = Pod(prof).engine.paths.path("MTE3", 0, None, 16)
    assert two["achieved_gbps"] == pytest.approx(2 * route.remote_rate * 1000, rel=0.05)
    assert two["achieved_gbps"] < 0.5 * many["achieved_gbps"]
    assert many["achieved_gbps"] >= 0.9 * prof.fabric_gbps * (1 - prof.inter_node_bw_loss)


def test_vector_cost_counts_the_blocks_an_operand_touches():
    """Half the columns of a [32, 256] fp32 tile cost what a contiguous [32, 128] tile costs, not its extent."""

    @kernel(cores="aiv")
    def k(ctx):
        t = ctx.ub.alloc((32, 256), "fp32", phantom=True)
        c = ctx.ub.alloc((32, 128), "fp32", phantom=True)
        yield ctx.vec.muls(t[:, :128], t[:, :128], 2.0)
        yield ctx.vec.muls(c, c, 2.0)
        yield ctx.vec.muls(t, t, 2.0)

    prof = cloudmatrix384(dies=1)
    run = Pod(prof).launch(k, aiv=1, numeric=False, mode="graph")
    durs = [e - s for (_, _, track, _, s, e, _) in run.trace.slices if track == "VECTOR"]
    assert durs[0] == durs[1] == prof.cycles_to_ps(vector_cycles(prof, 32 * 128 * 4, 1))
    assert durs[2] == prof.cycles_to_ps(vector_cycles(prof, 32 * 256 * 4, 1))


def test_dma_engine_takes_one_descriptor_at_a_time_under_contention():
    """Issue 17 item 4: descriptors never overlap on the engine, even when a busy link holds their bytes back."""
    rng = np.random.default_rng(7)
    for trial in range(6):
        prof = cloudmatrix384(dies=18)
        pod = Pod(prof)
        n = int(rng.integers(2, 6))
        sizes = rng.integers(1, 64, size=n) * 4096
        srcs = [pod.alloc(0, (int(s),), "uint8", phantom=True) for s in sizes]
        dsts = [pod.alloc(16, (int(s),), "uint8", phantom=True) for s in sizes]
        hog = pod.alloc(1, (_rows(8 * MiB), 4096), "uint8", phantom=True)
        hog_dst = pod.alloc(16, (_rows(8 * MiB), 4096), "uint8", phantom=True)

        @kernel(cores="aiv")
        def dmas(ctx):
            for s, d in zip(srcs, dsts):
                yield ctx.dma_copy(d, s)
            yield ctx.pipe_barrier()

        from ascend_emu.demo import stream_copy
        pod.stream(1, aiv=48).launch(stream_copy, (hog, hog_dst, 16), numeric=False)   # die 1 floods die 16's port
        pod.stream(0, aiv=1).launch(dmas, (), numeric=False)
        run = pod.synchronize()
        run.trace.check()
        slices = sorted((s, e) for (_, unit, track, _, s, e, _) in run.trace.slices if track == "DMA")
        assert len(slices) == n
        assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:])), (trial, slices)


def test_invalidate_l2_makes_the_next_run_cold():
    prof = cloudmatrix384(dies=1)
    pod = Pod(prof)
    src = pod.alloc(0, (_rows(2 * MiB), 4096), "uint8", phantom=True)
    cold = _read(pod, src)
    assert _read(pod, src).hbm_bytes() == 0
    pod.invalidate_l2()
    again = _read(pod, src)
    assert again.hbm_bytes() == 2 * MiB and again.kernel_us == cold.kernel_us


@settings(max_examples=60, deadline=None)
@given(starts=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=40), block=st.integers(1, 3000))
def test_blocks_footprint_is_every_line_the_blocks_touch(starts, block):
    """The (page, mask) pairs of blocks of ``block`` bytes at ``starts`` (unsorted, overlapping): exactly the lines
    any byte of them lies in, grouped by page in page order."""
    from ascend_emu.cache import _blocks_footprint
    line, PAGE_LINES = 512, 64             # a page: the lines of one 64-bit mask
    lines = sorted({b // line for s in starts for b in range(s, s + block)})
    want = {}
    for ln in lines:
        want[ln // PAGE_LINES] = want.get(ln // PAGE_LINES, 0) | (1 << (ln % PAGE_LINES))
    flat = [v for k in sorted(want) for v in (k, want[k])]
    assert list(_blocks_footprint(np.array(starts, np.int64), block, line)) == flat


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 1 << 24), count=st.integers(1, 64), block=st.integers(1, 40000), gap=st.integers(1, 70000),
       line=st.sampled_from([32, 512, 4096]))
def test_pattern_footprint_is_the_blocks_footprint(a, count, block, gap, line):
    """The loop over a few evenly spaced blocks (step = block + gap) gives what the numpy path gives."""
    from ascend_emu.cache import _blocks_footprint, _pattern_footprint
    step = block + gap
    starts = a + step * np.arange(count, dtype=np.int64)
    assert _pattern_footprint(a, count, step, block, line) == _blocks_footprint(starts, block, line)


@settings(max_examples=300, deadline=None)
@given(starts=st.lists(st.integers(0, 1 << 22), min_size=1, max_size=300), block=st.integers(1, 70000),
       line=st.sampled_from([32, 128, 512, 4096]), repeat=st.integers(0, 3))
def test_blocks_footprint_loop_is_the_numpy_passes(starts, block, line, repeat):
    """The typed loop (up to thousands of blocks: a gather's rows) gives exactly the numpy passes' (page, mask)
    pairs: unsorted, repeated (a gather's pad row) and overlapping blocks, blocks spanning pages."""
    from ascend_emu.cache import _blocks_footprint, _numpy_blocks_footprint, _sorted_blocks_footprint
    starts = np.array(starts + starts[:repeat], np.int64)
    want = _numpy_blocks_footprint(starts, block, line)
    assert _sorted_blocks_footprint(sorted(starts.tolist()), block, line) == want
    assert _blocks_footprint(starts, block, line) == want


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 1 << 24), count=st.integers(1, 5000), block=st.integers(1, 5000), gap=st.integers(0, 9000),
       line=st.sampled_from([32, 512]))
def test_pattern_footprint_of_many_blocks_is_the_numpy_passes(a, count, block, gap, line):
    """Evenly spaced blocks (touching when gap is 0), up to past the loop's limit, as the numpy passes count them."""
    from ascend_emu.cache import _numpy_blocks_footprint, _pattern_footprint
    step = block + gap
    starts = a + step * np.arange(count, dtype=np.int64)
    assert _pattern_footprint(a, count, step, block, line) == _numpy_blocks_footprint(starts, block, line)


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 1 << 40), n=st.integers(1, 1 << 20), line=st.sampled_from([32, 512, 4096]))
def test_range_footprint_is_the_numpy_passes(a, n, line):
    """A contiguous range (typed in the build) gives the pages and masks of one block of its bytes."""
    from ascend_emu.cache import _numpy_blocks_footprint, _range_footprint
    assert _range_footprint(a, a + n, line) == _numpy_blocks_footprint(np.array([a], np.int64), n, line)
