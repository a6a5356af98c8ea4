"""kernels.roofline: each bound from its definition, the largest named, the ratio against the kernel time."""
from __future__ import annotations

import pytest

from ascend_emu import cloudmatrix384
from ascend_emu.errors import ArgumentError
from kernels.roofline import attention_roofline, roofline

PROF = cloudmatrix384()


def test_bounds_follow_their_definitions():
    ghz = PROF.clock_ghz
    r = roofline("gemm", PROF, modeled_us=20.0, kernel_us=6.0, cube_flops=2.0 * 48 * 7168 * 256, cube_dtype="bf16",
                 read_bytes=48 * 7168 * 2 + 7168 * 256 * 2, write_bytes=48 * 256 * 2, aic=24, aiv=48)
    assert r.compute_us == pytest.approx(2.0 * 48 * 7168 * 256 / (2 * 16 * 16 * 16 * 24 * ghz * 1e3))
    assert r.hbm_us == pytest.approx((48 * 7168 * 2 + 7168 * 256 * 2 + 48 * 256 * 2) / 1.6e6)
    assert r.movers_us == pytest.approx((48 * 7168 * 2 + 7168 * 256 * 2) / (24 * 32 * ghz * 1e3))
    assert r.bound == "movers" and r.roofline_us == r.movers_us and r.ratio == pytest.approx(6.0 / r.movers_us)
    one = roofline("gemm", PROF, modeled_us=1, kernel_us=1, cube_flops=1e9, cube_dtype="int8", aic=1)
    assert one.bound == "compute" and one.compute_us == pytest.approx(1e9 / (2 * 16 * 16 * 32 * ghz * 1e3))
    port = roofline("send", PROF, modeled_us=1, kernel_us=1, fabric_bytes=196_000_000, aiv=48)
    assert port.bound == "fabric" and port.fabric_us == pytest.approx(1000.0)
    d = r.to_dict()
    assert d["bound"] == "movers" and d["roofline_us"] == r.roofline_us and d["compulsory_bytes"] == r.compulsory_bytes


def test_attention_counts_each_cache_byte_once():
    class Run:
        modeled_us, kernel_us = 10.0, 5.0

        def hbm_bytes(self, die=None):
            return 123
    r = attention_roofline(Run(), PROF, seq_lens=[4096] * 2, s=2, n=128, hckv=512, dr=64, aic=24)
    cache = 2 * 4096 * (512 + 64) * 2
    queries = 2 * 2 * 128 * (512 + 64) * 2
    assert r.compulsory_bytes == cache + queries + 2 * 2 * 128 * 512 * 2 and r.hbm_bytes == 123


def test_cores_must_be_given():
    with pytest.raises(ArgumentError, match="give the cores"):
        roofline("x", PROF, modeled_us=1, kernel_us=1, read_bytes=10)
    with pytest.raises(ArgumentError, match="need aic > 0"):
        roofline("x", PROF, modeled_us=1, kernel_us=1, cube_flops=10, aiv=2)
