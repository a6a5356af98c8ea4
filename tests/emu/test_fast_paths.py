"""Fast paths of the per-instruction work (issue 19, send/recv at 16 MiB): each must give exactly what the general
path gives. Views of contiguous bytes slice the store instead of building an array over its buffer; a poll of one
integer word compares Python ints instead of calling a ufunc; scalar latencies are looked up once per die pair;
lazy loads are filed under their tile (``Store.loads``), apart from the loans of their GM source (``Store.lent``)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.dtypes import bf16
from ascend_emu.isa import COMPARE, word_poll
from ascend_emu.timing import Paths
from ascend_emu.views import Store, View

DTYPES = [np.dtype(t) for t in ("uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                 "float16", "float32", "float64")] + [np.dtype(bf16)]


def _general_arr(v: View) -> np.ndarray:
    """What ``View.arr`` returned before its contiguous fast path: an array over the store's buffer."""
    return np.ndarray(v.shape, dtype=v.dtype, buffer=v.store.data, offset=v.offset if v.hi > v.lo else 0,
                      strides=v.strides)


@st.composite
def views(draw):
    """A view of a random store: dtype, 0-3 dims (some of size 1 or 0), C-contiguous or strided, at an offset."""
    dt = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    item = dt.itemsize
    strides, step = [], item * draw(st.sampled_from([1, 1, 2]))
    for n in reversed(shape):
        strides.insert(0, step if draw(st.booleans()) or n == 1 else step * 2)
        step = strides[0] * max(n, 1)
    offset = item * draw(st.integers(0, 4))
    span = offset + sum((n - 1) * s for n, s in zip(shape, strides) if n) + item
    store = Store("t", span + 64, False, "GM", 0, 0)
    store.data[...] = np.random.default_rng(len(shape)).integers(0, 256, store.nbytes, dtype=np.uint8)
    return View(store, offset, shape, tuple(strides), dt)


@settings(max_examples=300, deadline=None)
@given(views())
def test_a_views_array_is_the_general_one_and_aliases_the_store(v):
    got, want = v.arr, _general_arr(v)
    if got.size:                    # numpy's flag, for a view that holds bytes (size-1 dims: any stride)
        assert v.is_contiguous == want.flags.c_contiguous
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    if got.size:
        before = got.tobytes()
        v.store.data ^= 0xFF                              # a write to the store shows through the array
        assert got.tobytes() == _general_arr(v).tobytes() != before
        got[...] = np.zeros((), got.dtype)               # a write through the array lands in the store
        assert _general_arr(v).tobytes() == bytes(got.nbytes)


def test_a_phantom_view_has_no_array():
    v = View(Store("p", 64, True, "GM", 0, 0), 0, (16,), (4,), np.dtype(np.int32))
    assert v.arr is None


INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(INT_DTYPES), st.sampled_from(["int64", "int32", "uint32", "int8"]),
       st.sampled_from(sorted(COMPARE)), st.data())
def test_a_one_word_poll_compares_as_the_ufunc_does(word_dt, value_dt, cmp, data):
    info, vinfo = np.iinfo(word_dt), np.iinfo(value_dt)
    word = np.array([data.draw(st.integers(int(info.min), int(info.max)))], dtype=word_dt)
    edges = [int(info.min), int(info.max), int(info.min) - 1, int(info.max) + 1, 0, -1, 1]
    raw = data.draw(st.one_of(st.sampled_from(edges), st.integers(int(vinfo.min), int(vinfo.max))))
    value = np.asarray(min(max(raw, int(vinfo.min)), int(vinfo.max)), dtype=value_dt)
    store = Store("w", 8, False, "GM", 0, 0)
    v = View(store, 0, (1,), (word.dtype.itemsize,), word.dtype)
    v.arr[...] = word
    fast = word_poll(v, cmp, value)
    if word_dt == "uint64":
        assert fast is None                 # 64-bit unsigned words keep numpy's comparison
        return
    assert fast is not None
    assert fast[0](v.arr.item(), fast[1]) == bool(COMPARE[cmp](v.arr, value)[0])


@pytest.mark.parametrize("value", [np.asarray(1, np.uint64), np.asarray(1.5), np.asarray(2.0, np.float32)])
def test_a_poll_against_a_float_or_a_64_bit_unsigned_value_keeps_the_ufunc(value):
    v = View(Store("w", 8, False, "GM", 0, 0), 0, (1,), (4,), np.dtype(np.int32))
    assert word_poll(v, "ge", value) is None


def test_a_poll_of_several_words_or_an_array_value_keeps_the_ufunc():
    store = Store("w", 32, False, "GM", 0, 0)
    two = View(store, 0, (2,), (4,), np.dtype(np.int32))
    one = View(store, 0, (1,), (4,), np.dtype(np.int32))
    assert word_poll(two, "ge", np.asarray(1)) is None
    assert word_poll(one, "ge", np.asarray([1])) is None
    assert word_poll(one, "ge", np.asarray(1)) is not None


@kernel(cores="aiv")
def _flag_then_poll(ctx, flag, out):
    if ctx.block_idx == 0:
        yield ctx.gm_store(flag, np.int32(-3))
        yield ctx.gm_store(flag, np.int32(7))
    else:
        seen = yield ctx.wait_gm(flag, "ge", 5)
        yield ctx.gm_store(out, seen)


def test_a_poll_of_one_word_wakes_at_the_landing_that_satisfies_it():
    pod = Pod(cloudmatrix384(dies=2), trace=False)
    flag, out = pod.alloc(1, (1,), "int32"), pod.alloc(1, (1,), "int32")
    pod.launch(_flag_then_poll, aiv=2, args=(flag, out))
    assert out.numpy().tolist() == [7]


def test_scalar_latencies_are_those_of_the_route_in_any_order_of_lookups():
    prof = cloudmatrix384(dies=40)
    pairs = [(0, 0), (0, 1), (0, 2), (0, 16), (17, 3), (39, 0)]
    cold = Paths(prof)
    want = {(a, b, rt): cold.l2_lat + (cold.link(a, b)[1] * (2 if rt else 1) if a != b else 0)
            for a, b in pairs for rt in (False, True)}
    warm = Paths(prof)
    for key in list(want) + list(reversed(want)) + list(want):
        assert warm.scalar_lat(*key) == want[key]
    assert len({want[(0, 2, True)], want[(0, 16, True)]}) == 2          # another server: a longer route


@kernel(cores="aiv")
def _loads_filed(ctx, src, seen):
    t = ctx.ub.alloc((2, 256), "uint8")
    for i in range(2):
        yield ctx.copy_gm_to_ub(t[i], src[ctx.block_idx * 512 + i * 256:][:256])
    yield ctx.pipe_barrier()            # both loads have started: lent, not copied
    st_t, st_src = t.store, src.store
    seen.append((len(st_t.loads or ()), st_t.lent, len(st_src.lent or ()), st_src.loads))
    yield ctx.copy_ub_to_gm(src[4096 + ctx.block_idx * 256:][:256], t[1])


def test_lazy_loads_are_filed_under_their_tile_and_their_source_only_as_loans():
    """A write into a GM source many tiles are lent from never looks through loads into tiles, and a read of a
    tile never looks through its source's loans: the two kinds are kept apart."""
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    src = pod.to_gm(0, x)
    seen = []
    pod.launch(_loads_filed, aiv=4, args=(src, seen))
    assert len(seen) == 4
    for n_loads, tile_lent, n_src_lent, src_loads in seen:
        assert n_loads == 2 and tile_lent is None and src_loads is None and n_src_lent >= 2
    got = src.numpy()
    for c in range(4):          # each core's second tile went back out: the bytes it loaded
        assert np.array_equal(got[4096 + c * 256:4096 + (c + 1) * 256], x[c * 512 + 256:c * 512 + 512])
    assert pod.engine.n_lent == 0 and not pod.engine.lent_stores


@pytest.mark.parametrize("n", [1, 3])
def test_is_contiguous_of_one_dimension(n):
    s = Store("t", 64, False, "UB", 0, 0)
    assert View(s, 0, (n,), (4,), np.dtype(np.int32)).is_contiguous
    assert View(s, 0, (n,), (8,), np.dtype(np.int32)).is_contiguous == (n == 1)
    assert View(s, 0, (0,), (8,), np.dtype(np.int32)).is_contiguous is False
