"""One numeric serving step (prefill of two prompts on two DP groups: attention, MoE exchange over XCCL, experts) is
race-free and timing-independent: sanitized, over 20 jitter seeds, no race and the same bits as on the profile's own
latencies: the tokens and every layer's latent KV cache (which each layer's input feeds, so a difference anywhere
upstream shows). ``ascend_emu.explore``; the runner makes a pod per op, each sanitized and jittered with the seed."""
from __future__ import annotations

import os

from ascend_emu import explore
from serving.cli import demo_prompts
from serving.config import MINI
from serving.engine import Engine
from serving.model import init_weights
from serving.request import SamplingParams
from serving.runner import EmulatedRunner

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
