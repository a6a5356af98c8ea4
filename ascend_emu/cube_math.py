"""The cube's integer arithmetic on the host: an exact int8 matmul, and int8 K steps run as one multiply.

int8 x int8 -> int32 is exact, so the sum over K steps does not depend on how K is split. The mmads that accumulate
into one L0C tile therefore stage their operands (copied at each mmad's start, when the die reads L0A / L0B) and one
full-K multiply runs when something reads the tile: a fixpipe (``settle``), an mmad into an overlapping but different
tile, or the end of the core (``settle_store``). The result is bitwise the stepwise one: the staged K is capped so
that no partial or total sum can leave the int32 range (``MAX_FUSED_K``), and adding onto an accumulator that was
there before wraps modulo 2^32 in both orders. Timing is untouched: every mmad is still an instruction with its own
cost; only the host's arithmetic is batched.

Float modes (fp16 / bf16 -> fp32) keep one multiply per K step (``mmad_step``): the die rounds each step's fp32
sum into the accumulator, which one full-K library call does not reproduce bit for bit.

Only mmad writes L0C and only mmad (accumulating) and the fixpipes read it, so those three are the points that settle.
"""
from __future__ import annotations

import numpy as np

from . import numerics
from .dtypes import bf16

INT8 = np.dtype(np.int8)
F32 = np.dtype(np.float32)
BF16 = np.dtype(bf16)
FUSE_INT8_K = True      # False: one multiply per mmad, as the die steps (the reference the tests compare against)
# the largest K whose int32 sum cannot overflow: |a * b| <= 128 * 128 = 2^14 per product
MAX_FUSED_K = (2 ** 31 - 1) // (128 * 128)


# fp32 holds every integer up to 2^24 exactly: K steps of at most 2^24 / 2^14 products of int8 values sum exactly
EXACT_F32_K = 2 ** 24 // (128 * 128)
_INT8_GEMM = []       # the exact method this host runs fastest, picked once per process (``_int8_gemm``)


def _int8_mm_f32(a, b):
    """Exact int8 [M, K] x int8 [K, N] -> int64 torch [M, N]: fp32 BLAS over K chunks of ``EXACT_F32_K`` (each
    chunk's sums are integers below 2^24, exact in any summation order), the chunks added as integers."""
    import torch
    fa = torch.from_numpy(a).float()
    fb = torch.from_numpy(b).float()
    k = a.shape[1]
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.int64) if k == 0 else None
    for k0 in range(0, k, EXACT_F32_K):
        part = (fa[:, k0:k0 + EXACT_F32_K] @ fb[k0:k0 + EXACT_F32_K]).to(torch.int64)
        out = part if out is None else out.add_(part)
    return out


def _int8_mm_int(a, b):
    """torch ``_int_mm`` (int32 accumulation; fast where the CPU has int8 dot-product instructions)."""
    import torch
    return torch._int_mm(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)))


def _int8_gemm():
    """The faster of ``_int8_mm_int`` and ``_int8_mm_f32`` on this CPU, timed once on a [128, 512] x [512, 128]
    product. Both are exact, so the choice changes the host's speed, never a value: without int8 dot-product
    instructions ``_int_mm`` runs 60x slower than fp32 BLAS, with them several times faster."""
    if not _INT8_GEMM:
        import time
        rng = np.random.default_rng(0)
        a = rng.integers(-128, 128, (128, 512), dtype=np.int8)
        b = rng.integers(-128, 128, (512, 128), dtype=np.int8)
        best = None
        for fn in (_int8_mm_f32, _int8_mm_int):
            try:
                fn(a, b)
                t = time.perf_counter()
                fn(a, b)
                t = time.perf_counter() - t
            except RuntimeError:            # _int_mm refused on this build
                continue
            if best is None or t < best[0]:
                best = (t, fn)
        _INT8_GEMM.append(best[1])
    return _INT8_GEMM[0]


def int8_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact int8 [M, K] x int8 [K, N] -> int32 [M, N] (wrapping modulo 2^32 like the cube's int32 accumulator):
    the fastest exact method of this host where torch ``_int_mm`` applies, fp32 BLAS by exact K chunks otherwise."""
    import torch
    m, k = a.shape
    n = b.shape[1]
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        r = _int8_gemm()(a, b)
    else:
        r = _int8_mm_f32(a, b)
    return r.numpy() if r.dtype == torch.int32 else r.to(torch.int32).numpy()


def _widen(a: np.ndarray) -> np.ndarray:
    """fp16 / bf16 -> fp32, exact, laid out as numpy's ``astype`` lays it out."""
    if a.dtype == F32:
        return a
    return numerics.widen_bf16(a) if a.dtype == BF16 else a.astype(np.float32)


_SCRATCH: dict = {}     # (shape, role) -> (fp32 array, the torch tensor sharing it): the float mmads' temporaries
_SCRATCH_MAX = 64       # shapes kept (a kernel's tiles repeat a few shapes); past that the cache starts again


def _scratch(shape: tuple, role: int):
    """A reusable C-contiguous fp32 [shape] array and its torch tensor (``role`` 0/1: widened operands, 2: the
    product). Each mmad consumes them before the next one runs (the host runs one instruction at a time)."""
    key = (shape, role)
    s = _SCRATCH.get(key)
    if s is None:
        if len(_SCRATCH) >= _SCRATCH_MAX:
            _SCRATCH.clear()
        arr = np.empty(shape, np.float32)
        import torch
        s = _SCRATCH[key] = (arr, torch.from_numpy(arr))
    return s


def _operand(a: np.ndarray, role: int):
    """The fp32 torch operand of a float mmad: a C-contiguous bf16 tile widens into a scratch array (no allocation),
    the same values and layout as ``_widen``; other tiles through ``_widen``."""
    if a.dtype == BF16 and a.flags.c_contiguous and a.size >= numerics.WIDEN_KERNEL_MIN:
        arr, t = _scratch(a.shape, role)
        numerics.widen_bf16_into(a, arr)
        return t
    import torch
    return torch.from_numpy(_widen(a))


def mmad_step(out: np.ndarray, a: np.ndarray, b: np.ndarray, accumulate: bool) -> None:
    """One mmad on the host, now: out (L0C fp32 / int32) (+)= a @ b, the product rounded to fp32 (float modes) or
    exact (int8), then added to the accumulator."""
    import torch
    if a.dtype == INT8:
        r = int8_matmul(a, b)
    else:
        ta, tb = _operand(a, 0), _operand(b, 1)
        if not accumulate and out.flags.c_contiguous:
            torch.matmul(ta, tb, out=torch.from_numpy(out))     # the product straight into L0C: no temporary
            return
        r, tr = _scratch((a.shape[0], b.shape[1]), 2)
        torch.matmul(ta, tb, out=tr)
    if accumulate:
        np.add(out, r, out=out)
    else:
        out[...] = r


class _Pending:
    """The staged K steps of one accumulator tile: ``a`` [M, cap] and ``b`` [cap, N] int8 with ``k`` columns / rows
    filled; ``onto``: add the product to what the tile held before the first step (that step accumulated)."""

    __slots__ = ("view", "key", "onto", "a", "b", "k")

    def __init__(self, view, key, onto: bool, a: np.ndarray, b: np.ndarray):
        self.view = view
        self.key = key
        self.onto = onto
        self.a = a
        self.b = b
        self.k = 0

    def append(self, a: np.ndarray, b: np.ndarray) -> None:
        k0, kw = self.k, a.shape[1]
        if k0 + kw > self.a.shape[1]:                   # grow by doubling: amortised copies of what is staged
            cap = max(2 * self.a.shape[1], k0 + kw)
            grown_a = np.empty((self.a.shape[0], cap), INT8)
            grown_b = np.empty((cap, self.b.shape[1]), INT8)
            grown_a[:, :k0] = self.a[:, :k0]
            grown_b[:k0] = self.b[:k0]
            self.a, self.b = grown_a, grown_b
        self.a[:, k0:k0 + kw] = a
        self.b[k0:k0 + kw] = b
        self.k = k0 + kw

    def land(self) -> None:
        """Write the full-K product into the tile (= or +=, as the steps would have)."""
        r = int8_matmul(self.a[:, :self.k], self.b[:self.k])
        c = self.view.arr
        if self.onto:
            c += r
        else:
            c[...] = r


class DeferredAccumulators:
    """The pending int8 accumulators of one L0C store (``Store.deferred``), by tile, plus the staging arrays of
    settled ones kept for the next tile of the same shape (a kernel's tiles repeat their shapes)."""

    __slots__ = ("pending", "spare")

    def __init__(self):
        self.pending: dict = {}     # (offset, shape, strides) -> _Pending
        self.spare: dict = {}       # (M, N) -> (a, b) staging arrays of the last settled tile of that shape

    def settle_overlapping(self, view, keep=None) -> None:
        """Land every pending tile whose bytes overlap ``view``'s, except the one keyed ``keep``."""
        lo, hi = view.lo, view.hi
        for key, p in list(self.pending.items()):
            if key != keep and p.view.lo < hi and lo < p.view.hi:
                self._land(key, p)

    def _land(self, key, p: _Pending) -> None:
        del self.pending[key]
        p.land()
        self._keep(p)

    def _keep(self, p: _Pending) -> None:
        m, n = p.a.shape[0], p.b.shape[1]
        if p.a.shape[1] != p.k:         # the next tile of this shape likely has this K: stage it contiguous
            self.spare[m, n] = (np.empty((m, p.k), INT8), np.empty((p.k, n), INT8))
        else:
            self.spare[m, n] = (p.a, p.b)

    def mmad(self, c, a: np.ndarray, b: np.ndarray, accumulate: bool) -> None:
        key = (c.offset, c.shape, c.strides)
        self.settle_overlapping(c, keep=key)
        p = self.pending.get(key)
        kw = a.shape[1]
        if p is not None and accumulate and p.k + kw > MAX_FUSED_K:
            self._land(key, p)                          # keep every partial sum inside int32
            p = None
        if p is None or not accumulate:
            if p is not None:                           # a non-accumulating step overwrites what was pending
                self._keep(p)
            m, n = c.shape
            staged = self.spare.pop((m, n), None)
            if staged is None or staged[0].shape[1] < kw:
                staged = (np.empty((m, 2 * kw), INT8), np.empty((2 * kw, n), INT8))
            p = self.pending[key] = _Pending(c, key, accumulate, *staged)
        p.append(a, b)


def defer_int8_mmad(c, a: np.ndarray, b: np.ndarray, accumulate: bool) -> None:
    """c (L0C int32 tile) (+)= a @ b, landing when the tile is next read (module docstring)."""
    store = c.store
    acc = store.deferred
    if acc is None:
        acc = store.deferred = DeferredAccumulators()
    acc.mmad(c, a, b, accumulate)


def settle(view) -> None:
    """Land the pending int8 steps of every tile overlapping ``view`` (an L0C tile about to be read or written)."""
    acc = view.store.deferred
    if acc is not None and acc.pending:
        acc.settle_overlapping(view)


def settle_store(store) -> None:
    """Land everything pending in ``store`` and drop its staging arrays (its core has finished)."""
    acc = store.deferred
    if acc is not None:
        for key, p in list(acc.pending.items()):
            acc._land(key, p)
        store.deferred = None
