"""``ascend-emu model`` ops of XCCL: timing-only runs at paper scale (phantom data, real control data)."""
from __future__ import annotations

import numpy as np

from ascend_emu.ops import Option, register

MOE_OPTIONS = (
    Option("--ep", int, 8, "expert-parallel ranks (dies 0 .. ep-1 of a CloudMatrix384 pod)"),
    Option("--tokens-per-rank", int, 128, "tokens per rank"),
    Option("--hidden", int, 7168, "hidden size (elements)"),
    Option("--topk", int, 8, "experts per token"),
    Option("--experts", int, 256, "routed experts (contiguous placement, experts / ep per rank)"),
    Option("--cores", int, 48, "AIV cores per rank"),
)


def _setup(ep, tokens_per_rank, experts, topk, trace):
    from ascend_emu import Pod, cloudmatrix384
    from .comm import Communicator
    pod = Pod(cloudmatrix384(dies=ep), trace=trace)
    comm = Communicator(pod, range(ep), phantom=True)
    # uniform random routing, distinct experts per token (seeded: the same routing every run)
    ids = np.random.default_rng(0).random((ep, tokens_per_rank, experts)).argpartition(topk, axis=-1)[..., :topk]
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
def _dispatch(ep, tokens_per_rank, hidden, topk, experts, cores, quant, trace=False):
    from .moe import dispatch
    comm, ids = _setup(ep, tokens_per_rank, experts, topk, trace)
    res = dispatch(comm, (tokens_per_rank, hidden), ids, num_experts=experts, quant=bool(quant), cores=cores,
                   numeric=False)
    return _figures("dispatch", res.run, rows_received=int(sum(res.handle.plan.recv_rows)))


@register("combine", "pull-based MoE combine (bf16 rows back, fp32 weighted sum) over an EP group", MOE_OPTIONS)
def _combine(ep, tokens_per_rank, hidden, topk, experts, cores, trace=False):
    from .moe import DispatchHandle, combine, plan_routing
    comm, ids = _setup(ep, tokens_per_rank, experts, topk, trace)
    handle = DispatchHandle(plan_routing(ids, experts, ep), hidden)     # the routing a dispatch would return
    res = combine(comm, handle, None, None, cores=cores, numeric=False)
    return _figures("combine", res.run, rows_returned=int(sum(handle.plan.recv_rows)))


@register("send-recv", "point-to-point send/recv between two dies (default: different servers)", (
    Option("--bytes", int, 16 << 20, "bytes to transfer"),
    Option("--cores", int, 8, "computing cores (lanes) per side"),
    Option("--path", str, "mtu", "mtu (UB ping-pong) or dma (DMA engine)", ("mtu", "dma")),
    Option("--src-die", int, 0, "sending die"),
    Option("--dst-die", int, 16, "receiving die (16 = first die of the second server)"),
    Option("--zero-copy", int, 0, "1: write straight into the receiver's app area"),
))
def _send_recv(bytes, cores, path, src_die, dst_die, zero_copy, trace=False):
    from ascend_emu import Pod, cloudmatrix384

    from .comm import Communicator
    from .p2p import recv, send
    pod = Pod(cloudmatrix384(dies=max(src_die, dst_die) + 1), trace=trace)
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


# A2E / E2A register their ops in their own module
from . import a2e_ops, service_ops  # noqa: E402,F401
