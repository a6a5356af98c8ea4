"""A2E + E2A: emulator wall time and modeled device time, trampoline vs direct (timing-only).

Small point by default; the paper-scale comparison (3 x 160 attention dies, 288 expert dies, batch 96, hidden 7168,
top-8) runs with ``A2E_PAPER=1 python -m pytest benches/bench_a2e.py --benchmark-only``."""
from __future__ import annotations

import os

import pytest

import xccl.cli as ops

PAPER = os.environ.get("A2E_PAPER") == "1"
SHAPE = (160, 288, 96, 7168, 8, 3) if PAPER else (16, 28, 16, 1024, 8, 2)


@pytest.mark.parametrize("trampoline", [1, 0], ids=["trampoline", "direct"])
def test_a2e_e2a(benchmark, trampoline):
    a, e, b, h, k, d = SHAPE
    grp, pairs, run, wall = benchmark.pedantic(ops.run_exchange, args=(a, e, b, h, k, d, 0, trampoline, "mtu", 48),
                                               rounds=1, iterations=1)
    benchmark.extra_info.update(modeled_us=run.modeled_us, instructions=run.instructions,
                                a2e_us=[(x.launch.end_ps - x.launch.start_ps) / 1e6 for x, _ in pairs],
                                e2a_us=[(y.launch.end_ps - y.launch.start_ps) / 1e6 for _, y in pairs])
    assert run.modeled_us > 0
