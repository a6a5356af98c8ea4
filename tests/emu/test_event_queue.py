"""The engine's event queue (engine.Event records, issue 19): events run in the order of their keys (t, origin,
count), as the tuples they replaced did under heapq, whatever order they were queued in; a record reads as that
tuple by index."""
import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.engine import Event, queue

_keys = st.lists(st.tuples(st.integers(0, 10**15), st.integers(-1, 2), st.integers(1, 2**40)),
                 min_size=1, max_size=200, unique=True)


@settings(max_examples=60, deadline=None)
@given(keys=_keys, data=st.data())
def test_events_run_in_key_order_whatever_the_queueing_order(keys, data):
    pod = Pod(cloudmatrix384(dies=1))
    eng = pod.engine
    order = data.draw(st.permutations(keys))
    seen = []

    def record(arg):
        seen.append((eng.now, eng.origin, eng.event_count, arg))
    for t, origin, count in order:
        queue(eng.heap, t, origin, count, 0, record, (t, origin, count))
    reference = []
    for k in order:
        heapq.heappush(reference, k)
    expected = [heapq.heappop(reference) for _ in order]
    eng.run()
    assert [s[3] for s in seen] == expected == sorted(keys)
    assert [s[:3] for s in seen] == expected        # the engine's key of the running event is the event's
    assert not eng.heap


@settings(max_examples=30, deadline=None)
@given(keys=_keys, data=st.data())
def test_until_stops_before_the_first_event_at_or_after_it(keys, data):
    pod = Pod(cloudmatrix384(dies=1))
    eng = pod.engine
    until = data.draw(st.integers(0, 10**15))
    seen = []
    for t, origin, count in keys:
        queue(eng.heap, t, origin, count, 0, seen.append, (t, origin, count))
    eng.run(until)
    assert seen == sorted(k for k in keys if k[0] < until)
    assert sorted(e[:3] for e in eng.heap) == sorted(k for k in keys if k[0] >= until)


def test_an_event_reads_as_its_tuple():
    heap = []
    queue(heap, 7, 2, 9, 1, print, "x")
    e = heap[0]
    assert isinstance(e, Event)
    assert (e[0], e[1], e[2], e[3], e[4], e[5]) == (7, 2, 9, 1, print, "x")
    assert e[:3] == (7, 2, 9) and (e.t, e.origin, e.count, e.die) == (7, 2, 9, 1)
