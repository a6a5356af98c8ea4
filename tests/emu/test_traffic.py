"""Per-launch GM traffic (``Launch.traffic`` / ``LaunchInfo.{l2,hbm,fabric}_bytes``): in a run shared by several
launches each launch's HBM bytes are its own, and the launches' counts add up to the servers' totals."""
from __future__ import annotations

import numpy as np
import torch

from ascend_emu import Pod, cloudmatrix384, kernel
from kernels.grouped_matmul import grouped_matmul

M, K, N = 256, 2048, 1024


def _gemm(stream):
    meta = lambda *shape: torch.empty(*shape, dtype=torch.int8, device="meta")
    return grouped_matmul(meta(M, K), meta(1, K, N), group_list=torch.tensor([M]), weight_format="NZ",
                          output_dtype=torch.int32, numeric=False, stream=stream)


def _alone(aic) -> tuple:
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    pending = _gemm(pod.stream(0, aic=aic, aiv=range(2 * aic.start, 2 * aic.stop)))
    run = pod.synchronize()
    la = next(info for info in run.launches if info.name == pending.launches[0].name)
    return run, la


def test_two_streams_in_one_run_keep_their_own_hbm_bytes():
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    a = _gemm(pod.stream(0, aic=range(0, 8), aiv=range(0, 16)))
    b = _gemm(pod.stream(0, aic=range(8, 24), aiv=range(16, 48)))
    run = pod.synchronize()
    ta, tb = a.launches[0].traffic, b.launches[0].traffic
    # each GEMM touches its own operands in a cold 192 MiB L2: what it makes the HBM move is what it moves alone
    for traffic, aic in ((ta, range(0, 8)), (tb, range(8, 24))):
        alone_run, alone = _alone(aic)
        assert traffic.hbm_bytes == alone.hbm_bytes == alone_run.hbm_bytes() > 0
        assert traffic.l2_bytes == alone.l2_bytes > traffic.hbm_bytes // 2
        assert traffic.fabric_bytes == 0
    # nothing else moved: the launches' counts are the servers' totals, and the run reports them per launch
    assert ta.hbm_bytes + tb.hbm_bytes == run.hbm_bytes()
    assert ta.l2_bytes + tb.l2_bytes == run.servers["l2.0"]["bytes"]
    infos = {info.name: info for info in run.launches}
    assert infos[a.launches[0].name].hbm_bytes == ta.hbm_bytes


@kernel(cores="aiv")
def _pull(ctx, src, dst):
    """Each AIV copies its rows of ``src`` (another die's GM) into ``dst`` through its UB."""
    rows = src.shape[0] // ctx.block_num
    lo = ctx.block_idx * rows
    ub = ctx.ub.alloc((rows, src.shape[1]), "fp32")
    yield ctx.copy_gm_to_ub(ub, src[lo:lo + rows])
    yield ctx.copy_ub_to_gm(dst[lo:lo + rows], ub)


def test_bytes_that_cross_dies_count_as_fabric_bytes():
    pod = Pod(cloudmatrix384(dies=2), trace=False)
    src = pod.to_gm(1, np.arange(64 * 256, dtype=np.float32).reshape(64, 256))
    dst = pod.alloc(0, (64, 256), "fp32")
    run = pod.launch(_pull, die=0, aiv=8, args=(src, dst))
    (info,) = run.launches
    nbytes = 64 * 256 * 4
    assert info.fabric_bytes == nbytes                  # the reads crossed; the writes stayed on die 0
    assert info.l2_bytes == 2 * nbytes                  # read through die 1's L2, written into die 0's
    assert np.array_equal(dst.numpy(), src.numpy())
