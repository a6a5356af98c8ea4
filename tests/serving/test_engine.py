"""Engine end to end on the fake runner: tokens equal plain greedy decoding under chunking, prefix reuse, MTP, PD
disaggregation with back-pressure and die failures; token budget, lock-step batches, metrics on the modeled clock."""
import random

import pytest

from ascend_emu.errors import ArgumentError, CapacityError, DeadlockError, FaultError
from serving.engine import Engine, PDConfig
from serving.request import SamplingParams

from .fakes import FakeRunner, reference


def workload(n=12, seed=0, max_prompt=90, max_out=40):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, max_prompt))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, max_out)) for _ in prompts]
    return prompts, params


def outputs(res):
    return [r.output_tokens for r in res.requests]


def refs(prompts, params):
    return [reference(p, sp.max_tokens, sp.eos_token_id) for p, sp in zip(prompts, params)]


# ---- plain runs -------------------------------------------------------------------------------------------------
def test_ragged_prompts_match_reference_and_respect_budget():
    prompts = [[5], list(range(16)), list(range(17)), list(range(300, 431)), [9] * 33, list(range(40, 47))]
    params = [SamplingParams(max_tokens=m) for m in (1, 7, 16, 20, 3, 30)]
    runner = FakeRunner(num_groups=3, num_blocks=64)
    eng = Engine(runner, max_batch=3, token_budget=24)
    res = eng.generate(prompts, params)
    assert outputs(res) == refs(prompts, params)
    assert all(r.finish_reason == "length" for r in res.requests)
    for batch in runner.calls:                               # lock-step: a list per group, each within the budget
        assert len(batch.groups) == 3 and not batch.prefill
        assert all(sum(len(w.tokens) for w in ws) <= 24 for ws in batch.groups)
        assert all(len(ws) <= 3 for ws in batch.groups)
    assert [s.group_tokens for s in eng.trace] == [[sum(len(w.tokens) for w in ws) for ws in b.groups]
                                                   for b in runner.calls]
    assert max(max(s.group_tokens) for s in eng.trace) == 24  # chunked prefill fills the budget
    # every block returned: only cached-but-free blocks remain
    assert all(p.num_used == 0 for p in eng._decode.sched.pools.values())


def test_eos_stops_unless_ignored():
    prompt = list(range(30))
    ref = reference(prompt, 20)
    eos = ref[5]
    assert eos not in ref[:5]
    res = Engine(FakeRunner(1)).generate([prompt, prompt], [SamplingParams(20, eos_token_id=eos),
                                                           SamplingParams(20, eos_token_id=eos, ignore_eos=True)])
    assert res.requests[0].output_tokens == ref[:6] and res.requests[0].finish_reason == "stop"
    assert res.requests[1].output_tokens == ref and res.requests[1].finish_reason == "length"


def test_deterministic():
    prompts, params = workload()
    a, b = (Engine(FakeRunner(3), max_batch=4, token_budget=32) for _ in range(2))
    ra, rb = a.generate(prompts, params), b.generate(prompts, params)
    assert ra == rb and a.trace == b.trace


# ---- prefix reuse -----------------------------------------------------------------------------------------------
def first_work(runner, rid):
    return next(w for b in runner.calls for ws in b.groups for w in ws if w.rid == rid)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefix_reuse_skips_cached_full_blocks(prefix_cache):
    shared = list(range(100, 140))                               # 40 tokens: 2 full blocks of 16 + 8
    pa, pb, pc = shared + [1, 2, 3], shared + [7] * 10, shared[:32]
    runner = FakeRunner(num_groups=1)
    eng = Engine(runner, prefix_cache=prefix_cache)
    eng.add_request(pa, SamplingParams(4))
    eng.run()
    eng.add_request(pb, SamplingParams(6), arrival_us=eng.clock_us)
    eng.add_request(pc, SamplingParams(3), arrival_us=eng.clock_us)
    res = eng.run()
    assert outputs(res) == [reference(pa, 4), reference(pb, 6), reference(pc, 3)]
    wb, wc = first_work(runner, 1), first_work(runner, 2)
    if prefix_cache:
        assert (wb.start_pos, wb.tokens) == (32, pb[32:])        # only full blocks are reused
        # a fully cached prompt still recomputes its last block (the last position must produce a token)
        assert (wc.start_pos, wc.tokens) == (16, pc[16:])
        assert wb.block_table[:2] == first_work(runner, 0).block_table[:2]
    else:
        assert wb.start_pos == 0 and wc.start_pos == 0


def test_concurrent_sharers_do_not_corrupt_each_other():
    """Many requests sharing a long prefix with different suffixes, arriving over time on 2 groups."""
    base = list(range(500, 600))
    prompts = [base[:60 + 7 * i] + [i] * (i % 5 + 1) for i in range(10)]
    params = [SamplingParams(max_tokens=5 + 3 * i) for i in range(10)]
    runner = FakeRunner(num_groups=2, num_blocks=48)
    eng = Engine(runner, max_batch=3, token_budget=40)
    res = eng.generate(prompts, params, arrival_us=[1500.0 * i for i in range(10)])
    assert outputs(res) == refs(prompts, params)
    assert sum(first_work(runner, i).start_pos > 0 for i in range(10)) >= 5


# ---- MTP --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mtp, chunked", [(1, None), (2, None), (1, True)])
def test_mtp_matches_plain_decoding(mtp, chunked):
    prompts, params = workload(n=10, max_out=60)
    plain = Engine(FakeRunner(2), max_batch=4, token_budget=100).generate(prompts, params)
    runner = FakeRunner(2, num_drafts=mtp, draft_accuracy=0.7)
    eng = Engine(runner, max_batch=4, token_budget=100, mtp=mtp, chunked_prefill=chunked)
    res = eng.generate(prompts, params)
    assert outputs(res) == outputs(plain) == refs(prompts, params)
    chunks = [w for b in runner.calls for ws in b.groups for w in ws if w.want == 0]
    assert bool(chunks) == bool(chunked)          # MTP prefills whole prompts unless chunking is asked for
    m = res.metrics
    sent = sum(s for s, _ in runner.verified)
    accepted = sum(a for _, a in runner.verified)
    assert m.acceptance_rate == accepted / sent                # the engine's count equals the fake's ground truth
    expected = 0.7 if mtp == 1 else (0.7 + 0.7 ** 2) / 2      # a draft is kept only if the ones before it were
    assert m.acceptance_rate == pytest.approx(expected, abs=0.1)
    assert 1.3 < m.tokens_per_step < 1 + mtp
    assert m.num_steps < plain.metrics.num_steps


def test_mtp_without_chunking_needs_prompts_within_budget():
    eng = Engine(FakeRunner(1, num_drafts=1), max_batch=2, token_budget=32, mtp=1)
    with pytest.raises(CapacityError, match="prompt of 40 tokens exceeds token_budget=32"):
        eng.add_request([1] * 40)
    eng.add_request([1] * 30, SamplingParams(20))
    eng.add_request([2] * 30, SamplingParams(20))         # waits for room: prefills are never split
    eng.run()
    for b in eng.runner.calls:
        assert all(w.want > 0 for ws in b.groups for w in ws)


def test_mtp_token_budget_must_cover_drafts():
    with pytest.raises(ArgumentError, match="token_budget=8 must be an int >= max_batch \\* \\(1 \\+ mtp\\) = 16"):
        Engine(FakeRunner(1), max_batch=8, token_budget=8, mtp=1)


# ---- prefill/decode disaggregation ------------------------------------------------------------------------------
def test_pd_tokens_transfers_and_sides():
    prompts, params = workload(n=10)
    runner = FakeRunner(num_groups=4, num_blocks=64)
    eng = Engine(runner, max_batch=4, token_budget=48, pd=PDConfig(prefill_groups=[0, 1], decode_groups=[2, 3]))
    res = eng.generate(prompts, params)
    assert outputs(res) == refs(prompts, params)
    for b in runner.calls:                                       # each side only runs its own groups
        busy = {g for g, ws in enumerate(b.groups) if ws}
        assert busy <= ({0, 1} if b.prefill else {2, 3})
    multi = [r.rid for r in res.requests if len(r.output_tokens) > 1]
    assert sorted(t.rid for t in eng.transfers) == multi       # one transfer per request that decodes
    for t in eng.transfers:
        assert t.src_group in (0, 1) and t.dst_group in (2, 3) and t.start_us >= t.ready_us
        assert t.copy_us == 10.0 * t.num_blocks
    for r in res.requests:                                       # first token comes from the prefill side
        assert r.ttft_ms > 0 and r.finish_us >= r.first_token_us


def test_pd_back_pressure_holds_requests():
    prompts = [[i + 1] * 40 for i in range(8)]
    params = [SamplingParams(max_tokens=24)] * 8                 # 63 positions -> 4 blocks each
    runner = FakeRunner(num_groups=4, num_blocks=8)              # decode group: room for 2 requests at a time
    eng = Engine(runner, max_batch=8, token_budget=128, pd=PDConfig([0, 1, 2], [3]))
    res = eng.generate(prompts, params)
    assert outputs(res) == refs(prompts, params)                # all complete, nothing dropped or duplicated
    m = res.metrics
    assert m.num_backpressured == 6 and len(eng.transfers) == 8
    assert max(t.start_us - t.ready_us for t in eng.transfers) > 10_000   # some waited for many decode steps
    order = [t.rid for t in eng.transfers]                       # first come, first served
    assert order == sorted(order, key=lambda rid: (next(t.ready_us for t in eng.transfers if t.rid == rid), rid))
    decode_batches = [b for b in runner.calls if not b.prefill]
    assert max(len(b.groups[3]) for b in decode_batches) == 2    # never more than the blocks allow


# ---- faults -----------------------------------------------------------------------------------------------------
def run_with(failures, **kw):
    prompts, params = workload(n=12, seed=3)
    runner = FakeRunner(num_groups=kw.pop("num_groups", 4), failures=failures,
                        num_drafts=kw.get("mtp", 0), num_blocks=kw.pop("num_blocks", 64))
    # without chunked prefill (MTP), a recompute of prompt + generated tokens must fit one step's budget
    eng = Engine(runner, max_batch=4, token_budget=128 if kw.get("mtp") else 32, **kw)
    return eng, runner, eng.generate(prompts, params), refs(prompts, params)


@pytest.mark.parametrize("mtp", [0, 2])
def test_die_failure_colocated_same_tokens(mtp):
    eng, runner, res, ref = run_with([(12, 1)], mtp=mtp)
    assert eng.num_failures == 1 and runner.dropped == {1}
    assert outputs(res) == ref                                   # no token lost or duplicated
    moved = [r for r in res.requests if r.num_recomputes]
    assert moved and all(len(r.output_tokens) == len(f) for r, f in zip(res.requests, ref))
    failed = runner.calls.index(next(b for b in runner.calls if b.groups[1] and runner.calls.index(b) >= 12))
    # the step is re-executed (same step number) on the survivors
    assert runner.calls[failed + 1].step == runner.calls[failed].step and not runner.calls[failed + 1].groups[1]


def test_die_failures_pd_both_sides():
    eng, runner, res, ref = run_with([(6, 0), (20, 2)], pd=PDConfig([0, 1], [2, 3]), mtp=1)
    assert eng.num_failures == 2 and runner.dropped == {0, 2}
    assert outputs(res) == ref
    assert any(r.num_recomputes for r in res.requests)


def test_failure_without_group_is_retried():
    class Flaky(FakeRunner):
        def execute(self, batch):
            if len(self.calls) == 3:
                self.calls.append(batch)
                from serving.batch import DieFailure
                raise DieFailure(die=99, group=None)
            return super().execute(batch)
    prompts, params = workload(n=4)
    eng = Engine(Flaky(2), max_batch=4, token_budget=32)
    assert outputs(eng.generate(prompts, params)) == refs(prompts, params) and eng.num_failures == 1


def test_last_group_failure_is_a_fault():
    with pytest.raises(FaultError, match="last live colocated group"):
        run_with([(2, 0)], num_groups=1)


# ---- metrics ----------------------------------------------------------------------------------------------------
def test_metrics_hand_computed():
    """Step time = 1000 + 100 * (tokens of the busiest group) modeled us; budget 8 tokens.
    B (3-token prompt, 3 tokens) arrives at 0, A (20-token prompt, 5 tokens) at 500:
      step 0 [0, 1300):     B prefill 3                 -> B token 1 at 1300
      step 1 [1300, 3100):  B decode 1 + A prefill 7    -> B token 2 at 3100
      step 2 [3100, 4900):  B decode 1 + A prefill 7    -> B token 3 at 4900 (finished)
      step 3 [4900, 6500):  A prefill 6                 -> A token 1 at 6500
      steps 4-7, 1100 each: A decode                    -> A finished at 10900"""
    eng = Engine(FakeRunner(1, step_us=1000.0, token_us=100.0), max_batch=2, token_budget=8)
    res = eng.generate([list(range(1, 21)), [7, 8, 9]], [SamplingParams(5), SamplingParams(3)],
                       arrival_us=[500.0, 0.0])
    a, b = res.requests
    assert (b.first_token_us, b.finish_us, a.first_token_us, a.finish_us) == (1300.0, 4900.0, 6500.0, 10900.0)
    assert b.ttft_ms == pytest.approx(1.3) and b.tpot_ms == pytest.approx((4900 - 1300) / 2 / 1e3)
    assert a.ttft_ms == pytest.approx(6.0) and a.tpot_ms == pytest.approx(1.1)
    m = res.metrics
    assert m.makespan_us == 10900.0 and m.tokens_per_s == pytest.approx(8 / 10900e-6)
    assert m.mean_ttft_ms == pytest.approx(3.65) and m.mean_tpot_ms == pytest.approx((1.8 + 1.1) / 2)
    assert m.num_steps == 8 and m.acceptance_rate is None and m.tokens_per_step == 1.0
    single = Engine(FakeRunner(1)).generate([[1, 2]], SamplingParams(1)).requests[0]
    assert single.tpot_ms is None and single.ttft_ms == 1.0


# ---- errors -----------------------------------------------------------------------------------------------------
def test_argument_errors():
    with pytest.raises(ArgumentError, match="temperature=0.7"):
        SamplingParams(max_tokens=4, temperature=0.7)
    with pytest.raises(ArgumentError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ArgumentError, match="policy='random'"):
        Engine(FakeRunner(1), policy="random")
    with pytest.raises(ArgumentError, match="on both sides"):
        PDConfig([0, 1], [1, 2])
    with pytest.raises(ArgumentError, match="out of range"):
        Engine(FakeRunner(2), pd=PDConfig([0], [5]))
    with pytest.raises(ArgumentError, match="empty prompt"):
        Engine(FakeRunner(1)).add_request([])
    with pytest.raises(CapacityError, match="needs 5 KV blocks of 16, a colocated group has 4"):
        Engine(FakeRunner(1, num_blocks=4)).add_request([1] * 60, SamplingParams(10))


def test_step_guard_names_stuck_requests():
    eng = Engine(FakeRunner(1), max_steps=3)
    eng.add_request([1] * 10, SamplingParams(10))
    with pytest.raises(DeadlockError, match="request 0 running"):
        eng.run()
