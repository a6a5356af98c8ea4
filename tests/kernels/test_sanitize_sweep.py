"""Every kernel is race-free and timing-independent: sanitized, over 20 jitter seeds (latencies +-30 %), each gives
no race, no error and the bits of its run on the profile's own latencies (``ascend_emu.explore``). Small shapes: the
sweep runs in CI."""
from __future__ import annotations

import os

import numpy as np
import torch

from ascend_emu import cloudmatrix384, explore
from kernels.attention import mla_decode_attention
from kernels.fused_moe import MoeGroup, moe_distribute_combine, moe_distribute_dispatch
from kernels.grouped_matmul import grouped_matmul
from kernels.mla import mla_prolog
from tests.kernels.test_attention import make_case
from tests.kernels.test_fused_moe import routing, tokens
from tests.kernels.test_mla_prolog import make_model

SEEDS = range(int(os.environ.get("SWEEP_SEEDS", 20)))


def _sweep(scenario, dies: int = 1):
    report = explore(scenario, seeds=SEEDS, profile=cloudmatrix384(dies=dies))
    assert report.ok, report.summary()


def test_fused_dispatch_combine_two_rounds():
    """FusedDispatch / FusedCombine (INT8), 4 ranks, two consecutive rounds (the window halves alternate)."""
    rounds = [(tokens(10 + r), routing(10 + r)) for r in range(2)]

    def scenario(pod):
        g = MoeGroup(pod, range(4), max_bs=12, hidden=256, topk=4, num_experts=16, quant=True, cores=4)
        outs = []
        for x, (ids, w) in rounds:
            d = moe_distribute_dispatch(x, ids, g)
            y = [torch.from_numpy(d.expand_x[r].astype(np.float32) * d.dynamic_scales[r][:, None])
                 .to(torch.bfloat16) for r in range(4)]
            out, _ = moe_distribute_combine(y, d, w, g)
            outs.append((d.expand_x, d.dynamic_scales, out))
        return outs
    _sweep(scenario, 4)


def test_mla_prolog():
    m = make_model(0, 8, 256, 128, 64, 2, 32, 16)
    g = torch.Generator().manual_seed(1)
    kv0 = torch.randn(3, 16, 1, 64, generator=g).bfloat16()
    kr0 = torch.randn(3, 16, 1, 16, generator=g).bfloat16()
    idx = torch.randperm(48, generator=g)[:8]

    def scenario(pod):
        kv, kr = kv0.clone(), kr0.clone()
        res = mla_prolog(m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                         m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=idx, aic=2, pod=pod)
        return res.query, res.query_rope, kv, kr
    _sweep(scenario)


def test_decode_attention():
    q, qr, kv, kr, bt = make_case(0, [20, 45], 2, 2, 64, 16, 16)

    def scenario(pod):
        return mla_decode_attention(q, qr, kv, kr, bt, [20, 45], softmax_scale=0.1, aic=3, pod=pod).attention_out
    _sweep(scenario)


def test_grouped_matmul():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (70, 128), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (3, 128, 96), generator=g, dtype=torch.int8)
    cs, pts = torch.rand(3, 96, generator=g) * 0.01 + 1e-3, torch.rand(70, generator=g) * 0.01 + 1e-3

    def scenario(pod):
        return grouped_matmul(x, w, group_list=[1, 40, 70], scale=cs, per_token_scale=pts, cores=3, pod=pod,
                              trace=False).y
    _sweep(scenario)
