"""Profile, GM arenas and views, core-local buffers (capacity, alignment, poison), ND <-> NZ layout."""
import dataclasses
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_emu import (AddressError, ArgumentError, CapacityError, Pod, ShapeError, cloudmatrix384, kernel, nd_to_nz,
                        nz_shape, nz_to_nd)
from ascend_emu.buffers import LocalBuffer
from ascend_emu.memory import zeroed_bytes
from ascend_emu.profile import HardwareProfile


def test_profile_is_frozen_and_replaceable():
    p = cloudmatrix384()
    assert (p.aic_per_die, p.aiv_per_die, p.ub_bytes, p.l0c_bytes, p.dies) == (24, 48, 192 * 1024, 128 * 1024, 768)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hbm_gbps = 1.0
    q = dataclasses.replace(p, hbm_gbps=800.0)
    assert q.hbm_gbps == 800.0 and p.hbm_gbps == 1600.0
    assert p.clock_ghz == 1.85                       # Ascend910_9391.ini cube_freq=1850
    assert p.peak_cube_tflops("bf16") == pytest.approx(24 * 4096 * 2 * 1.85e9 / 1e12)   # ~364 TFLOPS
    assert p.peak_cube_tflops("int8") == pytest.approx(2 * p.peak_cube_tflops("bf16"))
    assert isinstance(cloudmatrix384(dies=4), HardwareProfile) and cloudmatrix384(dies=4).dies == 4
    with pytest.raises(ValueError, match="768"):
        cloudmatrix384(dies=1000)


def test_gm_round_trip_and_views():
    pod = Pod(cloudmatrix384(dies=2))
    x = np.arange(6 * 64, dtype=np.float32).reshape(6, 64)
    g = pod.to_gm(1, x, name="x")
    assert g.die == 1 and np.array_equal(g.numpy(), x)
    assert np.array_equal(g[2].numpy(), x[2]) and np.array_equal(g[1:4, 8:16].numpy(), x[1:4, 8:16])
    assert g[1:4, 8:16].blocks() == (3, 32)            # three strided 32-byte blocks
    assert g[1:4].is_contiguous and not g[:, :8].is_contiguous
    with pytest.raises(AddressError, match="size 6"):
        g[6]
    with pytest.raises(AddressError, match="out of range for dim 1 of size 64"):
        g[:, 60:70]
    # raw addresses resolve inside the allocation and nowhere else
    w = pod.gm_at(1, g.addr + 4 * 64, (64,), "fp32")
    assert np.array_equal(w.numpy(), x[1])
    with pytest.raises(AddressError, match="outside every allocation"):
        pod.gm_at(1, g.addr + 10 ** 6, (4,), "fp32")
    with pytest.raises(AddressError, match="dies 0..1"):
        pod.alloc(2, (4,), "fp32")


def test_view_memo_returns_the_same_view_for_the_same_key_only():
    """Slices and reshapes are memoised per parent view: a repeated key gives the same view, a different key (or an
    int tuple that spells the same numbers as a slice) never aliases another key's view."""
    pod = Pod(cloudmatrix384(dies=1))
    x = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    g = pod.to_gm(0, x)
    assert g[1, :4] is g[1, :4] and g[1:3, 2:5] is g[1:3, 2:5] and g.reshape(24, 8) is g.reshape(24, 8)
    assert np.array_equal(g[1, 2, 3].numpy(), x[1, 2, 3]) and np.array_equal(g[1:2:3].numpy(), x[1:2:3])
    assert g[1, 2, 3].shape == () and g[1:2:3].shape == (1, 6, 8)
    assert np.array_equal(g[:, 1, 2:4].numpy(), x[:, 1, 2:4]) and np.array_equal(g[:, 1].numpy(), x[:, 1])
    assert np.array_equal(g.reshape(8, 24).numpy(), x.reshape(8, 24))
    assert np.array_equal(g.reshape(24, 8)[5, 1:3].numpy(), x.reshape(24, 8)[5, 1:3])
    with pytest.raises(ShapeError):
        g.reshape(5, 5)
    with pytest.raises(AddressError, match="size 6"):
        g[0, 6]


def test_bf16_host_writes_round_like_torch():
    import torch
    pod = Pod(cloudmatrix384(dies=1))
    x = torch.randn(1000) * 100
    g = pod.alloc(0, (1000,), "bf16")
    g.write(x.numpy())
    assert np.array_equal(g.numpy().view(np.uint16), x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_gm_capacity_and_phantom():
    pod = Pod(cloudmatrix384(dies=1))
    big = pod.alloc(0, (32, 1024, 1024, 1024), "uint8", phantom=True)      # 32 GiB of address space, no bytes
    assert big.phantom and big.arr is None
    with pytest.raises(CapacityError, match="capacity is 68719476736 bytes"):
        pod.alloc(0, (40, 1024, 1024, 1024), "uint8", phantom=True)
    with pytest.raises(AddressError, match="phantom"):
        big[0, 0, 0].numpy()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "uint8", "int16", "int32", "int64", "uint32",
                                   "fp64"])
def test_fresh_tiles_hold_the_poison_bytes_of_their_dtype(dtype):
    """A fresh tile's bytes (filled through an integer view) are those of ``poison(dtype)`` assigned to the dtype."""
    from ascend_emu.dtypes import as_dtype, poison
    dt = as_dtype(dtype)
    t = LocalBuffer("UB", 192 * 1024, 32, "die 0 aiv 0", 0).alloc((5, 7), dtype)
    want = np.empty((5, 7), dtype=dt)
    want[...] = poison(dt)
    assert t.numpy().tobytes() == want.tobytes()


def test_local_buffer_capacity_alignment_and_poison():
    ub = LocalBuffer("UB", 192 * 1024, 32, "die 0 aiv 0", 0)
    a = ub.alloc((3,), "fp32")              # 12 bytes, padded to 32
    b = ub.alloc((4, 8), "int8")
    assert a.addr == 0 and b.addr == 32
    assert np.isnan(a.numpy()).all()
    assert (b.numpy().view(np.uint8) == 0x5A).all()
    c = ub.alloc((16,), "bf16")
    assert np.isnan(c.numpy().astype(np.float32)).all()
    with pytest.raises(CapacityError, match=r"needs 200000 bytes.*196608 bytes"):
        ub.alloc((200000,), "int8")
    l0a = LocalBuffer("L0A", 64 * 1024, 512, "die 0 aic 0", 0)
    l0a.alloc((1,), "int8")
    assert l0a.alloc((16,), "int8").addr == 512
    # a persistent kernel's next round: release back to a mark and carve the same tiles again
    m = ub.mark()
    assert ub.alloc((64,), "fp32").addr == m
    ub.release(m)
    assert ub.alloc((64,), "fp32").addr == m
    with pytest.raises(ArgumentError, match="release to 999999 bytes"):
        ub.release(999999)


def test_buffer_spaces_per_core_kind():
    seen = {}

    @kernel(cores="mix")
    def probe(ctx):
        if ctx.is_aic:
            seen["aic"] = (ctx.l1.capacity, ctx.l0a.capacity, ctx.l0b.capacity, ctx.l0c.capacity, ctx.l0a.align)
            with pytest.raises(AddressError, match="no UB"):
                ctx.ub
        else:
            seen["aiv"] = ctx.ub.capacity
            with pytest.raises(AddressError, match="no L1"):
                ctx.l1
        yield ctx.scalar(1)

    Pod(cloudmatrix384(dies=1)).launch(probe, aic=1)
    assert seen == {"aic": (512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024, 512), "aiv": 192 * 1024}


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(0, 2), m=st.integers(1, 40), n=st.integers(1, 70),
       dtype=st.sampled_from([np.int8, np.float16, np.float32, ml_dtypes.bfloat16]))
def test_nd_nz_round_trip(batch, m, n, dtype):
    shape = (3,) * batch + (m, n)
    a = (np.arange(np.prod(shape)) % 97).astype(np.float32).reshape(shape).astype(dtype)
    nz = nd_to_nz(a)
    n0 = 32 // np.dtype(dtype).itemsize
    assert nz.shape == nz_shape(shape, dtype) == (3,) * batch + (-(-n // n0), -(-m // 16), 16, n0)
    assert np.array_equal(nz_to_nd(nz, shape).astype(np.float32), a.astype(np.float32))
    # element (i, j) sits at [j // n0, i // 16, i % 16, j % n0]; padding is zero
    i, j = m - 1, n - 1
    assert nz[(0,) * batch + (j // n0, i // 16, i % 16, j % n0)] == a[(0,) * batch + (i, j)]
    assert float(np.abs(nz.astype(np.float32)).sum()) == pytest.approx(float(np.abs(a.astype(np.float32)).sum()))


def test_nz_shape_errors():
    with pytest.raises(ShapeError):
        nz_to_nd(np.zeros((1, 1, 16, 16), np.float16), (20, 16))


@kernel(cores="aiv")
def _double(ctx, x_gm, y_gm):
    t = ctx.ub.alloc(x_gm.shape, x_gm.dtype)
    yield ctx.copy_gm_to_ub(t, x_gm)
    yield ctx.vec.muls(t, t, 2.0)
    yield ctx.copy_ub_to_gm(y_gm, t)


def test_to_gm_without_copy_aliases_the_host_array():
    """copy=False: kernels read what the array holds at each run and their writes land in it; a copy does not."""
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = np.zeros((8, 8), np.float32)
    x_gm, out_gm = pod.to_gm(0, x, copy=False), pod.to_gm(0, out, copy=False)
    copied = pod.to_gm(0, x)
    pod.launch(_double, aiv=1, args=(x_gm, out_gm))
    assert np.array_equal(out, 2 * np.arange(64, dtype=np.float32).reshape(8, 8))    # the run wrote the host array
    x[:] = 1                                                                          # a host change between runs
    pod.launch(_double, aiv=1, args=(x_gm, out_gm))
    assert np.all(out == 2) and np.all(x_gm.numpy() == 1)
    assert copied.numpy()[0, 1] == 1.0 and not np.shares_memory(copied.arr, x)


def test_to_gm_without_copy_aliases_torch_bf16():
    import torch
    t = torch.arange(16, dtype=torch.float32).bfloat16()
    g = Pod(cloudmatrix384(dies=1), trace=False).to_gm(0, t, copy=False)
    t[3] = 100.0
    assert g.numpy()[3] == 100.0 and g.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("array,dtype,why", [
    (np.zeros((4, 4), np.float32)[:, ::2], None, "not C-contiguous"),
    (np.zeros(4, np.float32), "bf16", "dtype float32 is not the GM dtype"),
    (np.frombuffer(bytes(16), np.float32), None, "read-only"),
    (np.zeros(0, np.float32), None, "empty"),
])
def test_to_gm_without_copy_says_why_it_cannot_alias(array, dtype, why):
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    with pytest.raises(ArgumentError, match=why):
        pod.to_gm(0, array, dtype=dtype, copy=False)
    pod.to_gm(0, array, dtype=dtype)                     # copy=True takes it


@kernel(cores="aiv")
def _many_tiles(ctx, x_gm, y_gm, iters):
    for _ in range(iters):
        t = ctx.ub.alloc((8, 64), "fp32")                  # a tile per step: each keeps its last records
        yield ctx.copy_gm_to_ub(t, x_gm[ctx.block_idx])
        yield ctx.vec.muls(t, t, 2.0)
        yield ctx.copy_ub_to_gm(y_gm[ctx.block_idx], t)


def test_a_finished_core_leaves_no_cyclic_garbage_per_instruction():
    """Tiles, their dependency records and the instructions in them are freed by reference counting when a core
    finishes (issue 19: a garbage-collection pass over every instruction after each run cost seconds at scale)."""
    import gc
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x, y = pod.alloc(0, (8, 8, 64), "fp32"), pod.alloc(0, (8, 8, 64), "fp32")
    pod.launch(_many_tiles, aiv=8, args=(x, y, 2))          # warm up: first-call caches
    gc.collect()
    gc.disable()
    try:
        run = pod.launch(_many_tiles, aiv=8, args=(x, y, 50))
        garbage = gc.collect()
    finally:
        gc.enable()
    assert run.instructions == 8 * 50 * 3 + 8
    assert garbage < 20 * 8          # a few objects per core (its context), none per instruction (was 6461)


def test_slices_of_gm_are_not_all_kept_alive_by_their_parent():
    """A sweep over a big GM tensor (a window's slots, rows) takes each slice about once: the parent's memo keeps
    a bounded number (issue 19: every slice, with its L2 footprint, lived as long as the tensor)."""
    import gc
    import weakref

    from ascend_emu import Pod, cloudmatrix384
    from ascend_emu.views import MEMO_GM
    pod = Pod(cloudmatrix384(dies=1))
    win = pod.alloc(0, (2, 64, 64, 512), "int8", phantom=True)
    refs = [weakref.ref(win[h, r, s, :256]) for h in range(2) for r in range(64) for s in range(8)]
    gc.collect()
    assert sum(r() is not None for r in refs) <= MEMO_GM + 1
    assert win[1, 3, 5, :256] is win[1, 3, 5, :256]          # a slice taken again soon is still shared


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="resident size read from Linux's /proc")
def test_a_large_gm_allocation_costs_only_the_pages_written():
    """A 256 MiB window written one row per 2 MiB stays a few MiB resident (numpy's own huge-page allocations would
    make each touched row cost 2 MiB), and reads back as zeros elsewhere."""
    pod = Pod(cloudmatrix384(dies=1))
    before = _resident_bytes()
    win = pod.gm.alloc(0, (128, 2 << 20), np.uint8, name="window")
    for r in range(128):
        win[r, :64].write(np.full(64, r + 1, np.uint8))
    grown = _resident_bytes() - before
    assert grown < 16 << 20, grown
    got = win.arr
    assert np.array_equal(got[:, 0], np.arange(1, 129, dtype=np.uint8))
    assert not got[:, 64:4096].any() and not got[:, -4096:].any()


@given(nbytes=st.integers(1, 3 << 20), writes=st.lists(st.tuples(st.integers(0, 3 << 20), st.integers(0, 255)),
                                                       max_size=8))
@settings(max_examples=30, deadline=None)
def test_gm_bytes_read_back_as_zeros_plus_what_was_written(nbytes, writes):
    """Either allocation path (below and above SPARSE_MIN_BYTES) holds exactly a zero array with the writes applied."""
    data = zeroed_bytes(nbytes)
    model = np.zeros(nbytes, np.uint8)
    for at, value in writes:
        if at < nbytes:
            data[at] = value
            model[at] = value
    assert data.flags.writeable and data.dtype == np.uint8 and np.array_equal(data, model)


@st.composite
def _index(draw, shape):
    """An in-range key for a view of ``shape`` (views never clamp): per leading dim an int (maybe negative) or a
    slice (maybe stepped, empty, open-ended or negative), sometimes ending in an Ellipsis."""
    parts = []
    for n in shape[:draw(st.integers(0, len(shape)))]:
        if n and draw(st.booleans()):
            parts.append(draw(st.integers(-n, n - 1)))
            continue
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        start = draw(st.sampled_from([a, None] if a == 0 else [a, a - n] if a < n else [a]))
        stop = draw(st.sampled_from([b, None] if b == n else [b, b - n] if b > 0 else [b]))
        parts.append(slice(start, stop, draw(st.none() | st.integers(1, 3))))
    if draw(st.booleans()) and len(parts) < len(shape):
        parts.append(Ellipsis)
    return tuple(parts)


@given(data=st.data(), shape=st.lists(st.integers(1, 5), min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_a_sliced_view_matches_numpy_and_spans_its_bytes(data, shape):
    """Any slice of a view (of a GM tensor or of a slice of one) holds what numpy's slice holds, and its byte extent
    [lo, hi) is the first to one past the last byte of its elements (empty: lo == hi)."""
    pod = Pod(cloudmatrix384(dies=1))
    host = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    base = pod.to_gm(0, host)
    parent, parent_host = base, host
    if data.draw(st.booleans()):                      # slice a slice (a non-zero offset and strided parent)
        key = data.draw(_index(shape))
        parent, parent_host = base[key], host[key]
        if parent_host.ndim == 0:
            return
    key = data.draw(_index(list(parent_host.shape)))
    want = parent_host[key]
    got = parent[key]
    assert got.shape == want.shape and np.array_equal(got.arr, want)
    if want.size == 0:
        assert got.lo == got.hi
    else:
        offsets = np.array([got.offset])
        if want.ndim:
            index = np.indices(want.shape).reshape(want.ndim, -1).T          # every element's index
            offsets = got.offset + index @ np.array(got.strides, np.int64)
        assert (got.lo, got.hi) == (int(offsets.min()), int(offsets.max()) + 4), (got.lo, got.hi)
