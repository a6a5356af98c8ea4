"""kernels.grouped_matmul (npu_grouped_matmul) on the emulator against the torch reference.

Accuracy regimes:
- int8 -> int32 accumulators: exact (compared with an int64 reference);
- int8 -> bf16 with per-token and/or per-channel scales: bitwise. Kernel and reference convert the exact int32
  accumulator to fp32 (RNE), multiply by the per-token scale, then by the per-channel scale in fp32, round to bf16;
- SwiGLU (int8 or bf16): the kernel's silu is g / (1 + exp(-g)) with numpy's exp, torch's F.silu differs by a few
  fp32 ulp, so the bf16 results agree within one bf16 ulp (|d| <= 2^-7 |ref|);
- bf16 x bf16: fp32 accumulation in K steps of 64 vs torch's order, then bf16 rounding. Against the fp64 exact
  product P: |y - P| <= 2^-8 |P| + (1 + 2^-8) gamma_K (|x| @ |w|), gamma_K = K u / (1 - K u), u = 2^-24.
"""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import cloudmatrix384
from ascend_emu.errors import ArgumentError, DTypeError, ShapeError
from kernels import Ranks
from kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference, plan_tiles

HYP = settings(max_examples=6, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def int8(g, *shape):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def operands(seed, m, k, n, e):
    g = torch.Generator().manual_seed(seed)
    return (int8(g, m, k), int8(g, e, k, n), torch.rand(e, n, generator=g) * 0.01 + 1e-3,
            torch.rand(m, generator=g) * 0.01 + 1e-3)


@pytest.mark.parametrize("fmt", ["ND", "NZ"])
@pytest.mark.parametrize("glt", [0, 1])
def test_int8_accumulators_exact_with_empty_and_single_row_groups(fmt, glt):
    x, w, _, _ = operands(0, 150, 256, 288, 5)
    ends = [0, 1, 1, 130, 149]                       # empty, one row, empty, 129 rows (2 m-tiles), 19; row 149 unused
    gl = ends if glt == 0 else list(np.diff([0] + ends))
    res = grouped_matmul(x, w, group_list=gl, group_list_type=glt, output_dtype=torch.int32, weight_format=fmt,
                         cores=4, trace=False)
    ref, acc = grouped_matmul_reference(x, w, group_list=gl, group_list_type=glt, output_dtype=torch.int32)
    assert res.y.dtype == torch.int32
    assert torch.equal(res.y.long(), acc), "int32 accumulators differ from the exact int64 product"
    assert not res.y[149].any() and res.y[0].any()


@pytest.mark.parametrize("fmt", ["ND", "NZ"])
def test_int8_dequant_bitwise(fmt):
    x, w, cs, pts = operands(1, 140, 160, 96, 3)     # K tail (160 = 128 + 32), N narrower than a 256 tile
    gl = [1, 70, 140]
    res = grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts, weight_format=fmt, cores=3,
                         trace=False)
    ref, _ = grouped_matmul_reference(x, w, group_list=gl, scale=cs, per_token_scale=pts)
    assert res.y.dtype == torch.bfloat16
    assert torch.equal(res.y.view(torch.int16), ref.view(torch.int16))
    only_cs = grouped_matmul(x, w, group_list=gl, scale=cs, cores=3, trace=False)       # fixpipe-only dequant
    ref_cs, _ = grouped_matmul_reference(x, w, group_list=gl, scale=cs)
    assert torch.equal(only_cs.y.view(torch.int16), ref_cs.view(torch.int16))


def within_one_bf16_ulp(got, ref):
    d = (got.float() - ref.float()).abs()
    assert (d <= 2.0 ** -7 * ref.float().abs() + 1e-30).all(), f"worst {d.max():.3g}"


@pytest.mark.parametrize("fmt", ["ND", "NZ"])
def test_int8_swiglu(fmt):
    x, w, cs, pts = operands(2, 131, 128, 320, 2)    # N = 2 x 160: a 128-column and a 32-column gate/up tile
    gl = [3, 131]
    res = grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts, swiglu=True, weight_format=fmt,
                         cores=4, trace=False)
    ref, _ = grouped_matmul_reference(x, w, group_list=gl, scale=cs, per_token_scale=pts, swiglu=True)
    assert res.y.shape == (131, 160)
    within_one_bf16_ulp(res.y, ref)


@pytest.mark.parametrize("kind", ["per_token_scale", "swiglu"])
def test_fp32_output_sizes_the_epilogue_for_its_dtype(kind):
    """Before: output_dtype=torch.float32 doubled the epilogue's output tiles and overflowed the UB (CapacityError
    inside the kernel); the chunks now shrink to fit (24 rows here), and the result is the reference's."""
    x, w, cs, pts = operands(4, 150, 128, 320, 3)
    gl = [0, 90, 150]
    kw = dict(per_token_scale=pts, scale=cs) if kind == "per_token_scale" else dict(swiglu=True, scale=cs)
    res = grouped_matmul(x, w, group_list=gl, output_dtype=torch.float32, cores=3, trace=False, **kw)
    ref, _ = grouped_matmul_reference(x, w, group_list=gl, output_dtype=torch.float32, **kw)
    assert res.y.dtype == torch.float32
    if kind == "per_token_scale":                    # same fp32 products in the same order: bitwise
        assert torch.equal(res.y.view(torch.int32), ref.view(torch.int32))
    else:                                            # silu's exp: a few fp32 ulp
        assert ((res.y - ref).abs() <= 2.0 ** -20 * ref.abs() + 1e-6 * ref.abs().max()).all()
    from kernels.grouped_matmul import epilogue_rows
    assert epilogue_rows(196608, 256, True, 4, True) == 24 and epilogue_rows(196608, 256, True, 2, True) == 32


def test_float_group_lists_and_core_counts_are_rejected():
    x, w, cs, _ = operands(5, 16, 64, 64, 2)
    with pytest.raises(DTypeError, match="group_list is float64"):
        grouped_matmul(x, w, group_list=[8.5, 16.0], trace=False)
    with pytest.raises(ArgumentError, match="cores=2.5"):
        grouped_matmul(x, w, group_list=[8, 16], cores=2.5, trace=False)


def test_bf16_variant_and_swiglu():
    g = torch.Generator().manual_seed(3)
    m, k, n = 70, 192, 256
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(2, k, n, generator=g).to(torch.bfloat16)
    gl = [1, 70]
    res = grouped_matmul(x, w, group_list=gl, weight_format="NZ", cores=2, trace=False)
    xd, wd = x.double(), w.double()
    exact = torch.cat([xd[:1] @ wd[0], xd[1:] @ wd[1]])
    absprod = torch.cat([xd[:1].abs() @ wd[0].abs(), xd[1:].abs() @ wd[1].abs()])
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    bound = 2.0 ** -8 * exact.abs() + (1 + 2.0 ** -8) * gamma * absprod
    assert ((res.y.double() - exact).abs() <= bound).all()
    sw = grouped_matmul(x, w, group_list=gl, swiglu=True, cores=2, trace=False)
    ref, _ = grouped_matmul_reference(x, w, group_list=gl, swiglu=True)
    d = (sw.y.float() - ref.float()).abs()
    assert (d <= 2.0 ** -7 * ref.float().abs() + 1e-6 * ref.float().abs().max()).all()


@given(sizes=st.lists(st.sampled_from([0, 1, 2, 17, 64, 129]), min_size=1, max_size=5),
       kn=st.sampled_from([(64, 32), (96, 288), (256, 64)]), seed=st.integers(0, 2 ** 31 - 1))
@HYP
def test_int8_exact_sweep(sizes, kn, seed):
    k, n = kn
    m = sum(sizes) + 1
    x, w, cs, pts = operands(seed, m, k, n, len(sizes))
    gl = np.cumsum(sizes).tolist()
    res = grouped_matmul(x, w, group_list=gl, output_dtype=torch.int32, cores=5, trace=False)
    _, acc = grouped_matmul_reference(x, w, group_list=gl, output_dtype=torch.int32)
    assert torch.equal(res.y.long(), acc)


def test_cores_rotate_across_groups():
    x, w, cs, pts = operands(4, 64, 64, 256, 4)
    gl = [16, 32, 48, 64]                            # four groups of one tile each
    tiles = plan_tiles(gl, 256, 256)
    assert [t[0] for t in tiles] == [0, 1, 2, 3]
    res = grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts, cores=4, trace=False)
    busy = {unit: us for (_, unit, pipe), us in res.run.pipe_busy.items() if pipe == "CUBE"}
    assert sorted(busy) == ["aic0", "aic1", "aic2", "aic3"] and min(busy.values()) > 0   # one group per AIC
    assert max(busy.values()) == pytest.approx(min(busy.values()))


def test_per_rank_list_one_run():
    a = operands(5, 40, 64, 64, 2)
    b = operands(6, 9, 64, 64, 3)
    res = grouped_matmul(Ranks([a[0], b[0]]), Ranks([a[1], b[1]]), group_list=Ranks([[20, 40], [0, 4, 9]]),
                         scale=Ranks([a[2], b[2]]), per_token_scale=Ranks([a[3], b[3]]), cores=2, trace=False)
    for r, (op, gl) in enumerate(((a, [20, 40]), (b, [0, 4, 9]))):
        ref, _ = grouped_matmul_reference(op[0], op[1], group_list=gl, scale=op[2], per_token_scale=op[3])
        assert torch.equal(res.y[r].view(torch.int16), ref.view(torch.int16))
    assert [la.dies for la in res.run.launches] == [[0], [1]]


def test_timing_only_matches_numeric_timing():
    x, w, cs, pts = operands(7, 130, 256, 512, 2)
    gl = [60, 130]
    num = grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts, swiglu=True, cores=4, trace=False)
    meta = grouped_matmul(torch.empty(130, 256, dtype=torch.int8, device="meta"),
                          torch.empty(2, 256, 512, dtype=torch.int8, device="meta"), group_list=gl,
                          scale=torch.empty(2, 512, device="meta"), per_token_scale=torch.empty(130, device="meta"),
                          swiglu=True, numeric=False, cores=4, trace=False)
    assert meta.y is None
    assert meta.run.modeled_us == num.run.modeled_us and meta.macs == num.macs == 130 * 256 * 512


def test_errors_name_the_argument():
    x, w, cs, pts = operands(8, 16, 64, 64, 2)
    with pytest.raises(ShapeError, match="group_list has 3 entries for E=2"):
        grouped_matmul(x, w, group_list=[1, 2, 3])
    with pytest.raises(ArgumentError, match="non-decreasing"):
        grouped_matmul(x, w, group_list=[9, 4])
    with pytest.raises(ShapeError, match="covers 17 rows"):
        grouped_matmul(x, w, group_list=[8, 17])
    with pytest.raises(ShapeError, match="K=48"):
        grouped_matmul(x[:, :48].contiguous(), w[:, :48].contiguous(), group_list=[8, 16])
    with pytest.raises(DTypeError, match="weight dtype bf16"):
        grouped_matmul(x, w.to(torch.bfloat16), group_list=[8, 16])
    with pytest.raises(ArgumentError, match="bias"):
        grouped_matmul(x, w, group_list=[8, 16], bias=[torch.zeros(64)])
    with pytest.raises(ArgumentError, match="output_dtype=torch.int32"):
        grouped_matmul(x, w, group_list=[8, 16], scale=cs, output_dtype=torch.int32)


def test_model_op_json(capsys):
    import kernels.cli  # noqa: F401  (registers grouped-gemm)
    from ascend_emu.cli import main
    assert main(["model", "grouped-gemm", "--groups", "4", "--m", "256", "--k", "512", "--n", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["op"] == "grouped-gemm" and out["modeled_us"] > 0 and out["bytes_moved"] > 0
    assert 0 < out["utilization"] <= 1 and out["extras"]["kernel_us"] < out["modeled_us"]


# ------------------------------------------------------------------------------------------------ tiling and physics
def test_paper_tiling_128x152_is_exact_and_rows_pad_to_bursts():
    """The CloudMatrix384 paper's 128 x 152 tile: 152-byte B rows and 304-byte bf16 output rows copy with DataCopyPad;
    the numbers stay bitwise those of the reference."""
    from kernels.grouped_matmul import GemmTiling
    x, w, cs, pts = operands(11, 300, 256, 320, 2)
    gl = [100, 300]
    res = grouped_matmul(x, w, group_list=gl, scale=cs, per_token_scale=pts, tiling=GemmTiling(n=152), cores=3,
                         trace=False)
    ref, _ = grouped_matmul_reference(x, w, group_list=gl, scale=cs, per_token_scale=pts)
    assert torch.equal(res.y.view(torch.int16), ref.view(torch.int16))


def test_tiling_is_checked_against_the_buffers_before_launch():
    from kernels.grouped_matmul import GemmTiling
    x, w, cs, pts = operands(0, 64, 256, 256, 1)
    with pytest.raises(ArgumentError, match="L0C needs 262144 bytes, the AIC has 131072"):
        grouped_matmul(x, w, group_list=[64], tiling=GemmTiling(m=256, n=256, k_l1=256), trace=False)
    with pytest.raises(ArgumentError, match="L1 needs 525312 bytes, the AIC has 524288"):
        grouped_matmul(x, w, group_list=[64], tiling=GemmTiling(m=256, n=256), trace=False)
    with pytest.raises(ArgumentError, match="multiple of k_l0"):
        grouped_matmul(x, w, group_list=[64], tiling=GemmTiling(k_l1=192, k_l0=128), trace=False)


def test_a_gemm_whose_groups_fit_the_l2_reads_its_operands_once_and_is_cube_bound():
    """2 groups of 1536 x 4096 x 4096 int8 (22 MiB of A and B per group, far below the L2; 16 tiles per AIC): HBM
    moves the compulsory bytes and no more, every byte re-read for another tile is an L2 hit, and with 128 x 256 tiles
    the cube is each AIC's busiest pipe (per L1 stage 4 x 536 cube cycles against 192 KiB / 110 B per cycle = 1787
    MTE2 cycles); the fixpipe of each tile (128 KiB at 86 B per cycle) waits for the tile's last mmad."""
    g, m, k, n = 2, 1536, 4096, 4096
    meta = lambda *s, dtype=torch.int8: torch.empty(*s, dtype=dtype, device="meta")   # noqa: E731
    res = grouped_matmul(meta(g * m, k), meta(g, k, n), group_list=[m, 2 * m], scale=meta(g, n, dtype=torch.float32),
                         per_token_scale=meta(g * m, dtype=torch.float32), numeric=False, trace=False)
    run = res.run
    compulsory = g * m * k + g * k * n + g * m * n * 2
    assert run.hbm_bytes() + run.l2[0]["dirty_bytes"] <= 1.15 * compulsory
    assert run.l2[0]["read_miss_bytes"] <= 1.05 * (g * m * k + g * k * n)
    cube = [us for (_, unit, pipe), us in run.pipe_busy.items() if pipe == "CUBE"]
    mte2 = [us for (_, unit, pipe), us in run.pipe_busy.items() if pipe == "MTE2" and unit.startswith("aic")]
    # the cube is the busiest pipe (the AICs that first touch a group's B also pay its HBM misses on MTE2)
    assert min(cube) >= 0.75 * run.kernel_us and sorted(mte2)[len(mte2) // 2] < min(cube)
    assert res.cube_utilization(cloudmatrix384()) >= 0.7


def test_plain_list_still_means_ranks_with_a_deprecation_warning():
    """torch_npu reads a list x as groups; the native per-rank form is Ranks([...]). A plain list keeps working for
    one release, with a warning naming both."""
    a = operands(5, 40, 64, 64, 2)
    b = operands(6, 9, 64, 64, 3)
    with pytest.warns(DeprecationWarning, match=r"kernels.Ranks\(\[...\]\) for ranks.*npu_grouped_matmul"):
        old = grouped_matmul([a[0], b[0]], [a[1], b[1]], group_list=[[20, 40], [0, 4, 9]], cores=2, trace=False)
    new = grouped_matmul(Ranks([a[0], b[0]]), Ranks([a[1], b[1]]), group_list=Ranks([[20, 40], [0, 4, 9]]),
                         cores=2, trace=False)
    assert all(torch.equal(o, n) for o, n in zip(old.y, new.y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped_matmul(Ranks([a[0], a[0]]), a[1], group_list=[20, 40], cores=2, trace=False)
