"""Lazy GM -> UB loads (issue 19, data moves once): a local load lends its GM source to its tile instead of copying,
a GM-bound copy out of the tile borrows the GM bytes, so a GM -> UB -> GM relay copies once, at the landing. The
semantics stay: inputs sampled at the start, visible at the end. A sanitized pod loads eagerly (its checks follow
every access), which makes it the oracle here: the same kernel must give the same bytes with and without."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel

from .test_lending import count_executions


@pytest.fixture
def executions(monkeypatch):
    """Count the data paths that copy bytes now: a load's copy into its tile, a GM-bound copy's sample."""
    return count_executions(monkeypatch, ("copy_gm_to_ub", "copy_ub_to_gm"))


@kernel(cores="aiv")
def _relay(ctx, src, dst, tiles, kept):
    """``tiles`` pieces of src -> dst through a two-slot ping-pong, as the p2p mtu path moves a slot."""
    n = src.shape[0] // tiles
    ub = ctx.ub.alloc((2, n), src.dtype)
    kept.append(ub)
    for i in range(tiles):
        yield ctx.copy_gm_to_ub(ub[i % 2], src[i * n:(i + 1) * n])
        yield ctx.copy_ub_to_gm(dst[i * n:(i + 1) * n], ub[i % 2])


@pytest.mark.parametrize("dst_die", [0, 1])
def test_a_relay_copies_each_byte_once_at_its_landing(executions, dst_die):
    """No load copies into its tile and no copy out samples during the run: each landing copies from the source;
    the run's end copies the last two loads into their tiles (which then hold what was loaded)."""
    pod = Pod(cloudmatrix384(dies=2), trace=False)
    x = np.arange(8 * 1024, dtype=np.int32)
    src, dst = pod.to_gm(0, x), pod.alloc(dst_die, x.shape, "int32")
    kept = []
    pod.launch(_relay, aiv=1, args=(src, dst, 8, kept))
    assert np.array_equal(dst.numpy(), x)
    assert executions == {"copy_gm_to_ub": 2}
    assert np.array_equal(kept[0].numpy(), x.reshape(8, -1)[[6, 7]])


@kernel(cores="aiv")
def _overwrite_source(ctx, src, dst):
    t = ctx.ub.alloc(src.shape, "int32")
    yield ctx.copy_gm_to_ub(t, src)                     # lent: src stands for t
    yield ctx.copy_ub_to_gm(dst, t)                     # borrows src's bytes
    yield ctx.gm_store(src[0:8], np.full(8, -1, np.int32))   # lands before dst has: dst takes its sample first
    yield ctx.copy_ub_to_gm(dst[8:16], t[0:8])          # t still holds what was loaded


def test_a_source_overwritten_before_the_landing_delivers_the_bytes_loaded():
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x = np.arange(64, dtype=np.int32)
    src, dst = pod.to_gm(0, x), pod.alloc(0, x.shape, "int32")
    pod.launch(_overwrite_source, aiv=1, args=(src, dst))
    want = x.copy()
    want[8:16] = x[0:8]
    assert np.array_equal(dst.numpy(), want)
    assert np.all(src.numpy()[:8] == -1)


@kernel(cores="aiv")
def _lazy_mix(ctx, src, dst, extra, box, mode, other):
    """A load into tile t, then: nothing, a read of t by the vector unit, a partial overwrite of t, or another load
    over t after the copy out; then a copy out of the box of t (rows r0:r1, column blocks c0:c1) to dst."""
    r0, r1, c0, c1 = box
    t = ctx.ub.alloc(src.shape, "fp32")
    u = ctx.ub.alloc(src.shape, "fp32")
    yield ctx.copy_gm_to_ub(t, src)
    if mode == "read":
        yield ctx.vec.adds(u, t, 1.0)
        yield ctx.copy_ub_to_gm(extra, u)
    elif mode == "write":
        yield ctx.vec.adds(t[r0:r1], t[r0:r1], 1.0)
    yield ctx.copy_ub_to_gm(dst[r0:r1, c0:c1], t[r0:r1, c0:c1], pad=True)
    if mode == "reload":
        yield ctx.copy_gm_to_ub(t, other)
        yield ctx.copy_ub_to_gm(extra, t)


def _mix_run(sanitize, rows, cols, box, mode, write_at):
    pod = Pod(cloudmatrix384(dies=2), trace=False, sanitize="collect" if sanitize else False)
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    src, other = pod.to_gm(0, x), pod.to_gm(0, -x)
    dst, extra = pod.alloc(1, x.shape, "fp32"), pod.alloc(0, x.shape, "fp32")
    if write_at is not None:                    # the host writes the source while the kernel runs
        pod.host_write(src[box[0]:box[1]], 1e6, at_us=write_at)
    pod.launch(_lazy_mix, aiv=1, args=(src, dst, extra, box, mode, other))
    return dst.numpy(), extra.numpy(), src.numpy()


@st.composite
def _cases(draw):
    rows = draw(st.integers(1, 6))
    cols = 8 * draw(st.integers(1, 4))                  # 32-byte rows: every box starts aligned
    r0 = draw(st.integers(0, rows - 1))
    r1 = draw(st.integers(r0 + 1, rows))
    c0 = 8 * draw(st.integers(0, cols // 8 - 1))
    c1 = draw(st.integers(c0 + 1, cols))
    mode = draw(st.sampled_from(["none", "read", "write", "reload"]))
    write_at = draw(st.none() | st.floats(0.0, 4.0))
    return rows, cols, (r0, r1, c0, c1), mode, write_at


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_lazy_loads_give_the_bytes_of_eager_ones(case):
    """Sizes, boxes, what happens to the tile and when the host overwrites the source: the same bytes as a pod that
    loads eagerly (sanitized), and the bytes the start-sampling semantics give."""
    rows, cols, box, mode, write_at = case
    lazy = _mix_run(False, rows, cols, box, mode, write_at)
    eager = _mix_run(True, rows, cols, box, mode, write_at)
    for a, b in zip(lazy, eager):
        assert np.array_equal(a, b)
    r0, r1, c0, c1 = box
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    got = lazy[0][r0:r1, c0:c1]
    loaded = x[r0:r1, c0:c1]
    # the load starts first: what it copied is x, or the host's values if they landed before it
    assert np.array_equal(got, loaded + (mode == "write")) or np.all(got == 1e6 + (mode == "write"))


@kernel(cores="aiv")
def _load_and_dma(ctx, src, dst, relayed, n):
    """Each core loads the next core's rows of src into a tile (lazy: src stands for the tile), DMAs its own rows
    to dst and relays the tile to ``relayed``."""
    mine = slice(ctx.block_idx * n, (ctx.block_idx + 1) * n)
    c = (ctx.block_idx + 1) % ctx.block_num
    nxt = slice(c * n, (c + 1) * n)
    t = ctx.ub.alloc((n, src.shape[1]), "int32")
    yield ctx.copy_gm_to_ub(t, src[nxt])
    yield ctx.dma_copy(dst[mine], src[mine])
    yield ctx.copy_ub_to_gm(relayed[nxt], t)


def test_a_gm_source_lent_to_tiles_of_several_cores_lends_its_own_bytes_to_a_dma():
    """The tiles of all cores sit at the same UB offsets, each standing for other GM rows: a DMA out of GM borrows
    its own rows, never the rows some tile at the same offsets stands for."""
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x = np.arange(8 * 16 * 64, dtype=np.int32).reshape(8 * 16, 64)
    src, dst, relayed = pod.to_gm(0, x), pod.alloc(0, x.shape, "int32"), pod.alloc(0, x.shape, "int32")
    pod.launch(_load_and_dma, aiv=8, args=(src, dst, relayed, 16))
    assert np.array_equal(dst.numpy(), x) and np.array_equal(relayed.numpy(), x)
