"""MLA kernels: emulator wall time next to the torch reference at test scale; modeled time and utilisation at
DeepSeek-V3 scale (timing-only). Run: python -m pytest benches/bench_mla.py --benchmark-only"""
import pytest
import torch

from kernels.attention import attention_reference, mla_decode_attention
from kernels.mla import deepseek_mla_reference, mla_prolog
from tests.kernels.test_attention import SCALE, make_case
from tests.kernels.test_mla_prolog import make_model

T, HE, HCQ, HCKV, N, D, DR = 16, 512, 384, 128, 4, 64, 32


def _prolog(m):
    kv = torch.zeros(2, 16, 1, HCKV).bfloat16()
    kr = torch.zeros(2, 16, 1, DR).bfloat16()
    return mla_prolog(m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
                      m["kv_norm"], m["sin"], m["cos"], kv, kr, cache_index=torch.arange(T), aic=4)


def test_prolog_emulator_test_scale(benchmark):
    m = make_model(0, T, HE, HCQ, HCKV, N, D, DR)
    r = benchmark.pedantic(lambda: _prolog(m), rounds=3, iterations=1)
    benchmark.extra_info.update(modeled_us=r.run.kernel_us)


def test_prolog_torch_reference_test_scale(benchmark):
    m = make_model(0, T, HE, HCQ, HCKV, N, D, DR)
    benchmark(lambda: deepseek_mla_reference(m["x"], m["wq_a"], m["q_norm"], m["wq_b"], m["wkv_a"], m["kv_norm"],
                                             m["wkv_b"], m["theta"], N, D, DR, 1e-6, dtype=torch.bfloat16))


LENS = [300, 40, 120, 64]


def test_attention_emulator_test_scale(benchmark):
    q, qr, kv, kr, bt = make_case(0, LENS, 2, 4, 128, 32, 16)
    r = benchmark.pedantic(lambda: mla_decode_attention(q, qr, kv, kr, bt, LENS, softmax_scale=SCALE, aic=4),
                           rounds=3, iterations=1)
    benchmark.extra_info.update(modeled_us=r.run.kernel_us)


def test_attention_int8_nz_emulator_test_scale(benchmark):
    from tests.kernels.test_attention import quantize_cache
    from tests.kernels.test_mla_prolog import to_nz_cache
    q, qr, kv, kr, bt = make_case(0, LENS, 2, 4, 128, 32, 16)
    k8, d = quantize_cache(kv)
    k8, kr = to_nz_cache(k8), to_nz_cache(kr)
    r = benchmark.pedantic(lambda: mla_decode_attention(q, qr, k8, kr, bt, LENS, softmax_scale=SCALE, aic=4,
                                                        key_antiquant_scale=d, cache_mode="PA_NZ"),
                           rounds=3, iterations=1)
    benchmark.extra_info.update(modeled_us=r.run.kernel_us)


def test_attention_torch_reference_test_scale(benchmark):
    q, qr, kv, kr, bt = make_case(0, LENS, 2, 4, 128, 32, 16)
    benchmark(lambda: attention_reference(q, qr, kv, kr, bt, LENS, SCALE))


@pytest.mark.parametrize("quant_mode", [0, 2])
def test_prolog_v3_timing_only(benchmark, quant_mode):
    import kernels.cli as ops
    r = benchmark.pedantic(lambda: ops._mla_prolog(96, 128, quant_mode, 1 if quant_mode else 0, "PA_NZ", 24, 1),
                           rounds=1, iterations=1)
    r.pop("run")
    benchmark.extra_info.update(r)


@pytest.mark.parametrize("mtp,kv_int8,cache_mode", [(0, 0, "PA_BSND"), (1, 0, "PA_BSND"), (0, 1, "PA_BSND"),
                                                     (0, 1, "PA_NZ")])
def test_attention_v3_decode_b96_4k_timing_only(benchmark, mtp, kv_int8, cache_mode):
    import kernels.cli as ops
    r = benchmark.pedantic(lambda: ops._attention(96, 4096, 128, mtp, 128, "balanced", 24, kv_int8, cache_mode),
                           rounds=1, iterations=1)
    r.pop("run")
    benchmark.extra_info.update(r)
