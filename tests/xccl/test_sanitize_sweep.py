"""Every XCCL protocol is race-free and timing-independent: sanitized, over 20 jitter seeds (latencies +-30 %), each
gives no race, no error and the bits of its run on the profile's own latencies (``ascend_emu.explore``). Small
shapes: the sweep runs in CI."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from ascend_emu import cloudmatrix384, explore
from xccl.a2e import A2EGroup
from xccl.comm import Communicator
from xccl.moe import combine, dispatch
from xccl.p2p import recv, send
from xccl.service import ExpertService

SEEDS = range(int(__import__("os").environ.get("SWEEP_SEEDS", 20)))


def _sweep(scenario, dies: int, **pod_options):
    report = explore(scenario, seeds=SEEDS, profile=cloudmatrix384(dies=dies), **pod_options)
    assert report.ok, report.summary()
    return report


P2P = {"mtu": {}, "dma": {"path": "dma"}, "async": {"sync": False}, "zero-copy": {"zero_copy": True},
       "chunked": {"chunked": True}}


@pytest.mark.parametrize("mode", sorted(P2P))
def test_send_recv(mode):
    """Two transfers back to back over 2 lanes of a 2-slot ring (slots reused), die 0 -> die 16 (another server)."""
    opts = dict(P2P[mode])
    slot = 256 if opts.pop("chunked", False) else 1024

    def scenario(pod):
        comm = Communicator(pod, [0, 16], slots=2, slot_bytes=slot)
        outs = []
        for ev, n in ((7, 5000), (8, 3001)):
            x = np.random.default_rng(ev).integers(0, 256, n, dtype=np.uint8)
            dst = pod.alloc(16, (n,), "uint8")
            send(comm, pod.to_gm(0, x), 16, ev, cores=2, **opts)
            recv(comm, dst, 0, ev, cores=2, zero_copy=opts.get("zero_copy", False))
            outs.append(dst)
        pod.synchronize()
        return [o.numpy() for o in outs]
    _sweep(scenario, 17)


def test_pull_dispatch_combine():
    """Pull-based dispatch (bf16 and INT8 on the wire) and combine over 4 ranks on two servers, with masked slots
    (-1: the combine zeroes their rows instead of reading what the UB held)."""
    g = torch.Generator().manual_seed(0)
    ranks, t, h, e, k = 4, 6, 64, 8, 2
    x = torch.randn(ranks, t, h, generator=g).to(torch.bfloat16)
    ids = torch.rand(ranks, t, e, generator=g).argsort(-1)[..., :k]
    ids[:, ::3, 1] = -1
    w = torch.rand(ranks, t, k, generator=g)

    def scenario(pod):
        comm = Communicator(pod, [0, 1, 16, 17])
        out = []
        for quant in (False, True):
            d = dispatch(comm, list(x), list(ids), num_experts=e, quant=quant, cores=2)
            y = [torch.ones(int(c.sum()), h).to(torch.bfloat16) * (r + 1) for r, c in enumerate(d.expert_counts)]
            c = combine(comm, d.handle, y, list(w), cores=2)
            out.append((d.x, d.scales, c.out))
        return out
    _sweep(scenario, 18)


@pytest.mark.parametrize("path", ["mtu", "dma"])
@pytest.mark.parametrize("trampoline", [True, False], ids=["trampoline", "direct"])
def test_a2e_e2a(path, trampoline):
    """A2E then E2A, 3 attention dies and 4 expert dies, identity experts (the host copies inputs to outputs)."""
    rng = np.random.default_rng(0)
    a, n_exp, b, h, k = 3, 8, 4, 64, 2
    x = [rng.standard_normal((b, h)).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(a)]
    ids = [np.argsort(rng.random((b, n_exp)), 1)[:, :k] for _ in range(a)]
    w = [rng.random((b, k)).astype(np.float32) for _ in range(a)]

    def scenario(pod):
        grp = A2EGroup(pod, [list(range(a))], list(range(a, a + 4)), num_experts=n_exp, hidden=h,
                       trampoline=trampoline, path=path, cores=2)
        hd = grp.a2e(0, x, ids, w)
        pod.synchronize()
        for ex in range(4):
            hd.expert_output(ex).write(hd.expert_input(ex).numpy())
        o = grp.e2a(hd)
        pod.synchronize()
        return [o.result(i) for i in range(a)]
    _sweep(scenario, 7)


def test_expert_service_with_a_server_killed():
    """2 clients, 3 servers (replica 2), one server killed mid-run: every request completes once, via replicas."""
    g = torch.Generator().manual_seed(0)
    c, s, e, h, k, b, r = 2, 3, 6, 32, 2, 4, 3
    w = (torch.randn(e, h, h, generator=g) / 8).to(torch.bfloat16)
    x = torch.randn(c, r, b, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(c * r * b)]).reshape(c, r, b, k)
    gate = torch.rand(c, r, b, k, generator=g)

    def scenario(pod):
        svc = ExpertService(pod, range(c), range(c, c + s), num_experts=e, hidden=h, top_k=k, max_tokens=b,
                            weights=w)
        res = svc.run(ids.numpy(), x, gate, kill=[(c + 1, 30.0)])
        return res.out, res.completions
    _sweep(scenario, c + s + 1, max_modeled_us=5000.0)
