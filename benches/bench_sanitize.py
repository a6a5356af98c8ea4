"""What the race sanitizer costs: CPU time of a sanitized run over the same run unsanitized, and peak memory of a
larger sanitized run (issue 18: at most 3x; memory growing with the regions touched, not cores x regions).

Run: python -m pytest benches/bench_sanitize.py --benchmark-only -q -p no:cacheprovider

Each overhead test runs the case unsanitized and sanitized (``sanitize="collect"``) in alternation, ``PAIRS`` times,
checks that both give the same modeled times, and puts the best CPU time of each and their ratio in extra_info
(``overhead_ratio``). Cases, timing-only: send/recv of 16 MiB over 8 lanes, FusedDispatch + FusedCombine at EP16
(the calibration shape: 128 tokens, hidden 7168, top-8), grouped_matmul (4 groups of 2048 x 1024 x 1024, INT8) and the
scheduler bench's pipeline. The memory test runs the fused pair at EP32 and EP64 in fresh interpreters, unsanitized
and sanitized, and reports each one's peak RSS (MB) and the sanitized growth.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.pod import pod_defaults
from bench_scheduler import H, R, pipeline      # the scheduler bench's kernel (pytest puts benches/ on sys.path)

PAIRS = 3


def _send_recv(sanitize):
    from xccl import Communicator, recv, send
    pod = Pod(cloudmatrix384(dies=17), trace=False, sanitize=sanitize)
    nbytes = 16 << 20
    comm = Communicator(pod, [0, 16], lanes=48, phantom=True)
    src = pod.alloc(0, (nbytes,), "uint8", phantom=True)
    dst = pod.alloc(16, (nbytes,), "uint8", phantom=True)
    send(comm, src, 16, 1, cores=8, numeric=False)
    t = recv(comm, dst, 0, 1, cores=8, numeric=False)
    t.wait()
    return t.modeled_us


def _fused(sanitize, ep: int = 16):
    from kernels.calibrate import measure
    with pod_defaults(sanitize=sanitize):
        m = measure(ep)
    return m["dispatch_us"], m["combine_us"], m["instructions"]


def _grouped_matmul(sanitize):
    import torch

    from kernels.grouped_matmul import grouped_matmul
    g, m, n, k = 4, 2048, 1024, 1024
    x = torch.empty(g * m, k, dtype=torch.int8, device="meta")
    w = torch.empty(g, k, n, dtype=torch.int8, device="meta")
    scale = torch.empty(g, n, dtype=torch.float32, device="meta")
    pts = torch.empty(g * m, dtype=torch.float32, device="meta")
    pod = Pod(cloudmatrix384(dies=1), trace=False, sanitize=sanitize)
    res = grouped_matmul(x, w, group_list=[m * (i + 1) for i in range(g)], scale=scale, per_token_scale=pts,
                         numeric=False, pod=pod)
    return res.run.kernel_us, res.run.instructions


def _scheduler(sanitize):
    pod = Pod(cloudmatrix384(dies=1), trace=False, sanitize=sanitize)
    x = pod.alloc(0, (48, R, H), "fp32", phantom=True)
    y = pod.alloc(0, (48, R, H), "fp32", phantom=True)
    run = pod.launch(pipeline, aiv=48, args=(x, y, 200), numeric=False)
    return run.modeled_us, run.instructions


CASES = {"send_recv": _send_recv, "fused_dispatch_combine": _fused, "grouped_matmul": _grouped_matmul,
         "scheduler": _scheduler}


def overhead(case, pairs: int = PAIRS) -> dict:
    """Best CPU seconds of ``case(False)`` and ``case("collect")`` over ``pairs`` alternating runs, and their
    ratio; the two must give the same result (modeled times)."""
    case(False)                      # warm the numba and import caches
    plain, sanitized = [], []
    for _ in range(pairs):
        for mode, times in ((False, plain), ("collect", sanitized)):
            gc.collect()
            t = time.process_time()
            out = case(mode)
            times.append(time.process_time() - t)
            if mode is False:
                want = out
            elif out != want:
                raise AssertionError(f"sanitized run gave {out}, unsanitized {want}")
    return {"plain_cpu_s": min(plain), "sanitized_cpu_s": min(sanitized),
            "overhead_ratio": min(sanitized) / min(plain)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sanitize_overhead(benchmark, name):
    result = {}
    benchmark.pedantic(lambda: result.update(overhead(CASES[name])), rounds=1, iterations=1)
    benchmark.extra_info.update(result)


_PEAK = """
import json, resource, sys
from ascend_emu.pod import pod_defaults
from kernels.calibrate import measure
ep, mode = int(sys.argv[1]), sys.argv[2]
with pod_defaults(sanitize="collect" if mode == "sanitized" else False):
    m = measure(ep)
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "instructions": m["instructions"]}))
"""


def peak_memory(ep: int, mode: str) -> dict:
    """Peak RSS (MB) of a fresh interpreter running the fused dispatch + combine at ``ep`` ranks, ``mode``
    "plain" or "sanitized"."""
    out = subprocess.run([sys.executable, "-c", _PEAK, str(ep), mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sanitize_peak_memory(benchmark):
    result = {}

    def one():
        for ep in (32, 64):
            plain = peak_memory(ep, "plain")["peak_rss_mb"]
            sanitized = peak_memory(ep, "sanitized")["peak_rss_mb"]
            result.update({f"ep{ep}_plain_mb": plain, f"ep{ep}_sanitized_mb": sanitized,
                           f"ep{ep}_growth_mb": sanitized - plain})
        result["growth_ratio_ep64_over_ep32"] = result["ep64_growth_mb"] / max(result["ep32_growth_mb"], 1.0)
    benchmark.pedantic(one, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    assert np.isfinite(result["growth_ratio_ep64_over_ep32"])
