"""The multi-process message exchange (ascend_emu.transport, shm_ring): rings keep frames in order across
wrap-around, both transports deliver every window's messages in sender order with the global next-event time, a
ring smaller than a window's traffic does not deadlock, and a failed or killed worker is named on every other."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from multiprocessing import shared_memory

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu import shm_ring
from ascend_emu.errors import ArgumentError, WorkerError
from ascend_emu.shm_ring_build import HEADER_BYTES
from ascend_emu.transport import NEVER, run_workers

CAP = 256


def _rings():
    """A fresh compiled ring (when built) and a Python ring over zeroed shared memory."""
    shm = shared_memory.SharedMemory(create=True, size=2 * (HEADER_BYTES + CAP))
    shm.buf[:] = bytes(len(shm.buf))
    rings = [shm_ring.PyRing(shm.buf, HEADER_BYTES + CAP, CAP, threading.Lock())]
    if shm_ring.COMPILED:
        rings.append(shm_ring.CRing(shm.buf, 0, CAP))
    return shm, rings


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.integers(0, 120), st.none()), min_size=1, max_size=60))
def test_ring_is_a_fifo_of_frames_across_wrap_around(ops):
    """A list of puts (payload sizes) and gets (None) against a deque: same frames, same order, same refusals."""
    shm, rings = _rings()
    try:
        for ring in rings:
            model, used, seq = deque(), 0, 0
            for op in ops:
                if op is None:
                    got = ring.get()
                    if model:
                        kind, payload = model.popleft()
                        used -= 8 + (len(payload) + 7) // 8 * 8
                        assert got == (kind, payload)
                    else:
                        assert got is None
                else:
                    payload = bytes((seq + i) % 251 for i in range(op))
                    need = 8 + (op + 7) // 8 * 8
                    ok = ring.put(seq % 3, payload)
                    assert ok == (CAP - used >= need)
                    if ok:
                        model.append((seq % 3, payload))
                        used += need
                    seq += 1
            while model:
                assert ring.get() == model.popleft()
            assert ring.get() is None
    finally:
        del rings
        shm.close()
        shm.unlink()


# ------------------------------------------------------------------------------------------------ workers
def _expected(window: int, src: int, dst: int, size: int) -> list:
    count = (window * 3 + src * 5 + dst) % 4
    return [f"{window}:{src}->{dst}:{i}".encode() * (1 + size * i) for i in range(count)]


def _next_ps(window: int, rank: int) -> int:
    return NEVER if (window + rank) % 5 == 0 else 1000 * window + (rank * 37 + window * 11) % 100


def _windows(transport, windows: int, size: int) -> list:
    """Every window: send the planned messages, check what arrives and the next time; returns the next times."""
    n, me = transport.size, transport.rank
    seen = []
    for w in range(windows):
        out = {j: _expected(w, me, j, size) for j in range(n) if j != me}
        ex = transport.exchange(out, _next_ps(w, me))
        want = [(j, p) for j in range(n) if j != me for p in _expected(w, j, me, size)]
        assert ex.inbox == want, (w, me)
        assert ex.next_ps == min(_next_ps(w, r) for r in range(n))
        seen.append(ex.next_ps)
    return seen


@pytest.mark.parametrize("transport", ["shm", "shm-python", "gloo"])
def test_three_workers_exchange_every_window_in_sender_order(transport, monkeypatch):
    if transport == "shm-python":           # the rings without their compiled C side, in parent and workers
        monkeypatch.setattr(shm_ring, "COMPILED", False)
        monkeypatch.setenv("ASCEND_EMU_PURE", "1")
        transport = "shm"
    got = run_workers(3, _windows, args=(12, 0), transport=transport, timeout_s=30)
    assert got[0] == got[1] == got[2] == [min(_next_ps(w, r) for r in range(3)) for w in range(12)]


def test_a_window_larger_than_the_ring_completes():
    """Each worker sends ~40 KB per peer per window through 4 KiB rings: senders drain while they wait."""
    got = run_workers(2, _windows, args=(4, 400), transport="shm", timeout_s=30, capacity=4096)
    assert got[0] == got[1]


def _fail_at(transport, window: int, how: str):
    for w in range(20):
        if transport.rank == 1 and w == window:
            if how == "raise":
                raise RuntimeError("boom in window 3")
            os.kill(os.getpid(), signal.SIGKILL)
        transport.exchange({}, w)
    return "done"


@pytest.mark.parametrize("transport,how", [("shm", "raise"), ("shm", "kill"), ("gloo", "raise")])
def test_a_failed_worker_is_named_and_nobody_hangs(transport, how):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(3, _fail_at, args=(3, how), transport=transport, timeout_s=20)
    assert info.value.worker == 1
    assert ("boom in window 3" if how == "raise" else "died") in str(info.value)
    assert time.monotonic() - t0 < 60          # the peers did not wait out their bound


def _peer_report(transport):
    """Worker 0 waits for worker 1, which raises at once: worker 0's own error names worker 1."""
    if transport.rank == 1:
        raise ValueError("bad input on worker 1")
    try:
        transport.exchange({}, 0)
    except WorkerError as e:
        return (e.worker, str(e))
    return None


def test_the_peers_error_names_the_failed_worker():
    with pytest.raises(WorkerError) as info:
        run_workers(2, _peer_report, transport="shm", timeout_s=20)
    assert info.value.worker == 1 and "bad input on worker 1" in str(info.value)


def test_bad_arguments():
    with pytest.raises(ArgumentError, match="transport"):
        run_workers(2, _windows, transport="mpi")
    with pytest.raises(ArgumentError, match="n="):
        run_workers(0, _windows)


def test_a_peer_that_finishes_right_after_sending_its_last_frame_is_not_taken_for_gone():
    """The peer's END lands between a pass's reads and the status check, and the peer finishes: the exchange
    reads the END (before: 'left the run before this exchange', a race partitioned runs met)."""
    import struct

    from ascend_emu.shm_ring import FINISHED, RUNNING, RingSegment
    from ascend_emu.transport import END, ShmTransport
    seg = RingSegment.create(2, 4096, RingSegment.make_locks(__import__("multiprocessing").get_context("fork"), 2))
    try:
        seg.set_status(1, RUNNING)
        me = ShmTransport(seg, 0, timeout_s=5.0)
        ring = seg.ring(1, 0)
        real_get, calls = ring.get, []

        def get():
            calls.append(1)
            if len(calls) == 2:                 # the peer writes its END and finishes just after this read
                ring.put(END, struct.pack("<qq", 123, 0))
                seg.set_status(1, FINISHED)
                return None
            return real_get()
        ring.get = get
        ex = me.exchange({}, 456)
        assert ex.inbox == [] and ex.next_ps == 123
    finally:
        seg.close()


_LEAVE_OPEN = """
import atexit, os, sys, tempfile
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))   # runs last (LIFO)
from ascend_emu.transport import GlooTransport
path = os.path.join(tempfile.mkdtemp(), "store")
GlooTransport(0, 1, init_method="file://" + path, timeout_s=10)     # never closed, as a pod's torchrun transport
"""


def test_a_gloo_group_left_open_is_destroyed_when_the_process_exits():
    """A group still up at interpreter exit can abort the process (gloo's threads torn down under them); the
    transport that created it destroys it at exit (before: still initialised)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _LEAVE_OPEN], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["initialized", "at", "exit:", "False"]
