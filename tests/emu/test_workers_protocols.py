"""The XCCL protocols over 2 and 3 workers on both transports give what one process gives (issue 20's list):
send/recv on the mtu and DMA paths, fused dispatch/combine and A2E/E2A digest to the one-process values recorded in
tests/test_modeled_digests.py (at most two workers for the last two: two chips); fused dispatch/combine over four
chips, pull-based dispatch/combine and A2E/E2A with trampolines forwarding to their group partners match a
one-process run of the same script (trace digest, counters, modeled time, every output)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_emu import Pod, cloudmatrix384
from tests import test_modeled_digests as cases

SPLITS = [(w, t) for w in (2, 3) for t in ("shm", "gloo")]


# fused_moe and a2e run on 4 dies, two chips: at most two workers (a chip is never split)
DIGEST_CASES = [(c, w, t) for c in ("p2p_mtu", "p2p_dma") for w, t in SPLITS] + \
               [(c, 2, t) for c in ("fused_moe", "a2e") for t in ("shm", "gloo")]


@pytest.mark.parametrize("case,workers,transport", DIGEST_CASES)
def test_the_cross_die_digest_cases_match_one_process(monkeypatch, case, workers, transport):
    monkeypatch.setattr(cases, "_pod", lambda dies: Pod(cloudmatrix384(dies=dies), trace=True, workers=workers,
                                                        transport=transport))
    pod, outs = cases.CASES[case]()
    assert cases._digest(pod, outs) == cases.EXPECTED[case]


def _pull(workers: int, transport: str = "auto") -> str:
    """Pull-based dispatch (INT8 on the wire) then combine over 4 ranks on two servers (dies 0, 1, 16, 17)."""
    from xccl import Communicator, combine, dispatch
    pod = Pod(cloudmatrix384(dies=18), trace=True, workers=workers, transport=transport)
    comm = Communicator(pod, [0, 1, 16, 17])
    ranks, tokens, hidden, experts, topk = 4, 12, 128, 16, 4
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ranks, tokens, hidden, generator=g).bfloat16()
    ids = torch.rand(ranks, tokens, experts, generator=g).argsort(-1)[..., :topk]
    w = torch.rand(ranks, tokens, topk, generator=g) + 0.1
    res = dispatch(comm, x, ids, num_experts=experts, quant=True, cores=4)
    y = [(res.x[r].float() * res.scales[r][:, None]).bfloat16() for r in range(ranks)]
    out = combine(comm, res.handle, y, w, cores=4)
    outs = list(res.x) + list(res.scales) + list(out.out)
    assert all(len(o) for o in outs[:ranks])            # every rank received rows: the exchange really crossed
    return cases._digest(pod, outs)


def _trampolines(workers: int, transport: str = "auto") -> str:
    """A2E/E2A with 2 attention dies and 6 expert dies on another server: 2 trampolines forwarding to 2 partners
    each, on the DMA path (the partial blocks a trampoline stages for its partners)."""
    from xccl.a2e import A2EGroup
    rng = np.random.default_rng(9)
    pod = Pod(cloudmatrix384(dies=24), trace=True, workers=workers, transport=transport)
    grp = A2EGroup(pod, [[0, 1]], list(range(16, 22)), num_experts=12, hidden=128, cores=4, trampoline=True,
                   path="dma")
    assert len(grp.groups) == 2
    return cases._digest(pod, cases.a2e_round_trip(pod, grp, rng, tokens=8, topk=3))


def _fused(workers: int, transport: str = "auto") -> str:
    """Fused dispatch/combine (``kernels.fused_moe``) over 8 ranks, four chips."""
    pod = Pod(cloudmatrix384(dies=8), trace=True, workers=workers, transport=transport)
    return cases._digest(pod, cases.fused_moe_round_trip(pod, range(8)))


@pytest.fixture(scope="module")
def fused_one():
    return _fused(1)


@pytest.fixture(scope="module")
def pull_one():
    return _pull(1)


@pytest.fixture(scope="module")
def trampolines_one():
    return _trampolines(1)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_fused_dispatch_and_combine_over_four_chips_match_one_process(fused_one, workers, transport):
    assert _fused(workers, transport) == fused_one


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_pull_dispatch_and_combine_match_one_process(pull_one, workers, transport):
    assert _pull(workers, transport) == pull_one


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a2e_and_e2a_through_trampolines_match_one_process(trampolines_one, workers, transport):
    assert _trampolines(workers, transport) == trampolines_one
