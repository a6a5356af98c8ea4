"""Pull-based MoE dispatch / combine (xccl.moe): routing exactness, source identity of every row, INT8 on the wire,
weighted combine against torch, protocol failures (a silent peer, a foreign event id) and timing trends.

Tolerances: bf16 dispatch is bit-exact (a copy). INT8: |q * scale - x| <= scale / 2 per element (RNE), scale exactly
rowmax|x| / 127. Combine: the fp32 sum over k is a tree (its order differs from torch's), so the bf16 result may differ
from torch's fp32-then-bf16 by at most one bf16 ulp (2^-7 relative); fp32 output within 1e-6 relative.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_emu import DeadlockError, DTypeError, Pod, cloudmatrix384
from xccl.comm import M_FLAG, ArgumentError, Communicator, XcclError
from xccl.moe import combine, dispatch, prepare_dispatch

DIES = {2: [0, 1], 4: [0, 1, 16, 17]}          # same chip (d2d) and across servers (fabric)
CORES = 4


def make_comm(ranks, phantom=False):
    pod = Pod(cloudmatrix384(dies=18), trace=False)
    return Communicator(pod, DIES[ranks], phantom=phantom)


def make_inputs(ranks, tokens, hidden, experts, topk, seed=0, masked=0):
    """Tokens whose columns 0 and 1 hold (source rank, token index), DeepEP-style; distinct top-k experts; ``masked``
    random (token, k) entries set to -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ranks, tokens, hidden, generator=g)
    x[:, :, 0] = torch.arange(ranks)[:, None].float()
    x[:, :, 1] = torch.arange(tokens)[None, :].float()            # small integers: exact in bf16
    x = x.to(torch.bfloat16)
    ids = torch.rand(ranks, tokens, experts, generator=g).argsort(-1)[..., :topk]
    if masked:
        flat = ids.view(-1) if ids.is_contiguous() else None
        ids = ids.contiguous()
        flat = ids.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:masked]] = -1
    w = torch.rand(ranks, tokens, topk, generator=g) + 0.1
    return x, ids, w


def expected_rows(ids, owner, rank):
    """Independent reference of rank ``rank``'s output order: its experts ascending, then source rank, token, k."""
    rows = []
    for e in np.flatnonzero(owner == rank):
        for s in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                for k in range(ids.shape[2]):
                    if ids[s, t, k] == e:
                        rows.append((s, t, k, e))
    return rows


def bf16_bits(t):
    return t.contiguous().view(torch.int16)


# ---------------------------------------------------------------------------------------------- dispatch: routing
@pytest.mark.parametrize("ranks, placement", [(2, "default"), (4, "default"), (4, "permuted")])
def test_dispatch_rows_carry_source_identity_in_expert_major_order(ranks, placement):
    T, H, E, K = 16, 128, 16, 4
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=ranks, masked=7)
    if placement == "permuted":
        owner = np.random.default_rng(1).permutation(np.arange(E) % ranks)
    else:
        owner = np.arange(E) // (E // ranks)
    comm = make_comm(ranks)
    res = dispatch(comm, x, ids, num_experts=E, expert_placement=None if placement == "default" else owner,
                   cores=CORES)
    ids_np = ids.numpy()
    for d in range(ranks):
        ref = expected_rows(ids_np, owner, d)
        got = list(zip(res.handle.src_rank[d].tolist(), res.handle.src_token[d].tolist(),
                       res.handle.src_k[d].tolist()))
        assert got == [r[:3] for r in ref]
        out = res.x[d]
        assert out.shape == (len(ref), H) and out.dtype == torch.bfloat16
        src = torch.tensor([r[0] for r in ref], dtype=torch.long)
        tok = torch.tensor([r[1] for r in ref], dtype=torch.long)
        assert torch.equal(out[:, 0].float(), src.float())                 # the row says where it came from
        assert torch.equal(out[:, 1].float(), tok.float())
        if len(ref):
            assert torch.equal(bf16_bits(out), bf16_bits(x[src, tok]))     # bit-exact copy of the source row
        assert all(owner[r[3]] == d for r in ref)


def test_routing_counts_equal_torch_bincount():
    ranks, T, H, E, K = 4, 24, 64, 16, 4
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=3, masked=10)
    owner = np.arange(E) // (E // ranks)
    res = dispatch(make_comm(ranks), x, ids, num_experts=E, cores=CORES)
    valid = ids[ids >= 0]
    per_expert = torch.bincount(valid, minlength=E)
    for d in range(ranks):
        assert torch.equal(res.expert_counts[d], per_expert[torch.from_numpy(owner == d)])
        per_src = torch.tensor([int(torch.bincount(torch.from_numpy(owner)[ids[s][ids[s] >= 0]],
                                                   minlength=ranks)[d]) for s in range(ranks)])
        assert torch.equal(res.rank_counts[d], per_src)                    # what the metadata handshake delivered
        assert res.x[d].shape[0] == int(per_src.sum()) == int(res.expert_counts[d].sum())


def test_masked_entries_are_skipped():
    ranks, T, H, E, K = 2, 16, 64, 8, 4
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=5)
    ids[0, :, :] = -1                          # rank 0 sends nothing at all
    ids[1, 3, 1:] = -1
    res = dispatch(make_comm(ranks), x, ids, num_experts=E, cores=CORES)
    assert sum(r.shape[0] for r in res.x) == int((ids >= 0).sum())
    for d in range(ranks):
        assert (res.handle.src_rank[d] == 1).all()
        for s, t, k in zip(res.handle.src_rank[d], res.handle.src_token[d], res.handle.src_k[d]):
            assert ids[s, t, k] >= 0
        assert res.rank_counts[d][0] == 0


def test_token_with_two_experts_on_one_rank_is_sent_twice():
    """One row per (token, k): CANN / CloudMatrix semantics (documented in xccl.moe)."""
    ranks, H, E = 2, 64, 8
    x, _, _ = make_inputs(ranks, 2, H, E, 2, seed=6)
    ids = torch.tensor([[[0, 1], [4, 5]], [[2, 6], [7, 3]]])     # experts 0-3 on rank 0, 4-7 on rank 1
    res = dispatch(make_comm(ranks), x, ids, num_experts=E, cores=2)
    assert res.x[0].shape[0] == 4 and res.x[1].shape[0] == 4
    # rank 0: expert 0 <- (0, t0), expert 1 <- (0, t0), expert 2 <- (1, t0), expert 3 <- (1, t1)
    assert res.handle.src_token[0].tolist() == [0, 0, 0, 1] and res.handle.src_rank[0].tolist() == [0, 0, 1, 1]
    assert torch.equal(bf16_bits(res.x[0][0]), bf16_bits(res.x[0][1]))
    assert res.expert_counts[0].tolist() == [1, 1, 1, 1]


# ---------------------------------------------------------------------------------------------- dispatch: INT8
def test_int8_dispatch_dequantises_within_one_step():
    ranks, T, H, E, K = 4, 16, 256, 16, 4
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=7, masked=5)
    res = dispatch(make_comm(ranks), x, ids, num_experts=E, quant=True, cores=CORES)
    for d in range(ranks):
        q, s = res.x[d], res.scales[d]
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (q.shape[0],)
        src = x[torch.from_numpy(res.handle.src_rank[d]), torch.from_numpy(res.handle.src_token[d])].float()
        assert torch.equal(s, src.abs().amax(-1) / 127)                    # the scale travelled with its row
        err = (q.float() * s[:, None] - src).abs()
        assert (err <= s[:, None] * 0.5 * (1 + 1e-5)).all()                # half a step (+ fp32 rounding of q*s)
        q_ref = torch.round(src / s[:, None]).clamp(-128, 127).to(torch.int8)   # torch.round: half to even
        assert torch.equal(q, q_ref)


def test_int8_moves_fewer_bytes_than_bf16():
    ranks, T, H, E, K = 4, 32, 1024, 16, 4
    _, ids, _ = make_inputs(ranks, T, 64, E, K, seed=8)
    fabric = {}
    for quant in (False, True):
        run = dispatch(make_comm(ranks, phantom=True), (T, H), ids, num_experts=E, quant=quant, cores=CORES,
                       numeric=False).run
        fabric[quant] = sum(v["bytes"] for k, v in run.servers.items() if ".rx" in k)
    pairs_remote = fabric[False] / (2 * H)
    assert fabric[True] == pytest.approx(pairs_remote * (H + 32))          # int8 row + 32-byte scale block
    assert fabric[True] < 0.6 * fabric[False]


# ---------------------------------------------------------------------------------------------- combine
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
def test_dispatch_combine_identity_experts_reproduce_weighted_sum(out_dtype):
    ranks, T, H, E, K = 4, 16, 128, 16, 4
    x, ids, w = make_inputs(ranks, T, H, E, K, seed=9, masked=6)
    comm = make_comm(ranks)
    d = dispatch(comm, x, ids, num_experts=E, cores=CORES)
    w_nan = w.clone()
    w_nan[ids < 0] = float("nan")                                          # masked weights are never read
    c = combine(comm, d.handle, d.x, w_nan, out_dtype=out_dtype, cores=CORES)
    ref = ((w * (ids >= 0)).sum(-1, keepdim=True) * x.float())
    for r in range(ranks):
        got = c.out[r]
        assert got.shape == (T, H)
        if out_dtype == "bf16":
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), ref[r].to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)
        else:
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, ref[r], rtol=1e-6, atol=0)


def test_combine_returns_each_expert_row_to_its_token_and_slot():
    """Experts that scale by (expert id + 1): a row returned to the wrong (token, k) slot changes the sum."""
    ranks, T, H, E, K = 4, 12, 64, 8, 3
    x, ids, w = make_inputs(ranks, T, H, E, K, seed=10, masked=4)
    comm = make_comm(ranks)
    d = dispatch(comm, x, ids, num_experts=E, cores=CORES)
    ys = []
    for r in range(ranks):
        s, t, k = (torch.from_numpy(a) for a in (d.handle.src_rank[r], d.handle.src_token[r], d.handle.src_k[r]))
        e = ids[s, t, k]
        ys.append((d.x[r].float() * (e[:, None] + 1).float()).to(torch.bfloat16))
    c = combine(comm, d.handle, ys, w, cores=CORES)
    y_ref = x.float()[:, :, None, :] * (ids[..., None] + 1).float()       # [R, T, K, H]
    y_ref = y_ref.to(torch.bfloat16).float() * (w * (ids >= 0))[..., None]
    ref = y_ref.sum(2)
    for r in range(ranks):
        torch.testing.assert_close(c.out[r].float(), ref[r].to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)


def test_results_and_times_identical_over_repeated_runs():
    ranks, T, H, E, K = 4, 16, 128, 16, 4
    x, ids, w = make_inputs(ranks, T, H, E, K, seed=11, masked=3)
    runs = []
    for _ in range(2):
        comm = make_comm(ranks)
        outs = []
        for _ in range(2):                                                 # the same communicator, next rounds
            d = dispatch(comm, x, ids, num_experts=E, quant=True, cores=CORES)
            deq = [(q.float() * s[:, None]).to(torch.bfloat16) for q, s in zip(d.x, d.scales)]
            c = combine(comm, d.handle, deq, w, cores=CORES)
            outs.append(([q.clone() for q in d.x], [o.clone() for o in c.out], d.run.modeled_us, c.run.modeled_us))
        runs.append(outs)
    for a, b in [(runs[0][0], runs[0][1]), (runs[0][0], runs[1][0]), (runs[0][1], runs[1][1])]:
        assert all(torch.equal(p, q) for p, q in zip(a[0], b[0]))
        assert all(torch.equal(bf16_bits(p), bf16_bits(q)) for p, q in zip(a[1], b[1]))
    assert runs[0][0][2:] == runs[1][0][2:] and runs[0][1][2:] == runs[1][1][2:]


def test_metadata_is_published_only_after_the_window_writes_are_visible():
    """Slow mtu-out (1 byte per cycle): the window writes land long after they are issued. A field published
    before they land would let the receivers pull stale rows."""
    ranks, T, H, E, K = 2, 16, 256, 8, 4
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=19)
    pod = Pod(cloudmatrix384(dies=2, ub_to_hbm_bytes_per_cycle=1), trace=False)
    res = dispatch(Communicator(pod, [0, 1]), x, ids, num_experts=E, cores=2)
    for d in range(ranks):
        src = x[torch.from_numpy(res.handle.src_rank[d]), torch.from_numpy(res.handle.src_token[d])]
        assert torch.equal(bf16_bits(res.x[d]), bf16_bits(src))


# ---------------------------------------------------------------------------------------------- protocol failures
def test_peer_that_never_publishes_raises_deadlock_naming_die_and_field():
    ranks, T, H, E, K = 4, 8, 64, 16, 2
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=12)
    comm = make_comm(ranks)
    prep = prepare_dispatch(comm, x, ids, num_experts=E, cores=2)
    with pytest.raises(DeadlockError) as ei:
        prep.launch(dies=comm.dies[:3], wait_timeout_us=50.0)              # rank 3 (die 17) never runs
    msg = str(ei.value)
    assert "wait bound exceeded" in msg and "xccl_dispatch" in msg
    assert "wait_gm on xccl.moe_meta" in msg                               # the metadata field polled
    assert any(f"die {d} aiv" in msg for d in comm.dies[:3])               # a waiting core of a live rank
    assert "eq 1" in msg


def test_dispatch_then_combine_on_a_subset_deadlocks_in_combine():
    ranks, T, H, E, K = 2, 8, 64, 8, 2
    x, ids, w = make_inputs(ranks, T, H, E, K, seed=13)
    comm = make_comm(ranks)
    d = dispatch(comm, x, ids, num_experts=E, cores=2)
    with pytest.raises(DeadlockError) as ei:
        combine(comm, d.handle, d.x, w, cores=2, dies=[comm.dies[0]], wait_timeout_us=30.0)
    msg = str(ei.value)
    assert "xccl_combine" in msg and "die 0 aiv" in msg and "xccl.moe_meta0" in msg


def test_field_with_foreign_event_id_raises_xccl_error():
    ranks, T, H, E, K = 2, 8, 64, 8, 2
    x, ids, _ = make_inputs(ranks, T, H, E, K, seed=14)
    comm = make_comm(ranks)
    prep = prepare_dispatch(comm, x, ids, num_experts=E, cores=2, event_id=7)
    # a stale writer: rank 1's field on rank 0 carries the current flag but another op's event id
    comm.moe_meta[comm.dies[0]][1].write(np.array([99, 0, prep.plan.counts[1, 0], 0, 0, 0, 0, 0], np.int32))
    comm.moe_meta[comm.dies[0]][1, M_FLAG:M_FLAG + 1].write(prep.job.round)
    with pytest.raises(XcclError) as ei:
        prep.launch(dies=[comm.dies[0]], wait_timeout_us=50.0)
    assert "event id 99" in str(ei.value) and "expected 7" in str(ei.value) and "rank 1" in str(ei.value)


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=6), "multiple of the 4 ranks"),
    (dict(num_experts=16, expert_placement=np.zeros(15, int)), "one per expert"),
    (dict(num_experts=16, expert_placement=np.full(16, 4)), "ranks are 0..3"),
    (dict(num_experts=16, cores=49), "cores=49"),
])
def test_bad_arguments_name_the_argument_and_limit(kw, match):
    x, ids, _ = make_inputs(4, 8, 64, 16, 2, seed=15)
    with pytest.raises(ArgumentError, match=match):
        dispatch(make_comm(4), x, ids, **kw)


def test_bad_inputs():
    x, ids, _ = make_inputs(4, 8, 64, 16, 2, seed=16)
    comm = make_comm(4)
    bad = ids.clone()
    bad[2, 0, 0] = 16
    with pytest.raises(ArgumentError, match=r"topk_ids\[2\] holds expert 16"):
        dispatch(comm, x, bad, num_experts=16)
    with pytest.raises(ArgumentError, match="bf16"):
        dispatch(comm, x.float(), ids, num_experts=16)
    with pytest.raises(ArgumentError, match="3 per-rank entries"):
        dispatch(comm, x[:3], ids, num_experts=16)


def test_non_integer_expert_ids_and_event_ids_are_rejected():
    """Before: float ids were truncated (3.7 routed to expert 3) and event id 7.9 travelled as 7."""
    x, ids, w = make_inputs(4, 8, 64, 16, 2, seed=18)
    comm = make_comm(4)
    with pytest.raises(DTypeError, match=r"topk_ids\[0\] is torch.float32"):
        dispatch(comm, x, ids.float() + 0.7, num_experts=16)
    with pytest.raises(DTypeError, match=r"topk_ids\[1\] is float64"):
        dispatch(comm, x, [ids[0].numpy(), ids[1].numpy() + 0.5, ids[2].numpy(), ids[3].numpy()], num_experts=16)
    with pytest.raises(DTypeError, match="expert_placement"):
        dispatch(comm, x, ids, num_experts=16, expert_placement=np.arange(16) // 4 + 0.2)
    with pytest.raises(ArgumentError, match="event_id=7.9"):
        dispatch(comm, x, ids, num_experts=16, event_id=7.9)
    res = dispatch(comm, x, ids.int(), num_experts=16, event_id=np.int64(7))      # int32 ids are ids
    out = combine(comm, res.handle, res.x, w, event_id=8)
    with pytest.raises(ArgumentError, match="event_id=8.5"):
        combine(comm, res.handle, res.x, w, event_id=8.5)
    assert len(out.out) == 4


# ---------------------------------------------------------------------------------------------- timing trends
def _timing(tokens, hidden, quant=True, ranks=4):
    g = torch.Generator().manual_seed(17)
    ids = torch.rand(ranks, tokens, 16, generator=g).argsort(-1)[..., :4]
    comm = make_comm(ranks, phantom=True)
    d = dispatch(comm, (tokens, hidden), ids, num_experts=16, quant=quant, cores=8, numeric=False)
    c = combine(comm, d.handle, None, None, cores=8, numeric=False)
    return d.run.kernel_us, c.run.kernel_us


def test_modeled_time_grows_with_tokens_and_hidden():
    """8x the tokens or the hidden size: the bytes, not the kernels' fixed start and sync costs, then decide."""
    base = _timing(32, 512)
    more_tokens = _timing(256, 512)
    wider = _timing(32, 4096)
    for i in range(2):                 # dispatch, combine
        assert more_tokens[i] > 1.3 * base[i]
        assert wider[i] > 1.3 * base[i]


def test_timing_only_matches_numeric_modeled_time():
    ranks, T, H, E, K = 4, 16, 128, 16, 4
    x, ids, w = make_inputs(ranks, T, H, E, K, seed=18)
    d1 = dispatch(make_comm(ranks), x, ids, num_experts=E, quant=True, cores=CORES)
    d2 = dispatch(make_comm(ranks, phantom=True), (T, H), ids, num_experts=E, quant=True, cores=CORES,
                  numeric=False)
    assert d1.run.modeled_us == d2.run.modeled_us and d2.x is None
