"""The window payloads of a partitioned run (ascend_emu.messages): pickled once, in batches per message kind (the
staged transfers' records flat: ints and objects per record), with a staged transfer's handle going home as its key
alone; a message that would land inside its own window is an error; each worker reports what its exchanges cost."""
from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, messages
from ascend_emu.errors import EmulatorError
from ascend_emu.isa import OPS
from ascend_emu.messages import Codec
from ascend_emu.views import View
from tests.emu.test_workers import DIES, _bulk_run, _protocol


@pytest.fixture(scope="module")
def payloads():
    """Every payload worker 0 sent and received in a two-worker run of reads, writes and relays between chips."""
    sent, received = [], []
    pack, unpack = Codec.pack, Codec.unpack

    def packing(codec, done, msgs, peer):
        payload = pack(codec, done, msgs, peer)
        sent.append((len(msgs), payload))
        return payload

    def unpacking(codec, payload, heap):
        before = len(heap)
        done = unpack(codec, payload, heap)
        received.append((payload, len(heap) - before))
        return done
    Codec.pack, Codec.unpack = packing, unpacking
    try:
        outcome = _bulk_run(2)
    finally:
        Codec.pack, Codec.unpack = pack, unpack
    return sent, received, outcome


def _records(name, data):
    """A payload's batch of kind ``name`` as records: {field: value} (a flat kind's ints and objects by
    messages.FIELDS / OBJS, else its (t, origin, count, die, data) tuples)."""
    if name not in messages.FIELDS:
        return [dict(zip(("t", "origin", "count", "die", "data"), rec)) for rec in data]
    ints, objs, views, table = data
    ints, views = struct.unpack(f"<{len(ints) // 8}q", ints), struct.unpack(f"<{len(views) // 8}q", views)
    fields, names = messages.FIELDS[name], messages.OBJS[name]
    assert len(ints) % len(fields) == 0 and len(views) % len(messages.VIEW_INTS) == 0
    n = len(ints) // len(fields)
    assert len(objs) == n * len(names)
    return [{**dict(zip(fields, ints[i * len(fields): (i + 1) * len(fields)])),
             **dict(zip(names, objs[i * len(names): (i + 1) * len(names)]))} for i in range(n)]


def test_a_window_payload_is_one_pickle_of_batches_per_kind(payloads):
    sent, received, _ = payloads
    assert sum(n for n, _ in sent) > 0 and sum(n for _, n in received) > 0
    kinds = set()
    for count, payload in sent:
        done, batches = pickle.loads(payload)
        assert isinstance(done, dict)
        assert sum(len(_records(name, b)) for name, b in batches.items()) == count
        for name, batch in batches.items():
            assert name in messages._BY_NAME
            kinds.add(name)
            for rec in _records(name, batch):
                assert all(isinstance(rec[k], int) for k in ("t", "origin", "count", "die")), (name, repr(rec))
                assert not any(isinstance(x, bytes) for x in rec.values())       # not pickled twice
    assert {"_pulled", "_pushed", "_replied"} <= kinds


def test_a_handle_going_home_travels_as_its_key(payloads):
    sent, received, _ = payloads
    homeward = full = 0
    for _, payload in sent + [(None, p) for p, _ in received]:
        for name, batch in pickle.loads(payload)[1].items():
            for rec in _records(name, batch) if name in ("_pulled", "_pushed", "_replied") else ():
                if rec["home"]:         # its ident alone: nothing else of the instruction travels
                    homeward += 1
                    assert rec["ident"] > 0 and rec["ndsts"] == -1
                    assert rec["spec"] is rec["ins_origin"] is rec["hb"] is None
                else:
                    full += 1
                    assert rec["spec"] in OPS and rec["launch"] >= 0 and rec["core"] >= 0
    assert homeward > 0 and full > 0


def test_numpy_ints_in_a_payload_come_back_with_their_types():
    """A kernel's numpy-int slice bounds (in a view's shape) pickle as their type and value, not through numpy's
    reduce (dtype and bytes), and come back as they were."""
    pod = Pod(cloudmatrix384(dies=2))
    codec = Codec(pod.engine, {}, [])
    ints = [np.int64(-3), np.int32(7), np.uint8(200), np.uint64(2 ** 63), 5, np.float32(1.5), np.bool_(True)]
    payload = codec.pack({0: ints}, [], 1)
    back = codec.unpack(payload, [])[0]
    assert back == ints and [type(x) for x in back] == [type(x) for x in ints]
    assert len(payload) < len(pickle.dumps(({0: ints}, {}), protocol=pickle.HIGHEST_PROTOCOL))


def test_views_of_equal_layouts_travel_with_their_own_int_types():
    """Views share one layout entry per batch, but equal shapes whose ints differ in type (a numpy int from a
    kernel's slice) each come back as they were."""
    pod = Pod(cloudmatrix384(dies=2))
    base = pod.alloc(1, (8, 64), "fp32")
    views = [View(base.store, base.offset, shape, base.strides, base.dtype)
             for shape in ((8, 64), (8, 64), (np.int64(8), 64), (np.int64(8), np.int32(64)), (4, 64))]
    codec = Codec(pod.engine, {base.store.uid: base.store}, [])
    flat = messages._Flat(codec, "_replied", 0)
    flat.views(tuple(views))
    payload = pickle.loads(pickle.dumps(flat.data(), protocol=pickle.HIGHEST_PROTOCOL))
    back = messages._Read(codec, payload).views_of(len(views))
    for v, w in zip(views, back):
        assert (w.store, w.offset, w.shape, w.strides, w.dtype, w.lo, w.hi) == (v.store, v.offset, v.shape,
                                                                              v.strides, v.dtype, v.lo, v.hi)
        assert [type(x) for x in w.shape] == [type(x) for x in v.shape]
    assert len(payload[3]) < len(views)         # equal layouts of the same types travel once


_POD2 = Pod(cloudmatrix384(dies=2))
_BASE = _POD2.alloc(1, (64, 64), "fp32")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 64), st.integers(1, 64)), max_size=60))
def test_a_batch_of_any_number_of_views_comes_back_as_sent(specs):
    """The views' int64 buffer grows past its first size (8 views) by doubling; every view comes back in order, with
    its store, offset, layout and row bounds."""
    views = [View(_BASE.store, _BASE.offset + 4 * row * 64, (rows, cols), (4 * 64, 4), _BASE.dtype, row, row + rows)
             for row, rows, cols in specs]
    codec = Codec(_POD2.engine, {_BASE.store.uid: _BASE.store}, [])
    flat = messages._Flat(codec, "_replied", 0)
    flat.views(tuple(views))
    data = pickle.loads(pickle.dumps(flat.data(), protocol=pickle.HIGHEST_PROTOCOL))
    assert len(data[2]) == 8 * len(messages.VIEW_INTS) * len(views)
    back = messages._Read(codec, data).views_of(len(views))
    assert [(w.store, w.offset, w.shape, w.strides, w.dtype, w.lo, w.hi) for w in back] == \
        [(v.store, v.offset, v.shape, v.strides, v.dtype, v.lo, v.hi) for v in views]


def test_the_run_matches_one_process_and_each_worker_reports_its_exchange_costs(payloads):
    _, _, outcome = payloads
    assert outcome == _bulk_run(1)
    pod = Pod(cloudmatrix384(dies=DIES), workers=2)
    src = [pod.to_gm(d, np.zeros((16, 64), np.float32)) for d in range(DIES)]
    dst = [pod.alloc(d, (16, 64), "fp32") for d in range(DIES)]
    words = [pod.alloc(d, (2,), "int32") for d in range(DIES)]
    for d in range(DIES):
        to = (d + 2) % DIES
        pod.stream(d, aiv=2).launch(_protocol, (src[d], dst[d], words[to][0:1], words[to][1:2], words[d][1:2],
                                                words[(d + 3) % DIES][0:1], 1))
    pod.synchronize()
    assert [s["dies"] for s in pod.worker_stats] == [[0, 1, 4, 5], [2, 3]]        # chips dealt out
    for s in pod.worker_stats:
        assert s["windows"] >= 1 and s["messages"] > 0 and s["bytes_sent"] > 0
        assert 0 <= s["wait_s"] <= s["run_s"]
        assert s["encode_s"] + s["decode_s"] + s["wait_cpu_s"] <= s["cpu_s"] + 1e-3


def test_a_message_inside_its_own_window_is_an_error():
    msgs = [(500, 0, 1, 3, None, None), (120, 1, 4, 2, None, None)]
    assert Codec.check_after(msgs, 100, 50) == 120
    with pytest.raises(EmulatorError, match="message to die 2 lands at 120 ps, inside the window that ends at 200 ps"):
        Codec.check_after(msgs, 200, 50)
