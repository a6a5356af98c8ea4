"""Timing behaviour on modeled (deterministic) time: overlap, bandwidth, contention, determinism."""
import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.demo import run_copy, run_gemm, run_quantize

ROWS, H = 32, 512           # two 32 KiB fp32 tiles per slot


def make_pipeline(slots, in_place=False):
    """copy-in -> vector -> copy-out over ``n_tiles`` tiles; in place (one queue) or VECIN/VECOUT queues."""
    @kernel(cores="aiv")
    def pipeline(ctx, x_gm, y_gm, n_tiles):
        x_t = ctx.ub.alloc((slots, ROWS // 2, H), "fp32")
        y_t = x_t if in_place else ctx.ub.alloc((slots, ROWS // 2, H), "fp32")
        for i in range(n_tiles):
            k = i % slots
            yield ctx.copy_gm_to_ub(x_t[k], x_gm[i])
            yield ctx.vec.div(y_t[k], x_t[k], x_t[k])
            yield ctx.copy_ub_to_gm(y_gm[i], y_t[k])
    return pipeline


def run_pipeline(slots, n=16, numeric=False, in_place=False):
    pod = Pod(cloudmatrix384(dies=1))
    x = pod.alloc(0, (n, ROWS // 2, H), "fp32", phantom=not numeric)
    y = pod.alloc(0, (n, ROWS // 2, H), "fp32", phantom=not numeric)
    if numeric:
        x.write(np.random.default_rng(1).uniform(1, 2, size=x.shape).astype(np.float32))
    run = pod.launch(make_pipeline(slots, in_place), aiv=1, args=(x, y, n), numeric=numeric, mode="graph")
    return run, x, y


def stage_times(run):
    """Pipe-busy duration of the first instruction of each stage, from the trace (ps)."""
    first = {}
    for (_, unit, track, name, s, e, _) in run.trace.slices:
        if track in ("MTE2", "VECTOR", "MTE3") and track not in first:
            first[track] = e - s
    return first


def test_double_buffering_overlaps_stages():
    n = 16
    single, _, _ = run_pipeline(1, n, in_place=True)
    double, _, _ = run_pipeline(2, n)
    st = stage_times(single)
    lat = Pod(cloudmatrix384(dies=1)).engine.paths.hbm_lat
    copy_in = st["MTE2"] + lat                    # a copy-in's data is usable one GM latency after its pipe frees
    sum_stages = copy_in + st["VECTOR"] + st["MTE3"]
    slowest = max(copy_in, st["VECTOR"], st["MTE3"])
    single_ps = single.kernel_us * 1e6
    double_ps = double.kernel_us * 1e6
    # one buffer: each tile waits for the previous tile's copy-out, so N x the sum of the stages
    assert single_ps == pytest.approx(n * sum_stages, rel=0.10)
    # double-buffered VECIN/VECOUT queues: about N x the slowest stage, never below the busiest pipe
    assert n * max(st.values()) <= double_ps <= 1.05 * n * slowest + sum_stages
    assert double_ps < 0.6 * single_ps


def test_numeric_and_timing_only_give_the_same_time_and_trace():
    a, x, y = run_pipeline(2, 8, numeric=True)
    b, _, _ = run_pipeline(2, 8, numeric=False)
    assert a.modeled_us == b.modeled_us
    assert a.trace.digest() == b.trace.digest()
    assert np.array_equal(y.numpy(), np.ones(y.shape, np.float32))      # x / x with x in [1, 2)


@pytest.mark.parametrize("dst_die, server", [(0, "hbm0"), (1, "d2d.rx1"), (16, "ub.rx16")])
def test_bandwidth_bound_copy_matches_bytes_over_bandwidth(dst_die, server):
    r = run_copy(64 << 20, cores=48, dst_die=dst_die)          # long enough that fill and drain are small
    run = r["run"]
    expect_gbps = r["peak_gbps"]
    assert r["achieved_gbps"] == pytest.approx(expect_gbps, rel=0.05)
    assert run.servers[server]["bytes"] >= r["payload_bytes"]


@kernel(cores="aiv")
def push(ctx, src, dst, chunk_rows):
    t = ctx.ub.alloc((2, chunk_rows, src.shape[1]), src.dtype)
    mine = range(ctx.block_idx * chunk_rows, src.shape[0], ctx.block_num * chunk_rows)
    for i, r in enumerate(mine):
        yield ctx.copy_gm_to_ub(t[i % 2], src[r:r + chunk_rows])
        yield ctx.copy_ub_to_gm(dst[r:r + chunk_rows], t[i % 2])


def _send(senders, nbytes=8 << 20):
    pod = Pod(cloudmatrix384(dies=48))
    rows = nbytes // 4096
    for die in senders:
        src = pod.alloc(die, (rows, 4096), "uint8", phantom=True)
        dst = pod.alloc(32, (rows, 4096), "uint8", phantom=True)
        pod.stream(die, aiv=48).launch(push, (src, dst, 16), numeric=False)
    return pod.synchronize()


def test_two_dies_sending_to_one_take_twice_as_long_shared_receive_port():
    one = _send([0])
    two = _send([0, 16])
    ratio = two.kernel_us / one.kernel_us
    assert 1.8 <= ratio <= 2.2, ratio
    assert two.servers["ub.rx32"]["utilization"] > 0.9


def test_more_cores_help_until_the_port_saturates():
    r = [run_copy(8 << 20, cores=c, dst_die=16) for c in (1, 4, 16, 48)]
    gbps = [x["achieved_gbps"] for x in r]
    assert gbps[1] > 2 * gbps[0]                       # one core's mover is the limit at first
    assert gbps[3] >= 0.9 * r[3]["peak_gbps"]          # then the fabric port (fill and drain cost the rest)
    assert gbps[3] < 1.25 * gbps[2]                     # and more cores stop helping


def test_repeated_runs_are_identical():
    a = run_quantize(tokens=48 * 16, hidden=256)
    b = run_quantize(tokens=48 * 16, hidden=256)
    assert a["run"].modeled_us == b["run"].modeled_us
    assert a["run"].trace.digest() == b["run"].trace.digest()
    g1, g2 = run_gemm(128, 256, 256, aic=2), run_gemm(128, 256, 256, aic=2)
    assert g1["run"].trace.digest() == g2["run"].trace.digest()


def test_trace_is_well_formed(tmp_path):
    g = run_gemm(128, 256, 256, aic=2)
    tr = g["run"].trace
    tr.check()                                    # no overlapping slices on any track
    assert tr.flows, "cross-core flags should draw flow arrows"
    p = tr.save(tmp_path / "t.json")
    text = open(p).read()
    assert text.index('"profilingType"') < text.index('"traceEvents"')


def test_launch_overhead_single_op_vs_graph():
    prof = cloudmatrix384(dies=1)
    res = {}
    for mode in ("single-op", "graph"):
        pod = Pod(prof)
        x = pod.alloc(0, (1, ROWS // 2, H), "fp32", phantom=True)
        res[mode] = pod.launch(make_pipeline(1), aiv=1, args=(x, x, 1), numeric=False, mode=mode)
    gap = res["single-op"].modeled_us - res["graph"].modeled_us
    assert gap == pytest.approx(prof.launch_single_op_us - prof.launch_graph_us, abs=1e-6)
    assert res["single-op"].kernel_us == res["graph"].kernel_us


def test_disjoint_column_blocks_do_not_wait_for_each_other_but_overlapping_ones_do():
    """Writes into different column blocks of one tile are independent (only the pipe orders them); a write
    whose columns overlap the first must wait until the first has landed (WAW)."""
    prof = cloudmatrix384(dies=1)

    def run(second_cols):
        @kernel(cores="aic")
        def cols(ctx, a_gm):
            t = ctx.l1.alloc((128, 64), "int8")
            yield ctx.copy_gm_to_l1(t[:, 0:32], a_gm[:, 0:32])
            yield ctx.copy_gm_to_l1(t[:, second_cols], a_gm[:, second_cols])
        pod = Pod(prof)
        a = pod.alloc(0, (128, 64), "int8")
        r = pod.launch(cols, aic=1, args=(a,), mode="graph")
        first, second = sorted([s for s in r.trace.slices if s[2] == "MTE2"], key=lambda s: s[4])
        return second[4] - first[5]                        # gap between the first's pipe end and the second's start
    lat = Pod(prof).engine.paths.hbm_lat
    assert run(slice(32, 64)) == 0                          # disjoint: back to back on the pipe
    assert run(slice(0, 32)) == lat                         # same columns: waits for the first to land


def test_utilization_counts_each_core_once_over_many_launches():
    """Ten back-to-back launches on the same 4 AIVs are about as busy (as a fraction: 2 us graph launch gaps
    aside) as one launch of ten times the work; the denominator is 4 cores over the span, not 40."""
    from ascend_emu import Pod, cloudmatrix384, kernel

    @kernel(cores="aiv")
    def k(ctx, reps):
        t = ctx.ub.alloc((8192,), "fp32", phantom=True)
        for _ in range(reps):
            yield ctx.vec.muls(t, t, 2.0)

    many = Pod(cloudmatrix384(dies=1), trace=False, launch_mode="graph")
    s = many.stream(0, aiv=4)
    for _ in range(10):
        s.launch(k, (200,), numeric=False)
    u_many = many.synchronize().utilization["VECTOR"]
    one = Pod(cloudmatrix384(dies=1), trace=False, launch_mode="graph")
    one.stream(0, aiv=4).launch(k, (2000,), numeric=False)
    u_one = one.synchronize().utilization["VECTOR"]
    assert 0.8 * u_one < u_many <= u_one and u_one > 0.9


@kernel(cores="aiv")
def dma_queue_then_mtu(ctx, src, dsts, small_src, small_dst, n_dma):
    """Queue ``n_dma`` DMA descriptors die 0 -> die 1, then one small mtu write die 0 -> die 1 (same ports)."""
    t = ctx.ub.alloc(small_src.shape, small_src.dtype)
    for i in range(n_dma):
        yield ctx.dma_copy(dsts[i], src)
    yield ctx.copy_gm_to_ub(t, small_src)
    yield ctx.copy_ub_to_gm(small_dst, t)
    yield ctx.pipe_barrier()


def test_a_queued_dma_takes_the_ports_only_when_its_bytes_flow():
    """Descriptors queued behind each other on the die's one engine (4 us start-up each) book the HBM and fabric
    ports when their start-up is over, not when queued: an mtu write issued meanwhile passes at once instead of
    waiting behind the last descriptor's future slot."""
    prof = cloudmatrix384(dies=2)
    end = []
    for n_dma in (0, 4):
        pod = Pod(prof, trace=True)
        src = pod.alloc(0, (64, 1024), "fp32", phantom=True)
        dsts = pod.alloc(1, (4, 64, 1024), "fp32", phantom=True)
        small_src = pod.alloc(0, (8, 64), "fp32", phantom=True)
        small_dst = pod.alloc(1, (8, 64), "fp32", phantom=True)
        run = pod.launch(dma_queue_then_mtu, aiv=1, args=(src, dsts, small_src, small_dst, n_dma))
        mte3 = [s for s in run.trace.slices if s[2] == "MTE3"]
        end.append(mte3[0][5] / 1e6)
        if n_dma:
            dma = sorted(s[4] / 1e6 for s in run.trace.slices if s[2] == "DMA")
            assert dma[-1] - dma[0] >= 3 * prof.dma_startup_ns / 1e3       # the descriptors did queue
    assert end[1] - end[0] < 0.2, end                                      # the mtu write did not wait for them
