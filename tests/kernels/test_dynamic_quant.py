"""kernels.dynamic_quant (npu_dynamic_quant) on the emulator against its torch reference.

Tolerance: none. The kernel and the reference compute the same fp32 operations in the same order (x * smooth, max|.|,
/ 127, divide, round half to even, saturate), so y and scale must be bitwise equal.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu.errors import ArgumentError, CapacityError, DTypeError, ShapeError
from kernels.dynamic_quant import dynamic_quant, dynamic_quant_reference

HYP = settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def assert_bitwise(res, ref):
    y, s = ref
    assert res.y.dtype == torch.int8 and res.scale.dtype == torch.float32
    assert torch.equal(res.y, y), f"{int((res.y != y).sum())} of {y.numel()} int8 values differ"
    assert torch.equal(res.scale.view(torch.int32), s.view(torch.int32)), "scales differ bitwise"


@given(rows=st.integers(1, 40), h=st.sampled_from([16, 48, 100, 256, 1000]), dt=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2 ** 31 - 1))
@HYP
def test_bitwise_vs_reference(rows, h, dt, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, h, generator=g) * 4).to(DTYPES[dt])
    x[0] = 0                                                  # an all-zero row: scale 0, y 0
    res = dynamic_quant(x, cores=4, trace=False)
    assert_bitwise(res, dynamic_quant_reference(x))
    assert res.run.modeled_us > 0


def test_round_half_even_and_saturation():
    # scale = 127 / 127 = 1: y = rint(x) exactly; halves go to even; one row hits -128 only through rounding
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49, -126.5] + [0.0] * 8,
                      [-127.0, 63.5, 64.5, -63.5] + [0.0] * 12], dtype=torch.float32)
    y, s = dynamic_quant(x, cores=1, trace=False)
    assert y[0, :8].tolist() == [127, 0, 2, 2, -2, 0, 3, -126]
    assert y[1, :4].tolist() == [-127, 64, 64, -64]
    assert s.tolist() == [1.0, 1.0]


def test_smooth_scales_and_moe_groups():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 96, generator=g).to(torch.bfloat16)
    sm = (torch.rand(96, generator=g) + 0.5).to(torch.bfloat16)
    res = dynamic_quant(x, smooth_scales=sm, cores=3, trace=False)
    assert_bitwise(res, dynamic_quant_reference(x, smooth_scales=sm))
    sm3 = (torch.rand(4, 96, generator=g) + 0.5).to(torch.bfloat16)
    gi = torch.tensor([7, 7, 8, 50])                           # an empty group and a group of one row
    res = dynamic_quant(x, smooth_scales=sm3, group_index=gi, cores=5, trace=False)
    assert_bitwise(res, dynamic_quant_reference(x, smooth_scales=sm3, group_index=gi))
    # the smoothing really happened: without it row 7 (group 2) quantises differently
    assert not torch.equal(res.y[7], dynamic_quant_reference(x)[0][7])


def test_leading_dims_are_tokens():
    x = torch.randn(2, 3, 64).to(torch.float16)
    y, s = dynamic_quant(x, cores=2, trace=False)
    assert y.shape == (2, 3, 64) and s.shape == (2, 3)
    ry, rs = dynamic_quant_reference(x)
    assert torch.equal(y, ry) and torch.equal(s, rs)


def test_per_rank_list_runs_each_rank_on_its_die_in_one_run():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(20, 128, generator=g).to(torch.bfloat16), torch.randn(9, 128, generator=g).to(torch.bfloat16)]
    res = dynamic_quant(xs, cores=4, trace=False)
    assert isinstance(res.y, list) and len(res.y) == 2
    for r, x in enumerate(xs):
        ry, rs = dynamic_quant_reference(x)
        assert torch.equal(res.y[r], ry) and torch.equal(res.scale[r], rs)
    assert [la.dies for la in res.run.launches] == [[0], [1]]
    assert res.run.launches[0].start_us == res.run.launches[1].start_us     # concurrent, not one after the other


def test_timing_only_matches_numeric_timing():
    x = torch.randn(96, 512).to(torch.bfloat16)
    num = dynamic_quant(x, cores=8, trace=False)
    meta = dynamic_quant(torch.empty(96, 512, dtype=torch.bfloat16, device="meta"), numeric=False, cores=8,
                         trace=False)
    assert meta.y is None and meta.scale is None
    assert meta.run.modeled_us == num.run.modeled_us


def test_errors_name_the_argument():
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(ShapeError, match="smooth_scales"):
        dynamic_quant(x, smooth_scales=torch.ones(63, dtype=torch.bfloat16))
    with pytest.raises(DTypeError, match="x dtype int8"):
        dynamic_quant(torch.zeros(4, 64, dtype=torch.int8))
    with pytest.raises(ArgumentError, match="group_index needs smooth_scales"):
        dynamic_quant(x, group_index=torch.tensor([4]))
    with pytest.raises(ArgumentError, match="group_index must be non-decreasing"):
        dynamic_quant(x, smooth_scales=torch.ones(2, 64, dtype=torch.bfloat16), group_index=torch.tensor([3, 2]))
    with pytest.raises(CapacityError, match=r"x.shape\[-1\]=200000"):
        dynamic_quant(torch.empty(2, 200000, dtype=torch.bfloat16, device="meta"), numeric=False)
