"""Stateless expert service: emulator wall time and modeled throughput, with and without a server kill
(timing-only). Modeled figures go to extra_info: throughput (requests per us), span, resends, detection time."""
from __future__ import annotations

import pytest

import xccl.cli as ops

# clients, servers, experts, replicas, hidden, tokens, top-k, requests, AICs per server
SHAPE = (6, 6, 24, 2, 512, 16, 4, 6, 4)


@pytest.mark.parametrize("kill_at_us", [-1.0, 100.0], ids=["healthy", "server-killed"])
def test_expert_service(benchmark, kill_at_us):
    res, wall = benchmark.pedantic(ops.run_service, args=SHAPE, kwargs={"kill_server": 1, "kill_at_us": kill_at_us},
                                   rounds=1, iterations=1)
    benchmark.extra_info.update(modeled_us=res.run.modeled_us, span_us=res.span_us,
                                throughput_requests_per_us=res.throughput_per_us, resends=int(res.resends.sum()),
                                dead_detected_us={int(d): t for d, t in res.dead.items()},
                                instructions=res.run.instructions)
    assert (res.completions == 1).all()
