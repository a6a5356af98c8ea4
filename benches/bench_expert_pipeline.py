"""Persistent expert kernels: emulator wall time and modeled device time, one domain x one microbatch vs two domains x
two microbatches on the same dies and tokens (timing-only).

Small point by default (2 x 4 attention dies, 8 expert dies, 32 tokens per die, hidden 1024, top-8, 2 layers,
attention 100 us per layer); ``PIPE_LARGE=1 python -m pytest benches/bench_expert_pipeline.py --benchmark-only`` runs
2 x 8 attention dies, 16 expert dies, hidden 2048."""
from __future__ import annotations

import os

import pytest

import serving.cli as ops

LARGE = os.environ.get("PIPE_LARGE") == "1"
ATTN, EXPERT, HIDDEN = (16, 16, 2048) if LARGE else (8, 8, 1024)


@pytest.mark.parametrize("domains,microbatches", [(1, 1), (2, 2)], ids=["1dom-1mb", "2dom-2mb"])
def test_expert_pipeline(benchmark, domains, microbatches):
    res, wall = benchmark.pedantic(ops.run_pipeline, args=(ATTN // domains, domains, microbatches, EXPERT, 0, 32,
                                                           HIDDEN, 8, 2, 100.0), rounds=1, iterations=1)
    benchmark.extra_info.update(modeled_us=res.modeled_us, expert_busy=res.expert_busy,
                                compute_busy=res.mean_stream_busy("compute"), cube_utilization=res.cube_utilization,
                                layer_us=[float(t) for t in res.layer_us], instructions=res.run.instructions)
    assert res.modeled_us > 0
