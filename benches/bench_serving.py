"""The serving loop at test scale: emulator wall time per decode step (numeric mode, every op a kernel) next to the
plain-torch reference's wall time for the same tokens, and the modeled step time as extra info.

    python -m pytest benches/bench_serving.py --benchmark-only
"""
from __future__ import annotations

import time

import pytest

from serving import MINI, EmulatedRunner, ReferenceModel, SeqWork, StepBatch, init_weights
from serving.cli import demo_prompts

BATCH = 8


@pytest.fixture(scope="module")
def weights():
    return init_weights(MINI, seed=0)


@pytest.mark.parametrize("dies,microbatches", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_decode_step(benchmark, weights, dies, microbatches):
    """One decode step of BATCH sequences (prompts of 5-42 tokens already prefilled), spread over ``dies``."""
    prompts = demo_prompts(MINI.vocab_size, BATCH)
    runner = EmulatedRunner(weights, groups=dies, microbatches=microbatches, num_blocks=32)
    groups = [[] for _ in range(dies)]
    for i, p in enumerate(prompts):
        groups[i % dies].append(SeqWork(i, p, 0, list(range(3 * (i // dies), 3 * (i // dies) + 3))))
    first = runner.execute(StepBatch(groups))
    decode = StepBatch([[SeqWork(s.rid, [first.tokens[s.rid][0]], len(s.tokens), s.block_table) for s in g]
                        for g in groups])
    out = benchmark.pedantic(runner.execute, args=(decode,), rounds=3, iterations=1)
    ref = ReferenceModel(weights)
    t = time.perf_counter()
    for p in prompts:                           # the reference's prefill + one decode per sequence
        ref.generate(p, 2)
    benchmark.extra_info.update(modeled_step_us=out.modeled_us, dies=dies, microbatches=microbatches,
                                batch=BATCH, reference_wall_s_prefill_plus_decode=time.perf_counter() - t,
                                breakdown_us=out.breakdown)
    assert len(out.tokens) == BATCH
