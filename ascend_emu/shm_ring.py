"""Single-producer single-consumer message rings in shared memory (the one-host transport of multi-process runs).

    seg = RingSegment.create(workers=3, capacity=1 << 20)        # parent: one ring per ordered pair of workers
    ring = seg.ring(src=0, dst=1)                                  # in worker 0: ring.put(kind, payload) -> bool
    seg.ring(0, 1).get()                                           # in worker 1: (kind, payload) or None

The layout and the protocol are ``shm_ring_build``'s: the compiled C side (``ascend_emu._shm_ring``, built by cffi at
install time) orders the head / tail indices with C11 release / acquire atomics. Without it (no compiler at install)
(or with ``ASCEND_EMU_PURE=1``) ``PyRing`` runs the same protocol in Python, each index access and frame copy under a lock shared by the two ends (a
``multiprocessing`` lock handed to the worker processes), which orders memory on any CPU.

The segment also holds one status record per worker (``WorkerStatus``: state, pid, a short error text) that
waiting workers read to tell a slow peer from a dead or failed one.
"""
from __future__ import annotations

import os
import struct
from multiprocessing import shared_memory

from .shm_ring_build import FRAME_HEADER, HEADER_BYTES

try:
    from ._shm_ring import ffi as _ffi
    from ._shm_ring import lib as _lib
except ImportError:          # not compiled: PyRing
    _ffi = _lib = None
if os.environ.get("ASCEND_EMU_PURE") == "1":     # the sources only, as for the engine's modules (_build.py)
    _ffi = _lib = None

COMPILED = _lib is not None
STATUS_BYTES = 512           # per worker: state, pid, error length, error text
ERROR_TEXT = STATUS_BYTES - 24
RUNNING, FINISHED, FAILED = 1, 2, 3
_STATUS = struct.Struct("<qqq")


class CRing:
    """One ring at ``offset`` of ``buf`` (a shared memoryview), through the compiled C11 side."""

    def __init__(self, buf, offset: int, capacity: int):
        self._keep = buf
        self._ptr = _ffi.from_buffer(buf) + offset
        self.capacity = capacity
        self._out = _ffi.new("char[]", 1 << 16)
        self._outcap = 1 << 16
        self._kind = _ffi.new("uint32_t *")

    def put(self, kind: int, payload: bytes) -> bool:
        """Append one frame; False when the ring lacks the space (nothing written)."""
        return bool(_lib.ring_put(self._ptr, self.capacity, kind, payload, len(payload)))

    def get(self):
        """The oldest frame as (kind, payload bytes), or None when the ring is empty."""
        n = _lib.ring_get(self._ptr, self.capacity, self._kind, self._out, self._outcap)
        if n == -1:
            return None
        if n < -1:                           # a payload larger than the buffer: grow it, read again
            self._outcap = -2 - n
            self._out = _ffi.new("char[]", self._outcap)
            return self.get()
        return self._kind[0], _ffi.buffer(self._out, n)[:]


class PyRing:
    """The same ring and frames in Python; ``lock`` (shared by producer and consumer) orders the accesses."""

    def __init__(self, buf, offset: int, capacity: int, lock):
        self.buf, self.base, self.capacity, self.lock = buf, offset, capacity, lock
        self.data = offset + HEADER_BYTES

    def _copy_in(self, at: int, src: bytes) -> None:
        off = at % self.capacity
        first = min(self.capacity - off, len(src))
        self.buf[self.data + off:self.data + off + first] = src[:first]
        if len(src) > first:
            self.buf[self.data:self.data + len(src) - first] = src[first:]

    def _copy_out(self, at: int, n: int) -> bytes:
        off = at % self.capacity
        first = min(self.capacity - off, n)
        out = bytes(self.buf[self.data + off:self.data + off + first])
        if n > first:
            out += bytes(self.buf[self.data:self.data + n - first])
        return out

    def put(self, kind: int, payload: bytes) -> bool:
        need = FRAME_HEADER + (len(payload) + 7) // 8 * 8
        with self.lock:
            head, = struct.unpack_from("<Q", self.buf, self.base)
            tail, = struct.unpack_from("<Q", self.buf, self.base + 64)
            if self.capacity - (head - tail) < need:
                return False
            self._copy_in(head, struct.pack("<II", len(payload), kind))
            self._copy_in(head + FRAME_HEADER, payload)
            struct.pack_into("<Q", self.buf, self.base, head + need)
        return True

    def get(self):
        with self.lock:
            head, = struct.unpack_from("<Q", self.buf, self.base)
            tail, = struct.unpack_from("<Q", self.buf, self.base + 64)
            if head == tail:
                return None
            n, kind = struct.unpack("<II", self._copy_out(tail, FRAME_HEADER))
            payload = self._copy_out(tail + FRAME_HEADER, n)
            struct.pack_into("<Q", self.buf, self.base + 64, tail + FRAME_HEADER + (n + 7) // 8 * 8)
        return kind, payload


class RingSegment:
    """A shared-memory segment with a status record per worker and a ring per ordered pair of workers.

    ``create`` in the parent, ``attach(name, ...)`` in each worker (pass ``name``, ``workers``, ``capacity`` and,
    for the Python rings, ``locks``: one ``multiprocessing.Lock`` per ring, from ``make_locks``)."""

    def __init__(self, shm, workers: int, capacity: int, locks=None, owner: bool = False):
        if capacity % 8 or capacity < 64:
            raise ValueError(f"capacity={capacity} must be a multiple of 8, at least 64")
        self.shm, self.workers, self.capacity, self.locks, self.owner = shm, workers, capacity, locks, owner
        self.buf = shm.buf
        self._rings: dict = {}

    @staticmethod
    def size(workers: int, capacity: int) -> int:
        return workers * STATUS_BYTES + workers * workers * (HEADER_BYTES + capacity)

    @classmethod
    def create(cls, workers: int, capacity: int, locks=None) -> "RingSegment":
        shm = shared_memory.SharedMemory(create=True, size=cls.size(workers, capacity))
        shm.buf[:cls.size(workers, capacity)] = bytes(cls.size(workers, capacity))
        return cls(shm, workers, capacity, locks, owner=True)

    @classmethod
    def attach(cls, name: str, workers: int, capacity: int, locks=None) -> "RingSegment":
        # spawned workers share the parent's resource tracker, which holds the name once: the parent unlinks it
        return cls(shm=shared_memory.SharedMemory(name=name), workers=workers, capacity=capacity, locks=locks)

    @staticmethod
    def make_locks(ctx, workers: int) -> list | None:
        """Locks for the Python rings (None when the compiled rings run)."""
        return None if COMPILED else [ctx.Lock() for _ in range(workers * workers)]

    @property
    def name(self) -> str:
        return self.shm.name

    def ring(self, src: int, dst: int):
        r = self._rings.get((src, dst))
        if r is None:
            i = src * self.workers + dst
            offset = self.workers * STATUS_BYTES + i * (HEADER_BYTES + self.capacity)
            r = (CRing(self.buf, offset, self.capacity) if COMPILED
                 else PyRing(self.buf, offset, self.capacity, self.locks[i]))
            self._rings[(src, dst)] = r
        return r

    # ------------------------------------------------------------------------------------------ worker status
    def set_status(self, worker: int, state: int, error: str = "") -> None:
        text = error.encode()[:ERROR_TEXT]
        at = worker * STATUS_BYTES
        self.buf[at + 24:at + 24 + len(text)] = text
        _STATUS.pack_into(self.buf, at, state, os.getpid(), len(text))

    def status(self, worker: int) -> tuple[int, int, str]:
        """(state, pid, error text) of ``worker``: 0 not started, RUNNING, FINISHED or FAILED."""
        at = worker * STATUS_BYTES
        state, pid, n = _STATUS.unpack_from(self.buf, at)
        return state, pid, bytes(self.buf[at + 24:at + 24 + n]).decode(errors="replace")

    def close(self) -> None:
        self._rings.clear()
        self.buf = None
        try:
            self.shm.close()
        except BufferError:          # a cffi buffer still alive: released with the process
            pass
        if self.owner:
            self.shm.unlink()
