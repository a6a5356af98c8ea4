"""Queue now, run later: kernel host functions given ``stream=`` queue their launches on the caller's streams and
return a ``kernels.ranks.Pending`` that ``collect``s the result after the caller's ``pod.synchronize()``."""
from __future__ import annotations

import pytest
import torch

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.errors import ArgumentError
from kernels import dynamic_quant, grouped_matmul
from kernels.attention import mla_decode_attention_timing
from kernels.mla import mla_prolog_timing
from kernels.ranks import Pending


def operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 256, generator=g).to(torch.bfloat16)
    w = torch.randint(-128, 128, (2, 256, 128), generator=g, dtype=torch.int8)
    return x, w, torch.rand(2, 128, generator=g) * 0.01 + 1e-3


def test_queued_kernels_give_the_direct_results_and_honour_after():
    x, w, cs = operands()
    direct_q = dynamic_quant(x, cores=8, trace=False)
    direct = grouped_matmul(direct_q.y, w, group_list=[10, 40], scale=cs, per_token_scale=direct_q.scale, cores=4,
                            trace=False)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    vec = pod.stream(0, aic=0, aiv=8)
    cube = pod.stream(0, aic=range(4, 8), aiv=range(8, 16))
    quant = dynamic_quant(x, stream=vec)
    assert isinstance(quant, Pending) and len(quant.launches) == 1
    with pytest.raises(ArgumentError, match="has not run yet"):
        quant.collect(None)
    # the GEMM stands for a consumer of the quantised rows: it must wait for the quant launch of the other stream
    gemm = grouped_matmul(direct_q.y, w, group_list=[10, 40], scale=cs, per_token_scale=direct_q.scale, stream=cube,
                          after=quant.launches)
    run = pod.synchronize()
    q, res = quant.collect(run), gemm.collect(run)
    assert torch.equal(q.y, direct_q.y) and torch.equal(q.scale, direct_q.scale)
    assert torch.equal(res.y.view(torch.int16), direct.y.view(torch.int16))
    (qa,), (ga,) = quant.launches, gemm.launches
    assert ga.start_ps >= qa.end_ps, "after= must hold the GEMM until the quant has finished"


def test_the_stream_sets_the_cores_and_a_different_count_is_refused():
    x, w, cs = operands(1)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    st = pod.stream(0, aic=6, aiv=12)
    with pytest.raises(ArgumentError, match="cores=4: the kernel runs on the stream's 6 AIC"):
        grouped_matmul(torch.zeros(8, 256, dtype=torch.int8), w, group_list=[4, 8], cores=4, stream=st)
    with pytest.raises(ArgumentError, match="needs AIV cores; the stream has none"):
        dynamic_quant(x, stream=pod.stream(0, aic=2, aiv=0))
    pending = grouped_matmul(torch.zeros(8, 256, dtype=torch.int8), w, group_list=[4, 8], stream=st)
    pod.synchronize()
    assert pending.launches[0].done and len(pending.launches[0].cores) == 6 + 12


def test_timing_entry_points_queue_on_a_stream():
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    st = pod.stream(0, aic=range(8, 24), aiv=range(16, 48), mode="graph")
    prolog = mla_prolog_timing(16, stream=st)
    attn = mla_decode_attention_timing(4, 256, stream=st)
    run = pod.synchronize()
    assert prolog.launches[0].end_ps <= attn.launches[0].start_ps           # one stream: in order
    assert attn.collect(run).plan.aic == 16 and prolog.collect(run).run is run
    with pytest.raises(ArgumentError, match="aic=8: the kernel runs on the stream's 16 AIC"):
        mla_decode_attention_timing(4, 256, aic=8, stream=st)
