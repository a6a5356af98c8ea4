"""int8 K steps run as one multiply (ascend_emu.cube_math): bitwise the stepwise accumulation, same modeled run.

Each case is a small cube program on one AIC: int8 K-step mmads into accumulator tiles of one L0C allocation (odd
shapes, partial K steps, accumulating or not, tiles that overlap) with fixpipe reads in between and at the end. It
runs twice, with the deferred full-K multiply and with one multiply per mmad (``cube_math.FUSE_INT8_K = False``, the
die's stepwise order); every value read out, the modeled time and the instruction count must be equal.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, cube_math, kernel

HYP = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
OVERLAP = 16          # int32 elements between the two accumulator tiles' starts (64-byte L0C alignment)


@kernel(cores="aic")
def cube_program(ctx, a_gm, b_gm, out_gm, program, m, n, k_step):
    """program: ("mmad", tile, k0, k1, accumulate) or ("read", tile, slot): tile 0 starts at the L0C allocation,
    tile 1 ``OVERLAP`` elements later (both [m, n]); a read fixpipes the tile to out_gm[slot]."""
    a_l1 = [ctx.l1.alloc((m, k_step), "int8") for _ in range(2)]
    b_l1 = [ctx.l1.alloc((k_step, n), "int8") for _ in range(2)]
    a_l0 = [ctx.l0a.alloc((m, k_step), "int8") for _ in range(2)]
    b_l0 = [ctx.l0b.alloc((k_step, n), "int8") for _ in range(2)]
    flat = ctx.l0c.alloc((OVERLAP + m * n,), "int32")
    tiles = [flat[:m * n].reshape(m, n), flat[OVERLAP:OVERLAP + m * n].reshape(m, n)]
    for i, op in enumerate(program):
        s = i % 2
        if op[0] == "read":
            yield ctx.copy_l0c_to_gm(out_gm[op[2]], tiles[op[1]])
            continue
        _, t, k0, k1, accumulate = op
        kw = k1 - k0
        yield ctx.copy_gm_to_l1(a_l1[s][:, :kw], a_gm[:, k0:k1], pad=True)
        yield ctx.copy_gm_to_l1(b_l1[s][:kw], b_gm[k0:k1], pad=True)
        yield ctx.copy_l1_to_l0a(a_l0[s][:, :kw], a_l1[s][:, :kw])
        yield ctx.copy_l1_to_l0b(b_l0[s][:kw], b_l1[s][:kw])
        yield ctx.mmad(tiles[t], a_l0[s][:, :kw], b_l0[s][:kw], accumulate=accumulate)


def run_program(a, b, program, k_step, fuse: bool):
    m, n = a.shape[0], b.shape[1]
    reads = sum(op[0] == "read" for op in program)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    out = pod.alloc(0, (max(1, reads), m, n), "int32")
    before = cube_math.FUSE_INT8_K
    cube_math.FUSE_INT8_K = fuse
    try:
        run = pod.launch(cube_program, die=0, aic=1,
                         args=(pod.to_gm(0, a), pod.to_gm(0, b), out, program, m, n, k_step))
    finally:
        cube_math.FUSE_INT8_K = before
    return out.numpy(), run.modeled_us, run.instructions


@st.composite
def programs(draw):
    m, n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    k = draw(st.integers(1, 300))
    k_step = draw(st.sampled_from([16, 32, 64, 100, 128]))
    program, slot = [], 0
    for _ in range(draw(st.integers(1, 4))):          # passes over K into one tile, reads in between
        t = draw(st.integers(0, 1))
        first_accumulates = draw(st.booleans())
        k0 = 0
        while k0 < k:
            k1 = min(k, k0 + draw(st.integers(1, k_step)))       # partial and odd K steps
            program.append(("mmad", t, k0, k1, k0 > 0 or first_accumulates))
            k0 = k1
        if draw(st.booleans()):
            program.append(("read", draw(st.integers(0, 1)), slot))
            slot += 1
    program += [("read", 0, slot), ("read", 1, slot + 1)]
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    return a, b, program, k_step


@HYP
@given(case=programs())
def test_fused_int8_k_steps_equal_the_stepwise_mmads_bit_for_bit(case):
    a, b, program, k_step = case
    fused = run_program(a, b, program, k_step, True)
    stepwise = run_program(a, b, program, k_step, False)
    np.testing.assert_array_equal(fused[0], stepwise[0])
    assert fused[1:] == stepwise[1:]                  # modeled time and instruction count


def test_a_single_pass_reads_the_exact_product():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (33, 200), dtype=np.int8)
    b = rng.integers(-128, 128, (200, 24), dtype=np.int8)
    program = [("mmad", 0, k0, min(200, k0 + 64), k0 > 0) for k0 in range(0, 200, 64)] + [("read", 0, 0)]
    out, _, _ = run_program(a, b, program, 64, True)
    np.testing.assert_array_equal(out[0], a.astype(np.int64) @ b.astype(np.int64))


def test_sums_past_int32_wrap_like_the_stepwise_ones():
    """Six K steps of 32768 products of 2^14: each step's sum is 2^29, the total 3 x 2^30 wraps modulo 2^32 on the
    die. The deferred multiply lands before its K could leave int32 (``MAX_FUSED_K``), so it wraps the same way."""
    k = 3 * 65536
    a = np.full((1, k), -128, np.int8)
    b = np.full((k, 1), -128, np.int8)
    program = [("mmad", 0, k0, k0 + 32768, k0 > 0) for k0 in range(0, k, 32768)] + [("read", 0, 0)]
    fused = run_program(a, b, program, 32768, True)[0]
    stepwise = run_program(a, b, program, 32768, False)[0]
    np.testing.assert_array_equal(fused, stepwise)
    assert fused[0, 0, 0] == 3 * 2 ** 30 - 2 ** 32


@pytest.mark.parametrize("fuse", [True, False])
def test_an_unread_accumulator_lands_when_its_core_finishes(fuse, monkeypatch):
    monkeypatch.setattr(cube_math, "FUSE_INT8_K", fuse)
    seen = {}

    @kernel(cores="aic")
    def unread(ctx, a_gm, b_gm):
        a1, b1 = ctx.l1.alloc((16, 32), "int8"), ctx.l1.alloc((32, 16), "int8")
        a0, b0 = ctx.l0a.alloc((16, 32), "int8"), ctx.l0b.alloc((32, 16), "int8")
        c = ctx.l0c.alloc((16, 16), "int32")
        yield ctx.copy_gm_to_l1(a1, a_gm)
        yield ctx.copy_gm_to_l1(b1, b_gm)
        yield ctx.copy_l1_to_l0a(a0, a1)
        yield ctx.copy_l1_to_l0b(b0, b1)
        for accumulate in (False, True):
            yield ctx.mmad(c, a0, b0, accumulate=accumulate)
        seen["c"] = c
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (16, 32), dtype=np.int8)
    b = rng.integers(-128, 128, (32, 16), dtype=np.int8)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    pod.launch(unread, die=0, aic=1, args=(pod.to_gm(0, a), pod.to_gm(0, b)))
    assert seen["c"].store.deferred is None
    np.testing.assert_array_equal(seen["c"].arr, 2 * (a.astype(np.int64) @ b.astype(np.int64)))


@HYP
@given(m=st.integers(1, 48), k=st.integers(0, 3000), n=st.integers(1, 48), extreme=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_each_exact_int8_product_method_gives_the_integer_product(m, k, n, extreme, seed):
    """Both host methods (fp32 BLAS by K chunks, torch ``_int_mm``) and ``int8_matmul`` itself equal the int64
    product, K chunks past 2^24 / 2^14 included (extreme: every product is (-128)^2 = 2^14, the largest sums)."""
    rng = np.random.default_rng(seed)
    a = np.full((m, k), -128, np.int8) if extreme else rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = np.full((k, n), -128, np.int8) if extreme else rng.integers(-128, 128, (k, n), dtype=np.int8)
    want = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(cube_math._int8_mm_f32(a, b).numpy(), want)
    np.testing.assert_array_equal(cube_math.int8_matmul(a, b), want.astype(np.int32))
    if m > 16 and k % 8 == 0 and n % 8 == 0 and k:
        np.testing.assert_array_equal(cube_math._int8_mm_int(a, b).numpy(), want)


def test_the_fastest_exact_int8_method_is_picked_once():
    method = cube_math._int8_gemm()
    assert method in (cube_math._int8_mm_f32, cube_math._int8_mm_int)
    assert cube_math._int8_gemm() is method
