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


def prolog_case(seed=3, t=6, bs=16):
    from tests.kernels.test_mla_prolog import make_model
    m = make_model(seed, t, 256, 128, 64, 2, 32, 16)
    blocks = 4
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(blocks, bs, 1, 64, generator=g).bfloat16()
    kr = torch.randn(blocks, bs, 1, 16, generator=g).bfloat16()
    args = (m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"], m["kv_norm"],
            m["sin"], m["cos"])
    return args, kv, kr, torch.arange(10, 10 + t)


def test_numeric_prolog_and_attention_queue_and_chain_through_the_cache():
    """mla_prolog and mla_decode_attention queued numerically on one stream: the attention reads the rows the
    prolog writes into the caller's cache when it runs; the outputs equal the direct calls bit for bit."""
    from kernels import mla_decode_attention, mla_prolog
    args, kv, kr, idx = prolog_case()
    table, lens = torch.tensor([[0, 1]]), [16]

    def attention_of(p, kv, kr, **kw):
        q = p.query[:6].reshape(1, 6, 2, 64) if p is not None else torch.zeros(1, 6, 2, 64, dtype=torch.bfloat16)
        qr = p.query_rope[:6].reshape(1, 6, 2, 16) if p is not None else torch.zeros(1, 6, 2, 16, dtype=torch.bfloat16)
        return mla_decode_attention(q, qr, kv, kr, table, lens, softmax_scale=0.1, aic=4, **kw)
    kv_d, kr_d = kv.clone(), kr.clone()
    p_direct = mla_prolog(*args, kv_d, kr_d, cache_index=idx, aic=4)
    a_direct = attention_of(p_direct, kv_d, kr_d)

    pod = Pod(cloudmatrix384(dies=1), trace=False)
    st = pod.stream(0, aic=4, aiv=8)
    prolog = mla_prolog(*args, kv, kr, cache_index=idx, aic=4, stream=st)
    assert isinstance(prolog, Pending)
    # the attention's query comes from the prolog (host glue after the first synchronize); it reads the cache
    run1 = pod.synchronize()
    p = prolog.collect(run1)
    assert torch.equal(kv.view(torch.int16), kv_d.view(torch.int16))       # the cache writes landed in place
    attn = attention_of(p, kv, kr, stream=st, after=prolog.launches)
    run2 = pod.synchronize()
    a = attn.collect(run2)
    for got, want in ((p.query, p_direct.query), (p.query_rope, p_direct.query_rope),
                      (a.attention_out, a_direct.attention_out)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # the pod's clock runs on across the two synchronizes: the second run starts where the first ended
    assert run2.start_us == pytest.approx(run1.end_us) and attn.launches[0].start_ps > prolog.launches[0].end_ps
    # modeled times: each queued kernel on the same cores takes what the direct call took (same plan, idle die)
    assert run1.kernel_us == pytest.approx(p_direct.run.kernel_us, rel=1e-9)
    assert run2.kernel_us == pytest.approx(a_direct.run.kernel_us, rel=1e-9)


def test_host_functions_run_at_the_modeled_time_a_launch_finishes():
    """Launch.on_done: host glue inside one run queues the next kernel at the present of the run (not at the
    run's start), and the run's result lists what was queued during it."""
    x, w, cs = operands(2)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    st = pod.stream(0, aic=0, aiv=8)
    first = dynamic_quant(x, stream=st)
    later = []

    seen = []

    def glue(launch):
        q = first.collect(None)                        # every output has landed when the host function runs
        seen.append((q.y.clone(), q.scale.clone(), pod.now_us))
        later.append(dynamic_quant(q.y.float().bfloat16(), stream=st))
    first.launches[0].on_done.append(glue)
    run = pod.synchronize()
    (a,), (b,) = first.launches, later[0].launches
    direct = dynamic_quant(x, cores=8, trace=False)
    assert torch.equal(seen[0][0], direct.y) and torch.equal(seen[0][1], direct.scale)
    assert seen[0][2] == pytest.approx(a.end_ps / 1e6)           # called at the launch's end, not before
    assert b.start_ps >= a.end_ps + int(pod.profile.launch_single_op_us * 1e6) and b.done
    assert [la.name for la in run.launches] == [a.name, b.name]


def test_queued_dispatch_and_combine_equal_the_direct_calls():
    from kernels import MoeGroup, moe_distribute_combine, moe_distribute_dispatch
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3, 64, generator=g).bfloat16() for _ in range(2)]
    ids = [torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.tensor([[3, 0], [1, 2], [0, 3]])]
    wts = [torch.rand(3, 2, generator=g).numpy() for _ in range(2)]

    def run(queued):
        pod = Pod(cloudmatrix384(dies=2), trace=False)
        group = MoeGroup(pod, [0, 1], max_bs=3, hidden=64, topk=2, num_experts=4, cores=8)
        if not queued:
            d = moe_distribute_dispatch(xs, ids, group)
            ys = [torch.from_numpy(e.astype("float32")).bfloat16() for e in d.expand_x]
            return d, moe_distribute_combine(ys, d, wts, group)[0]
        streams = [pod.stream(r, aiv=8) for r in range(2)]
        pd = moe_distribute_dispatch(xs, ids, group, stream=streams)
        d = pd.collect(pod.synchronize())
        ys = [torch.from_numpy(e.astype("float32")).bfloat16() for e in d.expand_x]
        pc = moe_distribute_combine(ys, d, wts, group, stream=streams, after=pd.launches)
        return d, pc.collect(pod.synchronize())[0]
    (d0, o0), (d1, o1) = run(False), run(True)
    for a, b in zip(d0.expand_x + o0, d1.expand_x + o1):
        assert (a.view("int8") == b.view("int8")).all()
