"""Timing-only host calls given ``kernels.ranks.HostShape`` inputs (no torch) queue the very launches a torch meta
tensor gives: the same GM tensors, instructions, modeled times and trace; the timing-only decode layer loads no
torch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.errors import ShapeError
from kernels import dynamic_quant, grouped_matmul
from kernels.gating import moe_gating_top_k
from kernels.ranks import HostShape

_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}


def _meta(shape, dtype):
    return torch.empty(*shape, dtype=_TORCH[dtype], device="meta")


def _queue(make, tensor):
    """Queue the host calls ``make(tensor, stream)`` on one die's stream; the run's figures and GM layout."""
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    make(tensor, pod.stream(0, aic=8, aiv=16))
    run = pod.synchronize()
    gm = [(st.name, st.base, st.nbytes, st.data is None) for st in pod.gm.arena(0)._stores]
    return run.modeled_us, run.instructions, run.trace.digest(), gm


def _gemm_and_quant(tensor, stream):
    rows, k, n = [24, 0, 40], 256, 192
    m = sum(rows)
    dynamic_quant(tensor((m, k), "bf16"), numeric=False, stream=stream)
    grouped_matmul(tensor((m, k), "int8"), tensor((3, k, n), "int8"), group_list=np.cumsum(rows), swiglu=True,
                   weight_format="NZ", scale=tensor((3, n), "fp32"), per_token_scale=tensor((m,), "fp32"),
                   numeric=False, stream=stream)
    grouped_matmul(tensor((m, n // 2), "bf16"), tensor((3, n // 2, k), "bf16"), group_list=np.cumsum(rows),
                   numeric=False, stream=stream)


def _gating(tensor, stream):
    moe_gating_top_k(tensor((40, 64), "fp32"), 8, bias=tensor((64,), "fp32"), k_group=4, group_count=8,
                     group_select_mode=1, routed_scaling_factor=2.5, numeric=False, stream=stream)


@pytest.mark.parametrize("make", [_gemm_and_quant, _gating], ids=["grouped_matmul+dynamic_quant", "gating"])
def test_host_shapes_queue_what_meta_tensors_queue(make):
    shaped, meta = _queue(make, HostShape), _queue(make, _meta)
    assert shaped == meta
    assert shaped[1] > 0


def test_a_host_shape_reshapes_like_numpy_and_refuses_what_numpy_refuses():
    h = HostShape((4, 8, 16), "bf16")
    assert h.reshape(-1, 16).shape == np.empty((4, 8, 16)).reshape(-1, 16).shape == (32, 16)
    assert h.reshape((2, -1)).shape == (2, 256) and h.ndim == 3 and h.is_meta
    with pytest.raises(ShapeError, match="cannot reshape"):
        h.reshape(3, -1)


def test_the_timing_only_decode_layer_loads_no_torch():
    code = ("import sys; from ascend_emu import cli; sys.argv = ['ascend-emu', 'model', 'decode-layer', '--config',"
            " 'mini', '--json', '--quiet'];\ntry:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
