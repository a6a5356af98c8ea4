"""DeepSeek-V3 decode step at real dimensions, timing-only (serving.timing): modeled TPOT and tokens/s per die for
16, 32 and 64 dies (each die one DP attention rank and one EP rank), 96 sequences per die at 4K context, INT8
experts and dispatch, two microbatches on split core sets; and the paper's decode instance (the cloudmatrix-infer
preset). The benchmark time is the emulator's wall time; the modeled figures go to extra_info.

Run: python -m pytest benches/bench_serving_v3.py --benchmark-only
"""
import resource
import time

import pytest

from serving.config import V3
from serving.timing import decode_step_timing


@pytest.mark.parametrize("dies", [16, 32, 64])
def test_v3_decode_step(benchmark, dies):
    t0 = time.perf_counter()
    res = benchmark.pedantic(lambda: decode_step_timing(V3, dies=dies, batch_per_die=96, seq_len=4096,
                                                        microbatches=2, mtp=0), rounds=1, iterations=1)
    benchmark.extra_info.update(
        dies=dies, modeled_tpot_ms=res.tpot_ms, tokens_per_s_per_die=res.tokens_per_s_per_die,
        tokens_per_s=res.tokens_per_s, per_layer_us=res.per_layer_us, lm_head_us=res.lm_head_us,
        fill_us=res.fill_us, pipeline=res.pipeline, hbm_footprint_gib=res.hbm_footprint_gib,
        wall_s=time.perf_counter() - t0,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def test_cloudmatrix_infer_preset(benchmark):
    """The paper's decode instance (serving.deployment.PRESETS["cloudmatrix-infer"]: 320 dies, 48 sequences per die
    at 4K, 32 shared-expert and 32 redundant-expert dies, INT8, MTP 1 at 70 % acceptance): modeled TPOT and tokens/s
    per NPU in extra_info, the emulator's wall time as the benchmark time (minutes on a 2-core machine)."""
    t0 = time.perf_counter()
    res = benchmark.pedantic(lambda: decode_step_timing(V3, preset="cloudmatrix-infer", mtp=1), rounds=1,
                             iterations=1)
    benchmark.extra_info.update(
        preset="cloudmatrix-infer", modeled_tpot_ms=res.tpot_ms, step_us=res.step_us,
        tokens_per_s_per_npu=res.tokens_per_s_per_npu, per_layer_us=res.per_layer_us, pipeline=res.pipeline,
        wall_s=time.perf_counter() - t0,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
