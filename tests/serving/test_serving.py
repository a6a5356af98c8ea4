"""End to end: the engine serving the mini model on emulated dies, token for token against the torch reference.

Every comparison is exact (greedy ids): the reference keeps the kernels' rounding points (``serving.model``), and
the kernels are bitwise their references (GEMM K steps, the flash attention algorithm, exact INT8 experts).
"""
from __future__ import annotations

import pytest
import torch

from serving.config import MINI
from serving.engine import Engine, PDConfig
from serving.model import ReferenceModel, init_weights
from serving.cli import demo_prompts
from serving.request import SamplingParams
from serving.runner import EmulatedRunner, pipeline_us

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def weights():
    return init_weights(MINI, seed=0)


@pytest.fixture(scope="module")
def prompts():
    return demo_prompts(MINI.vocab_size, 4)


@pytest.fixture(scope="module")
def expected(weights, prompts):
    ref = ReferenceModel(weights)
    return [ref.generate(p, MAX_TOKENS) for p in prompts]


def serve(runner, prompts, **kw):
    res = Engine(runner, max_batch=4, token_budget=256, **kw).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [r.output_tokens for r in sorted(res.requests, key=lambda r: r.rid)], res


@pytest.mark.parametrize("dies", [1, 2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_tokens_equal_the_reference_on_every_layout(weights, prompts, expected, dies):
    got, res = serve(EmulatedRunner(weights, groups=dies), prompts)
    assert got == expected
    assert res.metrics.tokens_per_s > 0 and res.metrics.mean_ttft_ms > res.metrics.mean_tpot_ms > 0


def test_two_microbatches_same_tokens(weights, prompts, expected):
    got, _ = serve(EmulatedRunner(weights, groups=2, microbatches=2), prompts)
    assert got == expected


def test_pd_disaggregation_moves_the_cache_with_xccl(weights, prompts, expected):
    runner = EmulatedRunner(weights, groups=2)
    got, res = serve(runner, prompts, pd=PDConfig(prefill_groups=(0,), decode_groups=(1,)))
    assert got == expected
    assert runner.transfer_us > 0                       # the KV went die 0 -> die 1 through send/recv


def test_prefix_reuse_skips_cached_blocks_and_keeps_tokens(weights, prompts, expected):
    """Prompts 1 and 3 share a 20-token prefix: the second one reuses the first's full 16-token block."""
    runner = EmulatedRunner(weights, groups=1)
    ran = []
    execute = runner.execute

    def spy(batch):
        ran.extend((s.rid, s.start_pos, len(s.tokens)) for g in batch.groups for s in g)
        return execute(batch)
    runner.execute = spy
    engine = Engine(runner, max_batch=4, token_budget=256)
    rid1 = engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_TOKENS))
    engine.run()
    rid3 = engine.add_request(prompts[3], SamplingParams(max_tokens=MAX_TOKENS))
    res = engine.run()
    first = [r for r in ran if r[0] == rid3][0]
    assert first[1] == 16 and first[2] == len(prompts[3]) - 16      # prefill starts after the cached block
    out = {r.rid: r.output_tokens for r in engine.results([rid1, rid3]).requests}
    assert out[rid1] == expected[1] and out[rid3] == expected[3]
    assert res is not None


def test_mtp_greedy_verification_gives_the_plain_tokens():
    cfg = MINI.replace(num_nextn_predict_layers=1)
    w = init_weights(cfg, seed=0)
    prompts = demo_prompts(cfg.vocab_size, 2)
    ref = ReferenceModel(w)
    want = [ref.generate(p, MAX_TOKENS) for p in prompts]
    got, res = serve(EmulatedRunner(w, groups=1, mtp=True), prompts, mtp=1)
    assert got == want
    m = res.metrics
    assert m.acceptance_rate is not None and 0.0 <= m.acceptance_rate <= 1.0
    assert m.tokens_per_step == pytest.approx(1.0 + m.acceptance_rate, rel=0.35)


def test_die_failure_mid_decode_completes_every_request_with_the_same_tokens(weights, prompts, expected):
    runner = EmulatedRunner(weights, groups=4)
    runner.inject_failure(step=2, die=1, at_us=60.0)     # inside the first MoE dispatch of the third step
    got, res = serve(runner, prompts)
    assert got == expected
    assert res.metrics.num_failures == 1 and runner.alive == [True, False, True, True]
    assert (runner.phy2log[:, runner.slots:2 * runner.slots] == -1).all()     # EPLB shrink: none on the dead die
    assert all(sorted(set(row[row >= 0])) == list(range(MINI.n_routed_experts)) for row in runner.phy2log)


def test_several_injected_failures_all_fire(weights, prompts, expected):
    """Before: a second inject_failure silently replaced the first. Two dies killed in one step (the second is
    reported on the retry) and a third later: every request still completes with the reference's tokens."""
    runner = EmulatedRunner(weights, groups=4, slots=MINI.n_routed_experts)     # one die can hold every expert
    runner.inject_failure(step=1, die=1, at_us=60.0)
    runner.inject_failure(step=1, die=3, at_us=1e6)     # after the step's exchange: dead by the end all the same
    runner.inject_failure(step=4, die=2, at_us=5.0)
    got, res = serve(runner, prompts)
    assert got == expected
    assert res.metrics.num_failures == 3 and runner.alive == [True, False, False, False]


def test_inject_failure_rejects_what_would_never_fire(weights):
    from ascend_emu.errors import ArgumentError
    runner = EmulatedRunner(weights, groups=2)
    for kw, match in ((dict(step=-1, die=1), "step=-1 out of range"), (dict(step=1.5, die=1), "step=1.5"),
                      (dict(step=1, die=2), "die=2 out of range 0..1"), (dict(step=1, die=1, at_us=-3.0), "at_us"),
                      (dict(step=1, die=1, at_us=float("nan")), "at_us")):
        with pytest.raises(ArgumentError, match=match):
            runner.inject_failure(**kw)
    runner.inject_failure(step=3, die=1)
    with pytest.raises(ArgumentError, match="die=1 already has a failure injected"):
        runner.inject_failure(step=5, die=1)
    runner.steps = 4                                    # as if four steps had run
    with pytest.raises(ArgumentError, match=r"step=2 has already run \(4 steps so far\)"):
        runner.inject_failure(step=2, die=0)


def test_eplb_rebalance_during_serving_keeps_tokens(weights, prompts, expected):
    runner = EmulatedRunner(weights, groups=2, rebalance_every=2)
    got, _ = serve(runner, prompts)
    assert got == expected and runner.rebalances >= 1


def test_two_stream_schedule():
    """attention(mb1) overlaps moe(mb0): 2 layers x 2 microbatches of (attn 1, moe 3) finish at 13, not 16."""
    parts = {(layer, m, s): (1.0 if s == "attn" else 3.0) for layer in range(2) for m in range(2)
             for s in ("attn", "moe")}
    assert pipeline_us(parts, [0, 1], 2) == 13.0
    one = {(layer, 0, s): (2.0 if s == "attn" else 6.0) for layer in range(2) for s in ("attn", "moe")}
    assert pipeline_us(one, [0, 1], 1) == 16.0


def test_runner_rejects_bad_batches(weights):
    from ascend_emu.errors import ArgumentError, CapacityError
    from serving.batch import SeqWork, StepBatch
    runner = EmulatedRunner(weights, groups=2, num_blocks=4)
    with pytest.raises(ArgumentError, match="runner has 2"):
        runner.execute(StepBatch([[]]))
    with pytest.raises(CapacityError, match="block_table has 1 blocks"):
        runner.execute(StepBatch([[SeqWork(0, list(range(20)), 0, [0])], []]))
    with pytest.raises(ArgumentError, match="microbatches=3"):
        EmulatedRunner(weights, microbatches=3)


def test_int8_weights_match_the_reference_with_the_same_quant_setting(prompts):
    """W8A8 dense / shared FFNs and wo (dynamic_quant + int8 grouped GEMM) against the reference's W8A8 math."""
    w8 = init_weights(MINI, seed=0, int8=True)
    ref = ReferenceModel(w8)
    want = [ref.generate(p, MAX_TOKENS) for p in prompts[:2]]
    got, _ = serve(EmulatedRunner(w8, groups=2), prompts[:2])
    assert got == want
    assert w8.layers[0].dense.w13_int8.weight.dtype == torch.int8


def test_blocks_of_128_and_idle_groups_joining_the_moe(weights, prompts, expected):
    """KV blocks of 128 positions; 4 dies for 2 requests: two DP groups idle from the start and join every MoE
    exchange with empty batches (the EP group spans all 4 dies)."""
    runner = EmulatedRunner(weights, groups=4, block_size=128, num_blocks=4)
    seen = []
    execute = runner.execute

    def spy(batch):
        seen.append([len(g) for g in batch.groups])
        return execute(batch)
    runner.execute = spy
    res = Engine(runner, max_batch=4, token_budget=256).generate(prompts[:2], SamplingParams(max_tokens=MAX_TOKENS))
    assert [r.output_tokens for r in sorted(res.requests, key=lambda r: r.rid)] == expected[:2]
    assert all(len(s) == 4 and s.count(0) >= 2 for s in seen)
