"""FusedDispatch / FusedCombine: emulator wall time vs a torch reference of the same data movement at test scale,
and modeled device time at the paper's scale (timing-only) in extra_info.

Run: python -m pytest benches/bench_fused_moe.py --benchmark-only
"""
import numpy as np
import pytest
import torch

from ascend_emu import Pod, cloudmatrix384
from kernels.calibrate import measure
from kernels.fused_moe import (MoeGroup, combine_reference, dispatch_reference, moe_distribute_combine,
                               moe_distribute_dispatch)

R, BS, H, K, E = 4, 32, 512, 4, 16


def _inputs():
    rng = np.random.default_rng(0)
    ids = [np.stack([rng.choice(E, K, replace=False) for _ in range(BS)]) for _ in range(R)]
    x = [torch.randn(BS, H).to(torch.bfloat16) for _ in range(R)]
    w = [rng.random((BS, K)).astype(np.float32) for _ in range(R)]
    return x, ids, w


def _emulated(x, ids, w):
    g = MoeGroup(Pod(cloudmatrix384(dies=R), trace=False), range(R), max_bs=BS, hidden=H, topk=K, num_experts=E)
    d = moe_distribute_dispatch(x, ids, g)
    y = [torch.from_numpy(d.expand_x[r].astype(np.float32) * d.dynamic_scales[r][:, None]).to(torch.bfloat16)
         for r in range(R)]
    out, c = moe_distribute_combine(y, d, w, g)
    return d.run.kernel_us, c.kernel_us


def test_fused_dispatch_combine_emulator(benchmark):
    x, ids, w = _inputs()
    d_us, c_us = benchmark.pedantic(lambda: _emulated(x, ids, w), rounds=3, iterations=1)
    benchmark.extra_info.update(dispatch_modeled_us=d_us, combine_modeled_us=c_us, shape=(R, BS, H, K, E))


def test_fused_dispatch_combine_torch_reference(benchmark):
    x, ids, w = _inputs()
    xf = [xi.float().numpy() for xi in x]
    benchmark.pedantic(lambda: (dispatch_reference(xf, ids, E, R), combine_reference(xf, ids, w)), rounds=3,
                       iterations=1)


@pytest.mark.parametrize("ep", [8, 16])
def test_fused_paper_scale_timing_only(benchmark, ep):
    m = benchmark.pedantic(lambda: measure(ep), rounds=1, iterations=1)
    benchmark.extra_info.update(ep=ep, dispatch_modeled_us=m["dispatch_us"], combine_modeled_us=m["combine_us"],
                                instructions=m["instructions"])
