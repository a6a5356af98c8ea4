"""Scheduler: PD rank mapping, DP group choice (kv vs round robin), reservations, batch limits, step plans."""
import math

import pytest

from ascend_emu.errors import ArgumentError
from serving.engine import Engine
from serving.request import Request, RequestState, SamplingParams
from serving.scheduler import Scheduler, pd_source_rank

from .fakes import FakeRunner, reference


# ---- PD rank mapping --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill_tp, decode_tp, decode_dp, dp_rank, tp_rank, source", [
    (1, 1, 1, 0, 0, 0),
    (2, 2, 4, 3, 1, 1),          # ratio 1: every decode rank reads the same-TP-rank prefill rank
    (4, 1, 8, 0, 0, 0),          # ratio 4: decode DP ranks in pairs per prefill rank
    (4, 1, 8, 1, 0, 0),
    (4, 1, 8, 2, 0, 1),
    (4, 1, 8, 7, 0, 3),
    (8, 2, 8, 5, 1, 5),          # group 5 // 2 = 2 -> 2 * 2 + 1
    (16, 4, 32, 31, 3, 15),      # group 31 // 8 = 3 -> 3 * 4 + 3
    (4, 2, 2, 1, 0, 2),          # ratio 2, decode_dp / ratio = 1
])
def test_pd_source_rank_table(prefill_tp, decode_tp, decode_dp, dp_rank, tp_rank, source):
    assert pd_source_rank(dp_rank, tp_rank, prefill_tp=prefill_tp, decode_tp=decode_tp,
                          decode_dp=decode_dp) == source


def test_pd_source_rank_is_balanced():
    srcs = [pd_source_rank(d, t, prefill_tp=8, decode_tp=2, decode_dp=8) for d in range(8) for t in range(2)]
    assert sorted(set(srcs)) == list(range(8)) and all(srcs.count(s) == 2 for s in range(8))


@pytest.mark.parametrize("args, match", [
    (dict(prefill_tp=2, decode_tp=4, decode_dp=4), "multiple of decode_tp"),      # ratio < 1
    (dict(prefill_tp=6, decode_tp=4, decode_dp=4), "multiple of decode_tp"),
    (dict(prefill_tp=4, decode_tp=1, decode_dp=6), "decode_dp=6 must be a multiple"),
    (dict(prefill_tp=0, decode_tp=1, decode_dp=1), "prefill_tp"),
])
def test_pd_source_rank_errors(args, match):
    with pytest.raises(ArgumentError, match=match):
        pd_source_rank(0, 0, **args)


def test_pd_source_rank_range_errors():
    with pytest.raises(ArgumentError, match="decode_dp_rank=8"):
        pd_source_rank(8, 0, prefill_tp=4, decode_tp=1, decode_dp=8)
    with pytest.raises(ArgumentError, match="decode_tp_rank=2"):
        pd_source_rank(0, 2, prefill_tp=4, decode_tp=2, decode_dp=8)


# ---- placement ---------------------------------------------------------------------------------------------------
def sched(groups=2, *, num_blocks=32, max_batch=4, token_budget=64, policy="kv", **kw):
    return Scheduler(range(groups), num_groups=groups, num_blocks=num_blocks, block_size=16, max_batch=max_batch,
                     token_budget=token_budget, policy=policy, **kw)


def req(rid, prompt_len, max_tokens, first=1):
    return Request(rid=rid, prompt=list(range(first, first + prompt_len)), params=SamplingParams(max_tokens))


def test_unknown_policy():
    with pytest.raises(ArgumentError, match="policy='lru'"):
        sched(policy="lru")


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_batch_limit_excludes_groups(policy):
    s = sched(max_batch=1, policy=policy)
    rs = [req(i, 8, 4) for i in range(3)]
    for r in rs:
        s.add(r)
    s.admit_waiting(0.0)
    assert sorted(r.group for r in rs[:2]) == [0, 1]
    assert rs[2].state is RequestState.WAITING and s.waiting == [rs[2]]


@pytest.mark.parametrize("policy", ["kv", "round_robin"])
def test_reservation_covers_prompt_plus_max_tokens(policy):
    s = sched(num_blocks=8, max_batch=8, policy=policy)
    rs = [req(i, 16, 100) for i in range(3)]     # 115 positions -> 8 blocks: a whole group each
    for r in rs:
        s.add(r)
    s.admit_waiting(0.0)
    assert [r.group for r in rs] == [0, 1, None]
    assert s.next_time(0.0) == 0.0                # the two placed requests can run
    small = req(3, 4, 2)
    s.add(small)
    s.admit_waiting(0.0)
    assert small.group is None                    # first come first served: waits behind request 2


def test_round_robin_cycles_kv_balances():
    rr, kv = sched(3, policy="round_robin"), sched(3, policy="kv")
    sizes = [200, 8, 8, 8, 8, 8]                  # one long request, then short ones
    for s in (rr, kv):
        for i, n in enumerate(sizes):
            s.add(req(i, n, 60 if n > 100 else 4))
        s.admit_waiting(0.0)
    assert [r.rid for g in rr.alive for r in rr.running[g]] == [0, 3, 1, 4, 2, 5]
    # kv: the long request's group gets nothing more while the others are lighter
    assert [r.rid for r in kv.running[0]] == [0]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_kv_policy_counts_cached_prefix(prefix_cache):
    s = sched(2, prefix_cache=prefix_cache)
    shared = list(range(1, 49))                   # 3 full blocks
    a = Request(rid=0, prompt=shared + [7], params=SamplingParams(4))
    s.add(a)
    s.admit_waiting(0.0)
    a.num_computed = 49
    s._work(a, [], 0)                             # allocate its 4 blocks
    s.commit_full_blocks(a)
    c = req(1, 40, 4, first=500)                  # 3 blocks on the other group
    s.add(c)
    s.admit_waiting(0.0)
    assert (a.group, c.group) == (0, 1)
    b = Request(rid=2, prompt=shared + [9, 9], params=SamplingParams(4))   # 4 blocks, 3 of them cached in group 0
    s.add(b)
    s.admit_waiting(0.0)
    if prefix_cache:   # group 0: 4 held + 1 new = 5 < group 1: 3 + 4 = 7
        assert b.group == 0 and b.block_table == a.block_table[:3] and b.num_computed == 48
        assert all(s.pools[0].ref_count(x) == 2 for x in b.block_table)
    else:              # group 0: 4 + 4 = 8 > group 1: 7
        assert b.group == 1 and b.block_table == [] and b.num_computed == 0


def test_plan_decode_first_then_prefill_chunks_within_budget():
    s = sched(1, token_budget=20)
    dec = req(0, 5, 8)
    s.add(dec)
    s.admit_waiting(0.0)
    dec.output, dec.num_computed = [42], 5          # decoding: the last token is not in the KV yet
    s._work(dec, [0] * 5, 0)
    pre = req(1, 40, 8, first=100)
    s.add(pre)
    chunks = []
    while True:
        groups, items = s.plan(0.0)
        assert sum(len(w.tokens) for w in groups[0]) <= 20
        assert items[0][0] is dec and items[0][1].tokens == [42] and items[0][1].start_pos == 5
        work = [w for r, w, _ in items if r is pre]
        if not work:
            break
        w = work[0]
        assert w.start_pos == pre.num_computed and w.tokens == pre.prompt[w.start_pos:w.start_pos + len(w.tokens)]
        chunks.append((len(w.tokens), w.want))
        pre.num_computed += len(w.tokens)
        if w.want:
            break
    assert chunks == [(19, 0), (19, 0), (2, 1)]


def test_next_time_waits_for_arrivals():
    s = sched(1)
    r = Request(rid=0, prompt=[1, 2], params=SamplingParams(2), arrival_us=750.0)
    s.add(r)
    assert s.next_time(0.0) == 750.0
    assert s.plan(0.0)[1] == [] and r.group is None
    assert s.next_time(800.0) == 800.0 and s.plan(800.0)[1][0][0] is r


def test_drop_group_requeues_moved_first():
    s = sched(2, max_batch=1)
    rs = [req(i, 8, 4) for i in range(3)]
    for r in rs:
        s.add(r)
    s.admit_waiting(0.0)
    victim = rs[0] if rs[0].group == 1 else rs[1]
    moved = s.drop_group(1, 123.0)
    assert moved == [victim] and victim.group is None and victim.num_computed == 0 and victim.ready_us == 123.0
    assert s.alive == [0] and 1 not in s.pools
    s.add(victim)
    assert s.waiting[0] is victim                  # moved requests go ahead of new ones
    with pytest.raises(ArgumentError, match="not a live group"):
        s.drop_group(1, 0.0)


# ---- DP load balancing, end to end --------------------------------------------------------------------------------
def skewed_run(policy):
    runner = FakeRunner(num_groups=2, num_blocks=128)
    eng = Engine(runner, max_batch=8, token_budget=512, policy=policy)
    prompts, params = [], []
    for i in range(16):                            # long, short, long, short, ...: round robin piles up the longs
        long = i % 2 == 0
        prompts.append([i + 1] * (160 if long else 16))
        params.append(SamplingParams(max_tokens=48 if long else 4))
    res = eng.generate(prompts, params)
    for p, sp, r in zip(prompts, params, res.requests):
        assert r.output_tokens == reference(p, sp.max_tokens)
    spread = [max(s.kv_usage.values()) - min(s.kv_usage.values()) for s in eng.trace]
    mean = sum(spread) / len(spread)
    std = math.sqrt(sum(sum((u - sum(s.kv_usage.values()) / 2) ** 2 for u in s.kv_usage.values()) / 2
                        for s in eng.trace) / len(eng.trace))
    assert res.metrics.mean_kv_spread == pytest.approx(mean)
    return mean, std


def test_kv_policy_lowers_kv_spread_vs_round_robin():
    kv_spread, kv_std = skewed_run("kv")
    rr_spread, rr_std = skewed_run("round_robin")
    assert kv_spread < 0.3 * rr_spread and kv_std < 0.3 * rr_std, (kv_spread, rr_spread)
