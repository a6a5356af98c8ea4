"""The step builder (serving.step): one pod per step, numeric and timing-only runs of the same description."""
from __future__ import annotations

import numpy as np
import pytest

from serving.batch import SeqWork, StepBatch
from serving.cli import demo_prompts
from serving.config import MINI
from serving.model import init_weights
from serving.runner import EmulatedRunner


@pytest.fixture(scope="module")
def weights():
    return init_weights(MINI, seed=0)


def decode_batches(groups: int):
    """A prefill step of 4 prompts over ``groups`` groups, then the decode step that follows it."""
    prompts = demo_prompts(MINI.vocab_size, 4)
    seqs = [[] for _ in range(groups)]
    for i, p in enumerate(prompts):
        seqs[i % groups].append(SeqWork(i, p, 0, list(range(4 * (i // groups), 4 * (i // groups) + 4))))
    return StepBatch(seqs), lambda tokens: StepBatch([[SeqWork(s.rid, tokens[s.rid], len(s.tokens), s.block_table)
                                                       for s in g] for g in seqs])


@pytest.mark.parametrize("microbatches", [1, 2])
def test_timing_only_step_with_the_recorded_routing_gives_the_numeric_times(weights, microbatches):
    runner = EmulatedRunner(weights, groups=2, microbatches=microbatches)
    prefill, decode = decode_batches(2)
    first = runner.execute(prefill)
    numeric = runner.execute(decode(first.tokens))
    routing = runner.last_routing
    assert routing and all(ids.shape[1] == MINI.num_experts_per_tok for ids in routing.values())
    steps = runner.steps
    timed = runner.time_step(decode(first.tokens), routing)
    assert timed.tokens == {} and runner.steps == steps          # not a serving step
    assert timed.modeled_us == numeric.modeled_us                 # the step total, exactly
    assert timed.timeline == numeric.timeline                     # every op: its lane, start and end
    assert timed.breakdown == numeric.breakdown
    # the routing is control data: every row to the same experts gives other times
    skewed = {key: ids * 0 + np.arange(ids.shape[1]) for key, ids in routing.items()}
    assert runner.time_step(decode(first.tokens), skewed).timeline != numeric.timeline


def test_two_microbatches_overlap_attention_with_the_other_microbatch_moe(weights):
    """With two microbatches the attention stream's ops of microbatch 1 run while the MoE stream's ops of
    microbatch 0 run, on the same pod (so they contend): some attention op of mb1 overlaps a MoE op of mb0."""
    runner = EmulatedRunner(weights, groups=2, microbatches=2)
    prefill, _ = decode_batches(2)
    out = runner.execute(prefill)
    layer = max(int(name.split(".")[0][1:]) for _, name, _, _ in out.timeline if name.startswith("L"))
    attention = [(a, b) for lane, name, a, b in out.timeline if lane == "attn" and name.startswith(f"L{layer}.mb1.")]
    moe = [(a, b) for lane, name, a, b in out.timeline if lane == "moe" and name.startswith(f"L{layer}.mb0.")]
    assert attention and moe
    assert any(a0 < b1 and a1 < b0 for a0, b0 in attention for a1, b1 in moe)
    assert out.modeled_us >= max(b for _, _, _, b in out.timeline) - 1e-9
