"""Robustness sweep over xccl's public entry points (send/recv, dispatch/combine, A2E/E2A, the expert service):
dtypes, shapes, core counts, ids and dies in and out of range, non-integers, non-contiguous inputs, NaN/inf.

The only allowed outcomes: the library's own error naming an argument the case perturbed, or a result equal to the
reference. Each case runs in a child process (``tests.isolation``): a crash or a hang fails the case, not the run.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.isolation import check, child  # noqa: F401 (child: the module's worker fixture)

SWEEP = settings(max_examples=8, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- send / recv
def p2p_case(nbytes, dtype, noncontig, cores_send, cores_recv, zc_send, zc_recv, event_send, event_recv, dst_die,
             path):
    from ascend_emu import Pod, cloudmatrix384
    from xccl import Communicator, recv, send
    pod = Pod(cloudmatrix384(dies=18), trace=False, max_modeled_us=2000.0)
    comm = Communicator(pod, [0, 17], lanes=4, slots=2, slot_bytes=1024)
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    x = np.random.default_rng(nbytes).standard_normal(2 * n).astype(dtype) if dtype != np.uint8 else \
        np.random.default_rng(nbytes).integers(0, 256, 2 * n, dtype=np.uint8)
    src = pod.to_gm(0, x.reshape(2, n))
    src = src.reshape(n, 2) if not noncontig else src[:, ::2]          # a strided view: not contiguous
    dst = pod.alloc(17, tuple(src.shape), src.dtype)
    send(comm, src, dst_die, event_send, cores=cores_send, zero_copy=zc_send, path=path if not zc_send else "mtu")
    recv(comm, dst, 0, event_recv, cores=cores_recv, zero_copy=zc_recv).wait()
    assert np.array_equal(dst.numpy().view(np.uint8), src.numpy().view(np.uint8))


@SWEEP
@given(nbytes=st.integers(1, 6000), dtype=st.sampled_from([np.uint8, np.float32, np.int32, ml_dtypes.bfloat16]),
       noncontig=st.booleans(), cores=st.integers(1, 4), other_cores=st.sampled_from([None, 1, 3, 5]),
       zc=st.sampled_from([(False, False), (True, True), (True, False)]),
       event=st.sampled_from([7, np.int64(7), 7.9, -1, 2 ** 31]), event_recv_differs=st.booleans(),
       dst_die=st.sampled_from([17, 16, 99, 17.0]), path=st.sampled_from(["mtu", "dma"]))
def test_send_recv(child, nbytes, dtype, noncontig, cores, other_cores, zc, event, event_recv_differs, dst_die,
                   path):
    names = []
    cores_recv = cores if other_cores is None else other_cores
    if noncontig:
        names.append("contiguous")
    if cores_recv != cores or cores_recv > 4:
        names.append("cores")
    if zc[0] != zc[1]:
        names.append("zero_copy")
    if not isinstance(event, (int, np.integer)) or not -2 ** 31 <= event < 2 ** 31:
        names.append("event_id")
    event_recv = 8 if event_recv_differs else event
    if event_recv_differs:
        names.append("event id")
    if dst_die != 17 or not isinstance(dst_die, int):
        names.append("die")
    check(child, p2p_case, nbytes, dtype, noncontig, cores, cores_recv, zc[0], zc[1], event, event_recv, dst_die,
          path, names=tuple(names))


# ---------------------------------------------------------------------------------------------- dispatch / combine
def moe_case(ranks, tokens, hidden, topk, ids, quant, special, weights):
    import torch
    from ascend_emu import Pod, cloudmatrix384
    from quant.int8 import quantize_per_token
    from xccl import Communicator, combine, dispatch
    from xccl.moe import _torch
    pod = Pod(cloudmatrix384(dies=4), trace=False)
    comm = Communicator(pod, list(range(ranks)))
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    x = (torch.randn(ranks, tokens, hidden, generator=g) * 3).to(torch.bfloat16)
    if special is not None and tokens:
        x[0, 0, 1] = special
    res = dispatch(comm, list(x), ids, num_experts=8, quant=quant, cores=2)
    h = res.handle
    for r in range(ranks):
        want = torch.stack([x[s, t] for s, t in zip(h.src_rank[r], h.src_token[r])]) if len(h.src_rank[r]) else \
            torch.zeros(0, hidden, dtype=torch.bfloat16)
        if quant:
            q, sc = quantize_per_token(want)
            assert torch.equal(res.x[r], q) and torch.equal(res.scales[r], sc)
        else:
            assert torch.equal(res.x[r].view(torch.int16), want.view(torch.int16))
    if quant:
        return
    out = combine(comm, h, [res.x[r] for r in range(ranks)], weights, out_dtype="fp32", cores=2)
    for r in range(ranks):
        idr = torch.as_tensor(np.asarray(ids[r]))
        w = torch.where(idr >= 0, torch.as_tensor(np.asarray(weights[r])), torch.zeros(()))
        ref = (w.sum(-1, keepdim=True).double() * x[r].double())
        got = out.out[r].double()
        bound = 1e-6 * (w.abs().sum(-1, keepdim=True).double() * x[r].double().abs()) + 1e-30
        assert torch.equal(torch.isnan(got), torch.isnan(ref)) and \
            ((got - ref).abs().nan_to_num(0.0) <= bound.nan_to_num(0.0) + ((got - ref).isinf())).all()
    _ = _torch


@SWEEP
@given(ranks=st.sampled_from([2, 4]), tokens=st.integers(0, 6), hidden=st.sampled_from([32, 64, 48]),
       topk=st.integers(1, 3), bad=st.sampled_from([None, "out_of_range", "float", "below_minus_one"]),
       quant=st.booleans(), special=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
       seed=st.integers(0, 2 ** 16))
def test_dispatch_combine(child, ranks, tokens, hidden, topk, bad, quant, special, seed):
    rng = np.random.default_rng(seed)
    ids = [np.array([rng.permutation(8)[:topk] for _ in range(tokens)], np.int64).reshape(tokens, topk)
           for _ in range(ranks)]
    for a in ids:
        a[rng.random(a.shape) < 0.2] = -1
    names = []
    if bad is not None and tokens:
        if bad == "float":
            ids[1] = ids[1] + 0.5
        else:
            ids[1][0, 0] = 8 if bad == "out_of_range" else -2
        names.append("topk_ids")
    if hidden % 32:
        names.append("hidden")
    if quant:
        special = None                       # int8 on the wire: finite rows only (a NaN row has no scale)
    weights = [rng.random((tokens, topk)).astype(np.float32) for _ in range(ranks)]
    check(child, moe_case, ranks, tokens, hidden, topk, ids, quant, special, weights, names=tuple(names))


# ---------------------------------------------------------------------------------------------- A2E / E2A
def a2e_case(B, K, ids, domain, expert_dies):
    from ascend_emu import Pod, cloudmatrix384
    from xccl import A2EGroup, a2e_reference
    rng = np.random.default_rng(B * 7 + K)
    pod = Pod(cloudmatrix384(dies=6), trace=False)
    grp = A2EGroup(pod, [[0, 1]], expert_dies, num_experts=6, hidden=64, cores=2)
    x = [rng.standard_normal((B, 64)).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(2)]
    w = [rng.random((B, K)).astype(np.float32) for _ in range(2)]
    h = grp.a2e(domain, x, ids, w)
    pod.synchronize()
    for e in range(3):
        h.expert_output(e).write(h.expert_input(e).numpy())
    o = grp.e2a(h)
    pod.synchronize()
    for a in range(2):
        ref = a2e_reference(x[a], ids[a], w[a]).astype(np.float64)
        got = o.result(a).astype(np.float64)
        wsum = np.where(np.asarray(ids[a]) >= 0, w[a], 0).sum(1, keepdims=True)
        assert np.all(np.abs(got - ref) <= 2.0 ** -8 * (wsum * np.abs(x[a].astype(np.float64)) + np.abs(ref)) + 1e-30)


@SWEEP
@given(B=st.integers(1, 4), K=st.integers(1, 3), bad=st.sampled_from([None, "out_of_range", "float"]),
       domain=st.sampled_from([0, 0, 1, 0.0]), dies=st.sampled_from(["ok", "float", "attention die"]),
       seed=st.integers(0, 2 ** 16))
def test_a2e_e2a(child, B, K, bad, domain, dies, seed):
    rng = np.random.default_rng(seed)
    ids = [np.stack([rng.permutation(6)[:K] for _ in range(B)]) for _ in range(2)]
    ids[0][0, -1] = -1
    names = []
    if bad == "out_of_range":
        ids[1][0, 0] = 6
        names.append("topk_ids")
    elif bad == "float":
        ids[1] = ids[1] + 0.25
        names.append("topk_ids")
    if domain != 0 or not isinstance(domain, int):
        names.append("domain")
    if dies != "ok":
        names += ["expert_dies", "distinct"]
    dies = {"ok": [2, 3, 4], "float": [2, 3, 4.0], "attention die": [2, 3, 1]}[dies]
    check(child, a2e_case, B, K, ids, domain, dies, names=tuple(names))


# ---------------------------------------------------------------------------------------------- expert service
def service_case(kw, ids):
    from ascend_emu import Pod, cloudmatrix384
    from xccl import ExpertService
    pod = Pod(cloudmatrix384(dies=8), trace=False, max_modeled_us=5000.0)
    svc = ExpertService(pod, [0, 1], [2, 3, 4], num_experts=6, hidden=64, top_k=2, max_tokens=4, phantom=True, **kw)
    res = svc.run(ids)
    assert (res.completions == 1).all() and not res.dead and res.resends.sum() == 0


@SWEEP
@given(field=st.sampled_from([None, "heartbeat_us", "dead_after_us", "poll_timeout_us", "replicas", "server_cores",
                              "monitor", "topk_ids"]),
       value=st.sampled_from([0.0, -1.0, 2.01, 2.5, float("nan"), 1e9]), seed=st.integers(0, 2 ** 16))
def test_expert_service(child, field, value, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(6)[:2] for _ in range(2 * 2 * 3)]).reshape(2, 2, 3, 2)
    from ascend_emu import cloudmatrix384
    from xccl.service import silence_bounds
    kw, names = {}, ()
    if field == "topk_ids":
        ids = ids + (0.5 if value > 0 else 6)
        names = ("topk_ids",)
    elif field is not None and field.endswith("_us"):
        kw[field] = value
        t = dict(dict(heartbeat_us=2.0, poll_timeout_us=6.0, dead_after_us=10.0), **kw)
        ok = all(0 < v < float("inf") for v in t.values())
        if ok:                                    # the windows against the modeled beat gap (monitor on die 5)
            member_us, read_us = silence_bounds(cloudmatrix384(dies=8), 5, t["heartbeat_us"])
            ok = t["poll_timeout_us"] > member_us and t["dead_after_us"] > member_us + read_us
        names = () if ok else tuple(k for k in ("heartbeat_us", "poll_timeout_us", "dead_after_us"))
    elif field is not None:
        kw[field] = value                         # a float count or die id: refused, never truncated
        names = (field,)
    check(child, service_case, kw, ids, names=names)
