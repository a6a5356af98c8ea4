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


# ------------------------------------------------------------------------------------------- queue-ahead parts
def _gemm_part(stream, tag, after=()):
    from serving.layer_parts import gemm
    return gemm(stream, tag, [64], 512, 512, int8=False, after=after)


def _resumed(stream, tag):
    """The same GEMM as a part resumed at its op's end (the mode of the numeric runner)."""
    from serving.layer_parts import gemm
    for op, pending, _ in gemm(stream, tag, [64], 512, 512, int8=False):
        yield op, pending


def _two_lane_pod():
    from ascend_emu import cloudmatrix384
    from serving.step import StepPod
    return StepPod(cloudmatrix384(dies=1), microbatches=2, attn_cores=16, launch_mode="graph", numeric=False)


def test_queue_ahead_part_waits_for_another_streams_part_as_an_event():
    """A queue-ahead part on the MoE stream after one on the attention stream is queued before the run and starts
    when the other's last launch ends (its launch overhead ran meanwhile); resumed parts queue it at that end, so it
    starts one launch overhead later. Each op records its roofline work."""
    ahead = _two_lane_pod()
    first = ahead.add(("a",), "attn", lambda after: _gemm_part(ahead.streams("attn", [0])[0], "first"), ahead=True)
    second = ahead.add(("b",), "moe", lambda after: _gemm_part(ahead.streams("moe", [0])[0], "second",
                                                               after.get(0, ())), after=[first], ahead=True)
    ahead.run()
    end_first, start_second = first.records[-1].launches[-1].end_ps, second.records[0].launches[0].start_ps
    assert start_second == end_first
    assert [r.op for r in ahead.records()] == ["first", "second"]
    assert ahead.records()[0].work[0].cube_flops == 2.0 * 64 * 512 * 512
    resumed = _two_lane_pod()
    a = resumed.add(("a",), "attn", _resumed(resumed.streams("attn", [0])[0], "first"))
    b = resumed.add(("b",), "moe", _resumed(resumed.streams("moe", [0])[0], "second"), after=[a])
    resumed.run()
    overhead_ps = int(resumed.pod.profile.launch_graph_us * 1_000_000)
    assert a.records[-1].launches[-1].end_ps == end_first
    assert b.records[0].launches[0].start_ps == end_first + overhead_ps


def test_queue_ahead_and_resumed_parts_do_not_wait_for_each_other():
    from ascend_emu.errors import ArgumentError
    step = _two_lane_pod()
    resumed = step.add(("a",), "attn", _resumed(step.streams("attn", [0])[0], "first"))
    with pytest.raises(ArgumentError, match="not queue-ahead"):
        step.add(("b",), "moe", lambda after: _gemm_part(step.streams("moe", [0])[0], "x"), after=[resumed],
                 ahead=True)
    ahead = step.add(("c",), "moe", lambda after: _gemm_part(step.streams("moe", [0])[0], "x"), ahead=True)
    with pytest.raises(ArgumentError, match="queue-ahead part"):
        step.add(("d",), "attn", _resumed(step.streams("attn", [0])[0], "y"), after=[ahead])
