"""FusedDispatch / FusedCombine: routing exactness, source identity, INT8 bounds, DeepEP's low-latency checks,
window alternation, and the race that separate double-buffered windows prevent."""
import numpy as np
import pytest
import torch

from ascend_emu import DTypeError, HazardError, Pod, cloudmatrix384
from kernels.fused_moe import (MoeGroup, collect_dispatch, combine_reference, dispatch_reference, launch_combine,
                               launch_dispatch, moe_distribute_combine, moe_distribute_dispatch)

R, BS, H, K, E = 4, 12, 256, 4, 16


def calc_diff(x, y):
    """DeepEP's similarity measure: 1 - 2<x, y> / (|x|^2 + |y|^2) in fp64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()


def routing(seed, bs=BS, masked=True):
    rng = np.random.default_rng(seed)
    ids = [np.stack([rng.choice(E, K, replace=False) for _ in range(bs)]) for _ in range(R)]
    if masked:
        ids[0][1, 2] = -1
        ids[2][3, :] = -1                                      # a token routed nowhere
    w = [rng.random((bs, K)).astype(np.float32) for _ in range(R)]
    return ids, w


def tokens(seed, bs=BS):
    """Rows that encode their source: column 0 = rank + 1, column 1 = token + 1 (exact in bf16), noise after."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for r in range(R):
        x = torch.randn(bs, H, generator=g)
        x[:, 0] = r + 1
        x[:, 1] = torch.arange(bs) + 1
        xs.append(x.to(torch.bfloat16))
    return xs


def group(quant=True, **kw):
    pod = Pod(cloudmatrix384(dies=R), trace=False)
    return MoeGroup(pod, range(R), max_bs=BS, hidden=H, topk=K, num_experts=E, quant=quant, cores=8, **kw)


@pytest.mark.parametrize("quant", [True, False], ids=["int8", "bf16"])
def test_dispatch_routing_counts_and_identity(quant):
    g = group(quant)
    x, (ids, _) = tokens(0), routing(0)
    res = moe_distribute_dispatch(x, ids, g)
    ref = dispatch_reference([xi.float().numpy() for xi in x], ids, E, R)
    for d in range(R):
        rows, ident, counts = ref[d]
        # per-expert receive counts equal the routing (torch bincount), prefix sums exact
        allids = torch.as_tensor(np.concatenate([i.reshape(-1) for i in ids]))
        allids = allids[allids >= 0]
        local = torch.bincount(allids, minlength=E)[d * g.epr:(d + 1) * g.epr].numpy()
        assert np.array_equal(res.expert_token_nums[d], local) and np.array_equal(counts, local)
        per = np.array([[np.sum(np.asarray(ids[s]) == d * g.epr + le) for s in range(R)] for le in range(g.epr)])
        assert np.array_equal(res.ep_recv_counts[d], np.cumsum(per.reshape(-1)))
        # every row carries its source identity, in expert-major / source-rank / (token, k) order
        assert np.array_equal(res.assist_info_for_combine[d], ident)
        got = res.expand_x[d].astype(np.float32)
        if quant:       # dequantised rows within half a quantisation step of the input
            deq = got * res.dynamic_scales[d][:, None]
            # (ties at exactly half a step round to even; allow fp32 rounding of q * scale)
            assert np.all(np.abs(deq - rows) <= res.dynamic_scales[d][:, None] * 0.5 + 1e-6 * np.abs(rows))
        else:           # bf16 travels bit-exact
            assert np.array_equal(got, rows)
            assert np.array_equal(got[:, 0] - 1, ident[:, 0]) and np.array_equal(got[:, 1] - 1, ident[:, 1])
        # the rows from each source rank form one contiguous block per expert
        ends = res.ep_recv_counts[d]
        starts = np.concatenate([[0], ends[:-1]])
        for i, (a, b) in enumerate(zip(starts, ends)):
            assert np.all(ident[a:b, 0] == i % R)


@pytest.mark.parametrize("quant, bound", [(True, 9e-4), (False, 1e-5)], ids=["int8", "bf16"])
def test_identity_experts_combine_to_the_weighted_sum(quant, bound):
    g = group(quant)
    x, (ids, w) = tokens(1), routing(1)
    shared = [(torch.randn(BS, H, generator=torch.Generator().manual_seed(r)) * 0.5).to(torch.bfloat16)
              for r in range(R)]
    d = moe_distribute_dispatch(x, ids, g)
    # identity experts: each expert returns what it received (dequantised), in bf16
    y = [torch.from_numpy(d.expand_x[r].astype(np.float32) * (d.dynamic_scales[r][:, None] if quant else 1))
         .to(torch.bfloat16) for r in range(R)]
    out, run = moe_distribute_combine(y, d, w, g, shared_expert_x=shared)
    ref = combine_reference([xi.float().numpy() for xi in x], ids, w, shared=[s.float().numpy() for s in shared])
    for r in range(R):
        assert calc_diff(out[r].astype(np.float32), ref[r]) < bound
    # masked entries are skipped: the token routed nowhere gets the shared expert alone
    assert np.array_equal(out[2][3].astype(np.float32), shared[2][3].float().numpy())
    assert run.kernel_us > 0


def test_a_call_that_runs_at_once_reads_its_bf16_inputs_in_place(monkeypatch):
    """moe_distribute_dispatch / combine run the pod themselves, so nothing can change their inputs meanwhile: bf16
    rows enter GM without a copy (to_gm(copy=False)); queued calls (stream=) copy them, as the host may still write
    them; rows of another dtype are converted. The outputs are the same either way."""
    g = group(True)
    copies = []
    real = g.pod.to_gm

    def to_gm(die, array, **kw):
        copies.append(kw.get("copy", True))
        return real(die, array, **kw)
    monkeypatch.setattr(g.pod, "to_gm", to_gm)
    x, (ids, w) = tokens(1), routing(1)
    d = moe_distribute_dispatch(x, ids, g)
    y = [torch.from_numpy(d.expand_x[r].astype(np.float32) * d.dynamic_scales[r][:, None]).to(torch.bfloat16)
         for r in range(R)]
    out, _ = moe_distribute_combine(y, d, w, g)
    assert copies == [False] * (2 * R)
    copies.clear()
    streams = [g._streams[die] for die in g.dies]
    pending = moe_distribute_dispatch([xi.float().numpy() for xi in x], ids, g, stream=streams)
    d2 = pending.collect(g.pod.synchronize())
    pending = moe_distribute_combine(y, d2, w, g, stream=streams)
    out2, _ = pending.collect(g.pod.synchronize())
    assert copies == [True] * (2 * R)
    for r in range(R):
        assert np.array_equal(d.expand_x[r], d2.expand_x[r])
        assert np.array_equal(out[r].view(np.int16), out2[r].view(np.int16))


def test_two_rounds_alternate_windows_and_repeat_identically():
    g = group(True)
    outs = []
    for rnd in range(2):
        x, (ids, w) = tokens(10 + rnd), routing(10 + rnd)
        d = moe_distribute_dispatch(x, ids, g)
        assert d.handle["half"] == rnd % 2
        y = [torch.from_numpy(d.expand_x[r].astype(np.float32) * d.dynamic_scales[r][:, None]).to(torch.bfloat16)
             for r in range(R)]
        out, run = moe_distribute_combine(y, d, w, g)
        ref = combine_reference([xi.float().numpy() for xi in x], ids, w)
        assert all(calc_diff(out[r].astype(np.float32), ref[r]) < 9e-4 for r in range(R))
        outs.append((out, run.kernel_us))
    # the same inputs on fresh groups give bit-identical outputs and modeled times, 20 times over
    x, (ids, w) = tokens(3), routing(3)
    seen = set()
    for _ in range(20):
        g = group(True)
        d = moe_distribute_dispatch(x, ids, g)
        y = [torch.from_numpy(d.expand_x[r].astype(np.float32)).to(torch.bfloat16) for r in range(R)]
        out, run = moe_distribute_combine(y, d, w, g)
        seen.add((b"".join(o.tobytes() for o in out), d.run.kernel_us, run.kernel_us))
    assert len(seen) == 1


def _race(double_buffer):
    """Rank 1 has a long assembly (ranks 0 and 3 send it everything) on one core, while rank 2, which holds only
    rank 1's last token, finishes its dispatch at once and runs ahead into combine, returning rows into rank 1."""
    h = 4096
    # A rank can be ahead of another by more than an operator's device start-up (a straggler die, uneven work);
    # rather than building a 50 us straggler, drop the start-up so this small schedule shows the same overlap
    pod = Pod(cloudmatrix384(dies=R, comm_start_us=0.0), trace=False)
    g = MoeGroup(pod, range(R), max_bs=BS, hidden=h, topk=K, num_experts=E, quant=False, cores=1,
                 double_buffer=double_buffer, mode="graph")
    gen = torch.Generator().manual_seed(5)
    x = [torch.randn(BS, h, generator=gen).to(torch.bfloat16) for _ in range(R)]
    to_rank1 = np.array([4, 5, 6, 7])                          # rank 1 owns experts 4..7
    ids = [np.tile(to_rank1, (BS, 1)), np.full((BS, K), -1), np.full((BS, K), -1), np.tile(to_rank1, (BS, 1))]
    ids[1][BS - 1] = [8, 9, 10, 11]                            # rank 1's last token goes to rank 2's experts
    w = [np.ones((BS, K), np.float32) for _ in range(R)]
    pending = launch_dispatch(x, ids, g)
    rows = [o.rows for o in pending["outs"]]
    y = [torch.ones(n, h).to(torch.bfloat16) if n else torch.zeros(0, h).to(torch.bfloat16) for n in rows]
    launch_combine(y, pending, w, g)
    run = g.pod.synchronize()
    res = collect_dispatch(pending, run)
    ref = dispatch_reference([xi.float().numpy() for xi in x], ids, E, R, quant=False)
    return [np.array_equal(res.expand_x[d].astype(np.float32), ref[d][0]) for d in range(R)]


def test_shared_window_corrupts_when_a_rank_runs_ahead():
    assert _race(double_buffer=True) == [True] * R             # separate windows: every rank's dispatch intact
    # one window: rank 2's combine rows land on records rank 1 has not assembled yet, identity words included
    with pytest.raises(HazardError, match="overwritten before it was read"):
        _race(double_buffer=False)


def test_timing_only_matches_numeric_and_quant_moves_fewer_bytes():
    x, (ids, w) = tokens(7), routing(7)
    a = moe_distribute_dispatch(x, ids, group(True))
    b = moe_distribute_dispatch(None, ids, group(True, phantom=True), numeric=False)
    assert a.run.kernel_us == b.run.kernel_us
    assert [np.array_equal(p, q) for p, q in zip(a.assist_info_for_combine, b.assist_info_for_combine)] == [True] * R
    c = moe_distribute_dispatch(x, ids, group(False))
    assert a.run.bytes_moved < 0.65 * c.run.bytes_moved


def test_float_expert_ids_and_duplicate_dies_are_rejected():
    """Before: expert_ids went through np.asarray(..., int64), so 2.7 silently routed to expert 2, and a die
    listed twice made two ranks share one die's windows."""
    g = group(True)
    x, (ids, _) = tokens(0), routing(0)
    bad = [i.astype(np.float64) for i in ids]
    bad[2][0, 0] += 0.7
    with pytest.raises(DTypeError, match=r"expert_ids\[0\] is float64"):
        moe_distribute_dispatch(x, bad, g)
    with pytest.raises(DTypeError, match=r"expert_ids\[0\] is torch.float32"):
        moe_distribute_dispatch(x, [torch.as_tensor(i).float() for i in ids], g)
    calls = g.calls
    res = moe_distribute_dispatch(x, [torch.as_tensor(i) for i in ids], g)     # int tensors are ids; the calls
    assert g.calls == calls + 1 and len(res.expert_token_nums) == R           # refused above did not count
    with pytest.raises(ValueError, match=r"dies=\[0, 0, 1, 2\]: die 0 is listed twice"):
        MoeGroup(g.pod, [0, 0, 1, 2], max_bs=4, hidden=64, topk=2, num_experts=16)


def test_bad_arguments_name_the_limit():
    g = group(True)
    x, (ids, _) = tokens(0), routing(0)
    bad = [i.copy() for i in ids]
    bad[1][0, 0] = E
    with pytest.raises(ValueError, match=f"outside -1..{E - 1}"):
        moe_distribute_dispatch(x, bad, g)
    with pytest.raises(ValueError, match="quant_mode=0"):
        moe_distribute_dispatch(x, ids, g, quant_mode=0)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        MoeGroup(g.pod, range(3), max_bs=4, hidden=64, topk=2, num_experts=16)
