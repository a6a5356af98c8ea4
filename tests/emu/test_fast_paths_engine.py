"""The engine's data-path fast paths (issue 19) against the general path.

A fixpipe to GM that lands its L0C tile unconverted (fp32 -> fp32, int32 -> int32, no scale or ReLU) lends the tile
to its landing instead of copying it at its start (Engine._execute, engine._lends); an mmad into the tile before the
landing first takes the sample. The values landed must be those of the general path (a fixpipe with a scale of 1 or a
ReLU over non-negative values samples at its start), bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.isa import OPS

M = N = K = 16


@pytest.fixture
def samples(monkeypatch):
    """Count the fixpipe-to-GM samples the engine takes (those it defers to the landing do not run at the start)."""
    counts = {"copy_l0c_to_gm": 0}
    spec = OPS["copy_l0c_to_gm"]
    real = spec.execute

    def counting(ins):
        counts["copy_l0c_to_gm"] += 1
        real(ins)
    monkeypatch.setattr(spec, "execute", counting)
    return counts


@kernel(cores="aic")
def _two_products(ctx, a_gm, b_gm, y_gm, z_gm, dtype, how):
    """y_gm = a_gm[0] @ b_gm[0], then z_gm = a_gm[1] @ b_gm[1] through the same L0C tile: the second mmad may
    overwrite the tile after y_gm's fixpipe has read it and before y_gm has landed. ``how``: "plain" (lent),
    "scale" (scale 1.0, sampled at the start) or "relu" (ReLU, sampled at the start)."""
    c = ctx.l0c.alloc((M, N), "int32" if dtype == "int8" else "fp32")
    kw = {"scale": 1.0} if how == "scale" else {"relu": True} if how == "relu" else {}
    for i, out in enumerate((y_gm, z_gm)):
        a1, b1 = ctx.l1.alloc((M, K), dtype), ctx.l1.alloc((K, N), dtype)
        a0, b0 = ctx.l0a.alloc((M, K), dtype), ctx.l0b.alloc((K, N), dtype)
        yield ctx.copy_gm_to_l1(a1, a_gm[i])
        yield ctx.copy_gm_to_l1(b1, b_gm[i])
        yield ctx.copy_l1_to_l0a(a0, a1)
        yield ctx.copy_l1_to_l0b(b0, b1)
        yield ctx.mmad(c, a0, b0, accumulate=False)
        yield ctx.copy_l0c_to_gm(out, c, **kw)


def _run(dtype: str, how: str, die: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        a = rng.integers(0, 50, (2, M, K)).astype(np.int8)
        b = rng.integers(0, 50, (2, K, N)).astype(np.int8)
        acc = "fp32" if how == "scale" else "int32"     # a dequant scale needs a float destination
    else:
        a = np.abs(rng.standard_normal((2, M, K))).astype(np.float32)     # non-negative: ReLU changes nothing
        b = np.abs(rng.standard_normal((2, K, N))).astype(np.float32)
        acc = "fp32"
    pod = Pod(cloudmatrix384(dies=2))
    a_gm, b_gm = pod.to_gm(0, a, dtype=dtype), pod.to_gm(0, b, dtype=dtype)
    y_gm, z_gm = pod.alloc(die, (M, N), acc), pod.alloc(die, (M, N), acc)
    res = pod.launch(_two_products, aic=1, args=(a_gm, b_gm, y_gm, z_gm, dtype, how))
    return y_gm.numpy(), z_gm.numpy(), res.end_us, a, b


@pytest.mark.parametrize("die", [0, 1])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_lent_fixpipe_lands_what_the_sampling_one_lands(samples, dtype, die):
    """Lent (plain) and sampled (scale 1, ReLU on non-negative values) fixpipes land the same bits at the same
    modeled time, on the fixpipe's die and on another (a staged write); the first of the two plain fixpipes takes
    its sample when the second mmad overwrites its tile in flight, the second is never sampled at its start."""
    y, z, end, a, b = _run(dtype, "plain", die)
    lent = samples["copy_l0c_to_gm"]
    hows = ("scale",) if dtype == "int8" else ("scale", "relu")     # ReLU on int32 passes it as it is
    for how in hows:
        samples["copy_l0c_to_gm"] = 0
        y2, z2, end2, _, _ = _run(dtype, how, die)
        assert samples["copy_l0c_to_gm"] == 2           # the general path samples both at their start
        if dtype == "int8":      # int32 landed as it is, against int32 -> fp32 x 1.0 (exact below 2**24)
            y2, z2 = y2.astype(np.int32), z2.astype(np.int32)
        assert y.tobytes() == y2.tobytes() and z.tobytes() == z2.tobytes()
        assert end == end2
    wide = np.int64 if dtype == "int8" else np.float64
    ref = [a[i].astype(wide) @ b[i].astype(wide) for i in range(2)]
    got = [y, z]
    for i in range(2):           # the first product, not the second that overwrote its tile before it landed
        if dtype == "int8":
            assert np.array_equal(got[i], ref[i])
        else:
            assert np.allclose(got[i], ref[i], rtol=1e-2)
    assert not np.array_equal(y, z)
    assert lent <= 1             # the second plain fixpipe lends; the first samples only when overwritten in flight


@kernel(cores="aic")
def _overwritten(ctx, a_gm, b_gm, y_gm):
    """One fixpipe of a tile, then an mmad into that tile issued right behind it."""
    c = ctx.l0c.alloc((M, N), "fp32")
    a1, b1 = ctx.l1.alloc((2, M, K), "bf16"), ctx.l1.alloc((2, K, N), "bf16")
    a0, b0 = ctx.l0a.alloc((2, M, K), "bf16"), ctx.l0b.alloc((2, K, N), "bf16")
    yield ctx.copy_gm_to_l1(a1, a_gm)
    yield ctx.copy_gm_to_l1(b1, b_gm)
    for i in range(2):
        yield ctx.copy_l1_to_l0a(a0[i], a1[i])
        yield ctx.copy_l1_to_l0b(b0[i], b1[i])
    yield ctx.mmad(c, a0[0], b0[0], accumulate=False)
    yield ctx.copy_l0c_to_gm(y_gm, c)
    yield ctx.mmad(c, a0[1], b0[1], accumulate=True)      # after the fixpipe read c, before y_gm lands


@pytest.mark.parametrize("die", [0, 1])
def test_an_mmad_into_a_lent_tile_before_the_landing_takes_the_sample_first(samples, die):
    """The mmad overwrites the tile before y_gm lands (its WAR wait is the fixpipe's busy end, not its landing): the
    lent fixpipe samples then, and y_gm holds the first product only."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, M, K)).astype(np.float32)
    b = rng.standard_normal((2, K, N)).astype(np.float32)
    pod = Pod(cloudmatrix384(dies=2), trace=True)
    y_gm = pod.alloc(die, (M, N), "fp32")
    res = pod.launch(_overwritten, aic=1, args=(pod.to_gm(0, a, dtype="bf16"), pod.to_gm(0, b, dtype="bf16"), y_gm))
    fix = [s for s in res.trace.slices if s[3] == "copy_l0c_to_gm"]
    mm = [s for s in res.trace.slices if s[3] == "mmad"]
    assert mm[-1][4] < res.end_us * 1e6        # the second mmad started before the run's end (the landing)
    a16 = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    b16 = b.astype(ml_dtypes.bfloat16).astype(np.float32)
    first = a16[0] @ b16[0]
    assert np.allclose(y_gm.numpy(), first, rtol=1e-5, atol=1e-5)
    assert not np.allclose(y_gm.numpy(), first + a16[1] @ b16[1], rtol=1e-3, atol=1e-3)
    assert len(fix) == 1 and samples["copy_l0c_to_gm"] == 1
