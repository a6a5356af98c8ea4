"""One numeric serving step (prefill of two prompts on two DP groups: attention, MoE exchange over XCCL, experts) is
race-free and timing-independent: sanitized, over 20 jitter seeds, no race and the same bits as on the profile's own
latencies: the tokens and every layer's latent KV cache (which each layer's input feeds, so a difference anywhere
upstream shows). ``ascend_emu.explore``; the runner makes a pod per op, each sanitized and jittered with the seed."""
from __future__ import annotations

import os

import pytest

from ascend_emu import cloudmatrix384, explore
from serving.cli import demo_prompts
from serving.config import MINI
from serving.engine import Engine
from serving.expert_pipeline import ExpertPipeline
from serving.model import init_weights
from serving.request import SamplingParams
from serving.runner import EmulatedRunner
from tests.serving.test_expert_pipeline import SPLIT, _inputs

SEEDS = range(int(os.environ.get("SWEEP_SEEDS", 20)))


def test_serving_step():
    weights = init_weights(MINI, seed=0)
    prompts = demo_prompts(MINI.vocab_size, 2)

    def scenario(pod):
        runner = EmulatedRunner(weights, groups=2)
        res = Engine(runner, max_batch=4, token_budget=256).generate(prompts, SamplingParams(max_tokens=1))
        return [r.output_tokens for r in sorted(res.requests, key=lambda r: r.rid)], runner.kv, runner.kr
    report = explore(scenario, seeds=SEEDS)
    assert report.ok, report.summary()


@pytest.mark.parametrize("trampoline", [True, False], ids=["trampoline", "direct"])
def test_expert_pipeline(trampoline):
    """The persistent expert pipeline (2 domains x 2 microbatches, 2 layers) over 5 jitter seeds: the zero rows that
    pad its gathers are written before they are read (they were only an allocation's zeros)."""
    def scenario(pod):
        pipe = ExpertPipeline(pod, [[0, 1], [2, 3]], [4, 5, 6, 7], num_experts=8, hidden=128, num_microbatches=2,
                              split=SPLIT, attn_cores=4, num_slots=2, trampoline=trampoline)
        ids, w, x, weights = _inputs(4, 8, 2, 8, 128, 2, 0)
        return pipe.run(ids, w, x=x, weights=weights).out
    report = explore(scenario, seeds=range(min(5, len(SEEDS))), profile=cloudmatrix384(dies=8))
    assert report.ok, report.summary()
