"""``ascend-emu model expert-service``: the stateless expert service (``xccl.service``), timing-only, with an optional
server kill.

Dies: clients ``0 .. C-1``, servers ``C .. C+S-1``, the monitor on die ``C+S``. Routing: uniform random top-k
without repetition over ``--experts``, seeded. ``--kill-at-us`` >= 0 kills server ``--kill-server`` (an index into the
servers) at that modeled time; the figures then include the resends and the detection time.
"""
from __future__ import annotations

import time

import numpy as np

from ascend_emu.ops import Option, register

SERVICE_OPTIONS = (
    Option("--clients", int, 8, "attention (client) dies"),
    Option("--servers", int, 8, "expert (server) dies"),
    Option("--experts", int, 32, "routed experts (y = x @ W_e, [hidden, hidden])"),
    Option("--replicas", int, 2, "copies of each expert on distinct servers"),
    Option("--hidden", int, 1024, "hidden size (bf16)"),
    Option("--tokens", int, 16, "tokens per request (micro-batch)"),
    Option("--topk", int, 8, "experts per token"),
    Option("--requests", int, 4, "requests per client (sent one after another)"),
    Option("--server-cores", int, 24, "AICs per server sharing each batch's GEMM"),
    Option("--kill-server", int, 0, "server index to kill (with --kill-at-us)"),
    Option("--kill-at-us", float, -1.0, "modeled time of the kill; < 0: no kill"),
)


def run_service(clients, servers, experts, replicas, hidden, tokens, topk, requests, server_cores, kill_server=0,
                kill_at_us=-1.0, trace=False, seed=0):
    """Build the pod and service, run it timing-only; returns (ServiceResult, wall seconds)."""
    from ascend_emu import Pod, cloudmatrix384

    from .service import ExpertService
    pod = Pod(cloudmatrix384(dies=clients + servers + 1), trace=trace, max_modeled_us=None)
    svc = ExpertService(pod, range(clients), range(clients, clients + servers), num_experts=experts, hidden=hidden,
                        top_k=topk, max_tokens=tokens, replicas=replicas, server_cores=server_cores, phantom=True)
    rng = np.random.default_rng(seed)
    ids = rng.random((clients, requests, tokens, experts)).argsort(axis=-1)[..., :topk]
    kill = [(clients + kill_server, kill_at_us)] if kill_at_us >= 0 else []
    t0 = time.perf_counter()
    res = svc.run(ids, kill=kill)
    return res, time.perf_counter() - t0


@register("expert-service", "stateless expert service: clients -> replicated expert servers (poll, batch, GEMM, "
          "write back), heartbeats, optional server kill", SERVICE_OPTIONS)
def _expert_service(trace=False, **kw):
    res, wall = run_service(trace=trace, **kw)
    run = res.run
    lat = np.diff(np.concatenate([np.full((res.completion_us.shape[0], 1), res.start_us), res.completion_us], 1), 1)
    lat = lat[np.isfinite(lat)]
    return {"op": "expert-service", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": run.utilization.get("CUBE", 0.0),
            "throughput_requests_per_us": res.throughput_per_us, "span_us": res.span_us,
            "request_us_p50": float(np.median(lat)) if lat.size else None,
            "request_us_max": float(lat.max()) if lat.size else None,
            "completed": int((res.completions == 1).sum()), "resends": int(res.resends.sum()),
            "dead_detected_us": {int(d): t for d, t in res.dead.items()}, "instructions": run.instructions,
            "wall_s": wall, "run": run}
