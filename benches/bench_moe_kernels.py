"""Decode-MoE compute kernels: emulator wall time next to the torch reference's wall time at test scale, and the
modeled device time at real (DeepSeek-V3 on CloudMatrix384) scale in extra_info.

Run: python -m pytest benches/bench_moe_kernels.py --benchmark-only -q -p no:cacheprovider

Groups: "<kernel> test-scale" holds the emulator (numeric) and the torch reference of the same math;
"<kernel> real-scale" holds one timing-only run (numeric=False, phantom GM) whose extra_info carries modeled_us,
kernel_us and, for the GEMM, cube and HBM utilisation. Real scale per EP rank: 128 tokens, 256 experts (8 per
rank), top-8, hidden 7168, expert intermediate 2048 (gate+up N = 4096), M = 128 x 8 = 1024 routed rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_emu import cloudmatrix384
from kernels.dynamic_quant import dynamic_quant, dynamic_quant_reference
from kernels.gating import moe_gating_top_k, moe_gating_top_k_reference
from kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

V3_GATE = dict(k=8, k_group=4, group_count=8, group_select_mode=1, routed_scaling_factor=2.5)
PROF = cloudmatrix384()


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_torch():
    """Both sides single-threaded: the emulator runs its tile math on one thread, and on a busy 2-core machine
    torch's pool makes 1 MB elementwise ops ~30x slower than one thread does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _extra(benchmark, run, **kw):
    benchmark.extra_info.update(modeled_us=run.modeled_us, kernel_us=run.kernel_us, instructions=run.instructions,
                                **kw)


# ---------------------------------------------------------------------------------------------- dynamic quant
@pytest.fixture(scope="module")
def quant_x():
    return (torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)


@pytest.mark.benchmark(group="dynamic_quant test-scale 256x1024")
def test_dynamic_quant_emulator(benchmark, quant_x):
    res = benchmark.pedantic(lambda: dynamic_quant(quant_x, trace=False), rounds=5, iterations=1, warmup_rounds=1)
    assert torch.equal(res.y, dynamic_quant_reference(quant_x)[0])
    _extra(benchmark, res.run)


@pytest.mark.benchmark(group="dynamic_quant test-scale 256x1024")
def test_dynamic_quant_torch(benchmark, quant_x):
    benchmark(dynamic_quant_reference, quant_x)


@pytest.mark.benchmark(group="dynamic_quant real-scale")
def test_dynamic_quant_real_scale(benchmark):
    x = torch.empty(128, 7168, dtype=torch.bfloat16, device="meta")      # one rank's tokens before dispatch
    res = benchmark.pedantic(lambda: dynamic_quant(x, numeric=False, trace=False), rounds=1, iterations=1)
    _extra(benchmark, res.run, shape=[128, 7168])


# ---------------------------------------------------------------------------------------------- gating
@pytest.fixture(scope="module")
def gate_in():
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 256, generator=g), torch.randn(256, generator=g) * 0.05


@pytest.mark.benchmark(group="moe_gating_top_k test-scale 128x256")
def test_gating_emulator(benchmark, gate_in):
    x, b = gate_in
    res = benchmark.pedantic(lambda: moe_gating_top_k(x, bias=b, trace=False, **V3_GATE), rounds=5, iterations=1,
                             warmup_rounds=1)
    assert res.expert_idx.shape == (128, 8)
    _extra(benchmark, res.run)


@pytest.mark.benchmark(group="moe_gating_top_k test-scale 128x256")
def test_gating_torch(benchmark, gate_in):
    x, b = gate_in
    benchmark(lambda: moe_gating_top_k_reference(x, bias=b, **V3_GATE))


@pytest.mark.benchmark(group="moe_gating_top_k real-scale")
def test_gating_real_scale(benchmark):
    x = torch.empty(128, 256, device="meta")
    b = torch.empty(256, device="meta")
    res = benchmark.pedantic(lambda: moe_gating_top_k(x, bias=b, numeric=False, trace=False, **V3_GATE), rounds=1,
                             iterations=1)
    _extra(benchmark, res.run, shape=[128, 256])


# ---------------------------------------------------------------------------------------------- grouped GEMM
@pytest.fixture(scope="module")
def gmm_in():
    g = torch.Generator().manual_seed(2)
    m, k, n, e = 512, 512, 1024, 4
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (e, k, n), generator=g, dtype=torch.int8)
    cs = torch.rand(e, n, generator=g) * 0.01
    pts = torch.rand(m, generator=g) * 0.01
    return x, w, cs, pts, [128, 256, 384, 512]


@pytest.mark.benchmark(group="grouped_matmul test-scale int8 512x512x1024 E4 swiglu")
def test_gmm_emulator(benchmark, gmm_in):
    x, w, cs, pts, gl = gmm_in
    res = benchmark.pedantic(lambda: grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts,
                                                    swiglu=True, weight_format="NZ", trace=False),
                             rounds=5, iterations=1, warmup_rounds=1)
    _extra(benchmark, res.run, cube_utilization=res.cube_utilization(PROF))


@pytest.mark.benchmark(group="grouped_matmul test-scale int8 512x512x1024 E4 swiglu")
def test_gmm_torch(benchmark, gmm_in):
    x, w, cs, pts, gl = gmm_in
    benchmark(lambda: grouped_matmul_reference(x, w, group_list=gl, scale=cs, per_token_scale=pts, swiglu=True))


@pytest.mark.benchmark(group="grouped_matmul real-scale")
@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_gmm_real_scale(benchmark, dtype):
    from kernels.cli import run_grouped_gemm
    out = benchmark.pedantic(lambda: run_grouped_gemm(8, 1024, 4096, 7168, dtype, 1, "NZ"), rounds=1, iterations=1)
    run = out.pop("run")
    _extra(benchmark, run, cube_utilization=out["utilization"], hbm_utilization=out["extras"]["hbm_utilization"],
           tops=out["extras"]["tops"], command=f"ascend-emu model grouped-gemm --dtype {dtype} --json")
    assert 0 < out["utilization"] <= 1
    assert np.isfinite(run.modeled_us)
