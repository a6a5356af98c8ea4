"""Throughput of the numerics kernels next to the equivalent torch ops.

Run: python -m pytest benches/bench_numerics.py --benchmark-only -q -p no:cacheprovider
Each group holds a numba and a torch benchmark of the same math so
pytest-benchmark's table compares them directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from ascend_emu import numerics as nm

SHAPE = (1024, 7168)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def x32() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


def _warm(fn, *args):
    # Compile (or load from cache) outside the timed region.
    fn(*args)


@pytest.mark.benchmark(group="cast fp32->bf16")
def test_numba_cast_fp32_bf16(benchmark, x32):
    _warm(nm.cast, x32[:1], ml_dtypes.bfloat16)
    benchmark.extra_info["shape"] = SHAPE
    out = benchmark(nm.cast, x32, ml_dtypes.bfloat16, "rint")
    assert out.dtype == ml_dtypes.bfloat16


@pytest.mark.benchmark(group="cast fp32->bf16")
def test_torch_cast_fp32_bf16(benchmark, x32):
    xt = torch.from_numpy(x32)
    benchmark.extra_info["shape"] = SHAPE
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    out = benchmark(xt.to, torch.bfloat16)
    assert out.dtype == torch.bfloat16


@pytest.mark.benchmark(group="cast fp32->fp16")
def test_numba_cast_fp32_fp16(benchmark, x32):
    _warm(nm.cast, x32[:1], np.float16)
    benchmark.extra_info["shape"] = SHAPE
    out = benchmark(nm.cast, x32, np.float16, "rint")
    assert out.dtype == np.float16


@pytest.mark.benchmark(group="cast fp32->fp16")
def test_torch_cast_fp32_fp16(benchmark, x32):
    xt = torch.from_numpy(x32)
    benchmark.extra_info["shape"] = SHAPE
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    out = benchmark(xt.to, torch.float16)
    assert out.dtype == torch.float16


def _torch_quant(x: torch.Tensor):
    s = x.abs().amax(-1) / 127
    q = torch.round(x / torch.where(s == 0, 1, s)[:, None]).clamp(-128, 127).to(torch.int8)
    return q, s


@pytest.mark.benchmark(group="quant_int8_rows")
def test_numba_quant_int8_rows(benchmark, x32):
    _warm(nm.quant_int8_rows, x32[:2])
    benchmark.extra_info["shape"] = SHAPE
    q, s = benchmark(nm.quant_int8_rows, x32)
    assert q.shape == SHAPE and s.shape == (SHAPE[0],)


@pytest.mark.benchmark(group="quant_int8_rows")
def test_torch_quant_int8_rows(benchmark, x32):
    xt = torch.from_numpy(x32)
    benchmark.extra_info["shape"] = SHAPE
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    q, s = benchmark(_torch_quant, xt)
    assert q.shape == SHAPE


_FIRST_CALL = """
import time
t = time.perf_counter()
import numpy as np, ml_dtypes
import ascend_emu.numerics as n
n.cast(np.ones(8, np.float32), ml_dtypes.bfloat16)
n.quant_int8_rows(np.ones((2, 8), np.float32))
print(time.perf_counter() - t)
"""


@pytest.mark.benchmark(group="first call (warm numba cache)")
def test_first_call_warm_cache(benchmark):
    # Populate the on-disk cache so the subprocess measures loading, not compiling.
    nm.cast(np.ones(8, np.float32), ml_dtypes.bfloat16)
    nm.quant_int8_rows(np.ones((2, 8), np.float32))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    inner: list[float] = []

    def run():
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL],
            cwd=REPO, env=env, capture_output=True, text=True, check=True,
        )
        inner.append(float(out.stdout.strip().splitlines()[-1]))

    benchmark.pedantic(run, rounds=3, iterations=1)
    # The wall time includes interpreter start-up; this is import + first calls only.
    benchmark.extra_info["import_and_first_call_s"] = inner
    assert max(inner) < 30
