"""The C half of the shared-memory message rings (``ascend_emu.shm_ring``), compiled by cffi at install time.

One ring carries frames from one producer process to one consumer process. Layout in the shared segment (byte
offsets from the ring's start): the producer's ``head`` (bytes written, ever) at 0, the consumer's ``tail`` (bytes
consumed, ever) at 64 (its own cache line), the data at 128, ``cap`` bytes (a multiple of 8). A frame is an 8-byte
header (payload length: uint32, kind: uint32) and the payload padded to 8 bytes; a payload may wrap around the end.
The producer publishes a frame by a release store of ``head`` after writing it; the consumer frees it by a release
store of ``tail`` after reading it; each loads the other's index with acquire: C11 atomics, so the protocol holds
on weakly ordered CPUs too.

Stdlib and cffi only: setup.py loads this file on its own to build ``ascend_emu._shm_ring``.
"""
from __future__ import annotations

HEADER_BYTES = 128          # head, tail, each on its own 64-byte line
FRAME_HEADER = 8

CDEF = """
int ring_put(char *ring, uint64_t cap, uint32_t kind, const char *data, uint32_t n);
int64_t ring_get(char *ring, uint64_t cap, uint32_t *kind, char *out, uint64_t outcap);
"""

SOURCE = r"""
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define HEAD(r) ((_Atomic uint64_t *)(r))
#define TAIL(r) ((_Atomic uint64_t *)((r) + 64))
#define DATA(r) ((r) + 128)

static void copy_in(char *data, uint64_t cap, uint64_t at, const char *src, uint64_t n) {
    uint64_t off = at % cap, first = cap - off < n ? cap - off : n;
    memcpy(data + off, src, first);
    if (n > first) memcpy(data, src + first, n - first);
}

static void copy_out(const char *data, uint64_t cap, uint64_t at, char *dst, uint64_t n) {
    uint64_t off = at % cap, first = cap - off < n ? cap - off : n;
    memcpy(dst, data + off, first);
    if (n > first) memcpy(dst + first, data, n - first);
}

/* 1: the frame is in the ring; 0: not enough free space (nothing written). */
int ring_put(char *ring, uint64_t cap, uint32_t kind, const char *data, uint32_t n) {
    uint64_t head = atomic_load_explicit(HEAD(ring), memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(TAIL(ring), memory_order_acquire);
    uint64_t need = 8 + (((uint64_t)n + 7) & ~(uint64_t)7);
    if (cap - (head - tail) < need) return 0;
    uint32_t hdr[2] = {n, kind};
    copy_in(DATA(ring), cap, head, (const char *)hdr, 8);
    copy_in(DATA(ring), cap, head + 8, data, n);
    atomic_store_explicit(HEAD(ring), head + need, memory_order_release);
    return 1;
}

/* The next frame's payload length (its kind in *kind, payload in out); -1: empty; -2 - n: out holds fewer than
   the payload's n bytes (the frame stays). */
int64_t ring_get(char *ring, uint64_t cap, uint32_t *kind, char *out, uint64_t outcap) {
    uint64_t tail = atomic_load_explicit(TAIL(ring), memory_order_relaxed);
    uint64_t head = atomic_load_explicit(HEAD(ring), memory_order_acquire);
    if (head == tail) return -1;
    uint32_t hdr[2];
    copy_out(DATA(ring), cap, tail, (char *)hdr, 8);
    if (hdr[0] > outcap) return -2 - (int64_t)hdr[0];
    copy_out(DATA(ring), cap, tail + 8, out, hdr[0]);
    *kind = hdr[1];
    atomic_store_explicit(TAIL(ring), tail + 8 + (((uint64_t)hdr[0] + 7) & ~(uint64_t)7), memory_order_release);
    return hdr[0];
}
"""


def ffibuilder():
    """The cffi builder of ``ascend_emu._shm_ring`` (API mode: compiled, no run-time compiler needed)."""
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("ascend_emu._shm_ring", SOURCE, extra_compile_args=["-std=c11", "-O2"])
    return ffi


if __name__ == "__main__":      # build in place: python ascend_emu/shm_ring_build.py
    import os
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ffibuilder().compile(tmpdir="build/cffi", verbose=False)
