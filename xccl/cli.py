"""``ascend-emu model`` ops of XCCL: timing-only runs at paper scale (phantom data, real control data).

- ``dispatch`` / ``combine``: pull-based MoE exchange over an EP group on dies 0 .. ep-1.
- ``send-recv``: point to point between two dies.
- ``a2e`` / ``e2a``: disaggregated MoE-attention exchange. Domain ``i`` holds attention dies ``i*A .. (i+1)*A - 1``;
  the expert dies follow (``D*A .. D*A + E - 1``). The domains take turns (each domain's A2E and E2A run after the
  previous domain's E2A). Routing: uniform random top-k without repetition over ``--experts`` (default: one expert
  per expert die), seeded.
- ``expert-service``: the stateless expert service (``xccl.service``) with an optional server kill. Dies: clients
  ``0 .. C-1``, servers ``C .. C+S-1``, the monitor on die ``C+S``. ``--kill-at-us`` >= 0 kills server
  ``--kill-server`` (an index into the servers) at that modeled time; the figures then include the resends and the
  detection time.

Registered with the ``ascend-emu`` command through the ``ascend_emu.cli`` entry point (pyproject.toml).
"""
from __future__ import annotations

import resource
import time

import numpy as np

from ascend_emu.cli import Option, OptionError, not_above, pod_profile, register

MOE_OPTIONS = (
    Option("--ep", int, 8, "expert-parallel ranks (dies 0 .. ep-1 of the pod)", min=1),
    Option("--tokens-per-rank", int, 128, "tokens per rank", min=1),
    Option("--hidden", int, 7168, "hidden size (elements)", min=1),
    Option("--topk", int, 8, "experts per token", min=1),
    Option("--experts", int, 256, "routed experts (contiguous placement, experts / ep per rank)", min=1,
           param="num_experts"),
    Option("--cores", int, 48, "AIV cores per rank", min=1, max="aiv_per_die"),
)


def _setup(ep, tokens_per_rank, experts, topk, trace, profile=None):
    from ascend_emu import Pod

    from .comm import Communicator
    not_above("--topk", topk, experts, f"the --experts {experts}")
    pod = Pod(pod_profile(profile, ep, "--ep", f"EP {ep}"), trace=trace)
    comm = Communicator(pod, range(ep), phantom=True)
    # uniform random routing, distinct experts per token (seeded: the same routing every run)
    # the smallest topk of each token's random draws; kth at most experts - 1 (numpy's limit: topk == experts takes
    # them all)
    ids = np.random.default_rng(0).random((ep, tokens_per_rank, experts)).argpartition(
        min(topk, experts - 1), axis=-1)[..., :topk]
    return comm, ids


def _figures(op, run, **extra):
    port, util = run.busiest_port()
    rx = sum(v["bytes"] for k, v in run.servers.items() if k.startswith(("ub.rx", "d2d.rx")))
    return {"op": op, "modeled_us": run.modeled_us, "kernel_us": run.kernel_us, "bytes_moved": run.bytes_moved,
            "utilization": util, "busiest_port": port, "fabric_bytes": rx, "instructions": run.instructions,
            **extra, "run": run}


@register("dispatch", "pull-based MoE dispatch (INT8 on the wire by default) over an EP group", MOE_OPTIONS + (
    Option("--quant", int, 1, "1: INT8 + per-token scale on the wire; 0: bf16", choices=(0, 1)),
))
def _dispatch(ep, tokens_per_rank, hidden, topk, experts, cores, quant, trace=False, profile=None):
    from .moe import dispatch
    comm, ids = _setup(ep, tokens_per_rank, experts, topk, trace, profile)
    res = dispatch(comm, (tokens_per_rank, hidden), ids, num_experts=experts, quant=bool(quant), cores=cores,
                   numeric=False)
    return _figures("dispatch", res.run, rows_received=int(sum(res.handle.plan.recv_rows)))


@register("combine", "pull-based MoE combine (bf16 rows back, fp32 weighted sum) over an EP group", MOE_OPTIONS)
def _combine(ep, tokens_per_rank, hidden, topk, experts, cores, trace=False, profile=None):
    from .moe import DispatchHandle, combine, plan_routing
    comm, ids = _setup(ep, tokens_per_rank, experts, topk, trace, profile)
    handle = DispatchHandle(plan_routing(ids, experts, ep), hidden)     # the routing a dispatch would return
    res = combine(comm, handle, None, None, cores=cores, numeric=False)
    return _figures("combine", res.run, rows_returned=int(sum(handle.plan.recv_rows)))


@register("send-recv", "point-to-point send/recv between two dies (default: different servers)", (
    Option("--bytes", int, 16 << 20, "bytes to transfer", min=1),
    Option("--cores", int, 8, "computing cores (lanes) per side", min=1, max="aiv_per_die"),
    Option("--path", str, "mtu", "mtu (UB ping-pong) or dma (DMA engine)", ("mtu", "dma")),
    Option("--src-die", int, 0, "sending die", min=0),
    Option("--dst-die", int, 16, "receiving die (16 = first die of the second server)", min=0),
    Option("--zero-copy", int, 0, "1: write straight into the receiver's app area", (0, 1)),
))
def _send_recv(bytes, cores, path, src_die, dst_die, zero_copy, trace=False, profile=None):
    from ascend_emu import Pod

    from .comm import Communicator
    from .p2p import recv, send
    far, die = ("--dst-die", dst_die) if dst_die >= src_die else ("--src-die", src_die)
    pod = Pod(pod_profile(profile, die + 1, far, f"die {die}"), trace=trace)
    comm = Communicator(pod, [src_die, dst_die], lanes=max(cores, 1), phantom=True)
    src = pod.alloc(src_die, (bytes,), "uint8", phantom=True, name="src")
    dst = pod.alloc(dst_die, (bytes,), "uint8", phantom=True, name="dst")
    send(comm, src, dst_die, 1, cores=cores, path=path, zero_copy=bool(zero_copy), numeric=False)
    t = recv(comm, dst, src_die, 1, cores=cores, zero_copy=bool(zero_copy), numeric=False)
    run = t.wait()
    port = max((s["utilization"] for n, s in run.servers.items() if n.startswith(("ub.", "d2d."))), default=0.0)
    return {"op": "send-recv", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "payload_bytes": bytes,
            "achieved_gbps": bytes / (run.kernel_us * 1e3), "utilization": port, "run": run}


# ------------------------------------------------------------------------------------------------- A2E / E2A
A2E_OPTIONS = (
    Option("--attn-dies", int, 160, "attention dies per DP domain", min=1),
    Option("--expert-dies", int, 288, "expert dies", min=1),
    Option("--batch-per-die", int, 96, "tokens per attention die", min=1),
    Option("--hidden", int, 7168, "hidden size (bf16 on the wire)", min=1),
    Option("--topk", int, 8, "experts per token", min=1),
    Option("--domains", int, 1, "DP domains (take turns)", min=1),
    Option("--experts", int, 0, "routed experts (0: one per expert die)", min=0, param="num_experts"),
    Option("--trampoline", int, 1, "1: trampoline forwarding; 0: direct", choices=(0, 1)),
    Option("--direct", int, 0, "1: direct mode (overrides --trampoline)", choices=(0, 1)),
    Option("--path", str, "mtu", "mtu (AIV copies) or dma (DMA engine) for the attention <-> trampoline hops "
           "(the A2E forward to partners always runs on the trampolines' AIVs)", ("mtu", "dma")),
    Option("--cores", int, 48, "AIV cores per die", min=1, max="aiv_per_die"),
)


def run_exchange(attn_dies, expert_dies, batch_per_die, hidden, topk, domains, experts, trampoline, path, cores,
                 direct=0, trace=False, seed=0, profile=None):
    """Queue every domain's A2E and E2A, run once; returns (group, [(a2e handle, e2a handle)], run, wall s)."""
    from ascend_emu import Pod

    from .a2e import A2EGroup
    n_exp = experts or expert_dies
    not_above("--topk", topk, n_exp, f"the {n_exp} routed experts (--experts, 0: one per --expert-dies)")
    dies = domains * attn_dies + expert_dies
    prof = pod_profile(profile, dies, "--attn-dies",
                       f"--domains {domains} x --attn-dies {attn_dies} + --expert-dies {expert_dies}")
    pod = Pod(prof, trace=trace, max_modeled_us=None)
    doms = [list(range(i * attn_dies, (i + 1) * attn_dies)) for i in range(domains)]
    grp = A2EGroup(pod, doms, list(range(domains * attn_dies, dies)), num_experts=n_exp, hidden=hidden,
                   trampoline=bool(trampoline) and not direct, path=path, cores=cores, phantom=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    pairs, prev = [], []
    for d in range(domains):
        ids = [rng.random((batch_per_die, n_exp)).argpartition(min(topk, n_exp - 1), axis=1)[:, :topk]
               for _ in range(attn_dies)]
        w = [np.full((batch_per_die, topk), 1.0 / topk, np.float32)] * attn_dies
        h = grp.a2e(d, None, ids, w, numeric=False, after=prev)
        o = grp.e2a(h)
        prev = [o.launch]
        pairs.append((h, o))
    run = pod.synchronize()
    return grp, pairs, run, time.perf_counter() - t0


def _exchange_figures(op, grp, pairs, run, wall, which):
    per = []
    for h, o in pairs:
        la = h.launch if which == "a2e" else o.launch
        per.append((la.end_ps - la.start_ps) / 1e6)
    port, util = run.busiest_port()
    return {"op": op, "modeled_us": run.modeled_us, "kernel_us": run.kernel_us, "bytes_moved": run.bytes_moved,
            "utilization": util, "busiest_port": port, f"{which}_us_per_domain": per,
            "a2e_us": [(h.launch.end_ps - h.launch.start_ps) / 1e6 for h, _ in pairs],
            "e2a_us": [(o.launch.end_ps - o.launch.start_ps) / 1e6 for _, o in pairs],
            "trampolines": grp.num_trampolines, "instructions": run.instructions, "wall_s": wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "run": run}


@register("a2e", "attention -> expert dies (A2E), trampoline or direct; runs A2E + E2A, reports A2E", A2E_OPTIONS)
def _a2e(trace=False, **kw):
    grp, pairs, run, wall = run_exchange(trace=trace, **kw)
    return _exchange_figures("a2e", grp, pairs, run, wall, "a2e")


@register("e2a", "expert -> attention dies (E2A, weighted sum); runs A2E + E2A, reports E2A", A2E_OPTIONS)
def _e2a(trace=False, **kw):
    grp, pairs, run, wall = run_exchange(trace=trace, **kw)
    return _exchange_figures("e2a", grp, pairs, run, wall, "e2a")


# -------------------------------------------------------------------------------------------- expert service
SERVICE_OPTIONS = (
    Option("--clients", int, 8, "attention (client) dies", min=1),
    Option("--servers", int, 8, "expert (server) dies", min=1),
    Option("--experts", int, 32, "routed experts (y = x @ W_e, [hidden, hidden])", min=1, param="num_experts"),
    Option("--replicas", int, 2, "copies of each expert on distinct servers", min=1),
    Option("--hidden", int, 1024, "hidden size (bf16)", min=1),
    Option("--tokens", int, 16, "tokens per request (micro-batch)", min=1),
    Option("--topk", int, 8, "experts per token", min=1, param="top_k"),
    Option("--requests", int, 4, "requests per client (sent one after another)", min=1),
    Option("--server-cores", int, 24, "AICs per server sharing each batch's GEMM", min=1, max="aic_per_die"),
    Option("--kill-server", int, 0, "server index to kill (0 .. --servers - 1, with --kill-at-us)", min=0),
    Option("--kill-at-us", float, -1.0, "modeled time of the kill; < 0: no kill"),
)


def run_service(clients, servers, experts, replicas, hidden, tokens, topk, requests, server_cores, kill_server=0,
                kill_at_us=-1.0, trace=False, seed=0, profile=None):
    """Build the pod and service, run it timing-only; returns (ServiceResult, wall seconds)."""
    from ascend_emu import Pod

    from .service import ExpertService
    not_above("--topk", topk, experts, f"the --experts {experts}")
    prof = pod_profile(profile, clients + servers + 1, "--clients",
                       f"--clients {clients} + --servers {servers} + 1 monitor die")
    pod = Pod(prof, trace=trace, max_modeled_us=None)
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
    if kw["kill_at_us"] >= 0 and not 0 <= kw["kill_server"] < kw["servers"]:
        raise OptionError(f"--kill-server: {kw['kill_server']} is not a server index: 0 .. {kw['servers'] - 1} "
                          f"(--servers {kw['servers']})", "--kill-server")
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
