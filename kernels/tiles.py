"""The cube tile layer shared by every cube kernel (CATLASS's ``tile/copy_gm_to_l1``, ``tile/tile_mmad``): typed
views of byte regions (``typed``, ``Carve``), even splits (``split``, ``step_of``), the right-operand loaders for ND
and NZ layouts (``gm_b_tile``: GM -> L1 of one B tile; ``to_l0``: L1 -> L0A/L0B of a tile's columns, ND or NZ) and a
small-M matmul engine (``Weight``, ``CubeTiles``). Only this layer and the kernels' plans know tile sizes.

NZ (``npu_format_cast(w, 29)``): a [K, N] matrix stored as [N/N0, K/16, 16, N0] fractals (N0 = 32 bytes of
elements): each 32-byte-wide column block is K rows, contiguous. In L1 such a tile is kept as it lands
([N/N0, K, N0]) and reaches L0 through a strided view of the same logical [K, N] matrix (``to_l0``), so ND and NZ
give the same L0 tile, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ascend_emu.buffers import LocalTensor
from ascend_emu.dtypes import as_dtype
from ascend_emu.errors import CapacityError, ShapeError

KiB = 1024
BASE_K = 128          # K step of one mmad
BASE_N = 128          # N width of one L0B / L0C tile
BASE_M = 128          # rows of one L0A tile (tokens)
A_RESIDENT_BYTES = 320 * KiB   # L1 kept for a whole A operand when it fits (streamed otherwise)
SLOT_BYTES = 32 * KiB          # one L1 / L0A / L0B staging slot (128 x 128 bf16)
ACC_HALF_BYTES = 64 * KiB      # L0C split in two halves: fixpipe of one group overlaps mmads of the next


def typed(flat, shape, dtype) -> LocalTensor:
    """A contiguous tile of ``shape`` x ``dtype`` at the start of a byte region ``flat`` (uint8)."""
    return flat.typed(shape, dtype)


class Carve:
    """Phases of one kernel reuse a core-local region: ``take`` hands out 32-byte-aligned typed tiles from it,
    ``reset`` starts the next phase (the per-tile dependencies keep the reuse safe, as a TBuf reused by
    several stages in Ascend C). Capacity is checked here, when a phase builds its tiles."""

    def __init__(self, buf, nbytes: int, name: str):
        self.flat = buf.alloc((nbytes,), "uint8", name=name)
        self.nbytes = nbytes
        self.top = 0

    def reset(self) -> "Carve":
        self.top = 0
        return self

    def take(self, shape, dtype, name: str = "tile") -> LocalTensor:
        dt = as_dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape) * dt.itemsize
        if self.top + n > self.nbytes:
            raise CapacityError(f"{name} {shape} {dt}: {n} bytes do not fit the {self.nbytes}-byte phase region "
                                f"({self.top} used)")
        t = self.flat[self.top:self.top + n].view_as(dt).reshape(*shape)
        self.top += -(-n // 32) * 32
        return t


def step_of(n: int, limit: int) -> int:
    """The largest of limit, limit/2, ..., 16 dividing n."""
    s = limit
    while s > 16 and n % s:
        s //= 2
    if n % s:
        raise ShapeError(f"dimension {n} is not a multiple of 16 (cube fractal size)")
    return s


def split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) ranges splitting n (in units of ``align``) as evenly as possible over ``parts``."""
    units = -(-n // align)
    out = []
    for i in range(parts):
        lo = min(n, (units * i // parts) * align)
        hi = min(n, (units * (i + 1) // parts) * align)
        out.append((lo, hi))
    return out


@dataclass
class Weight:
    """A [K, N] right operand in GM, ND or NZ."""
    gm: object
    k: int
    n: int

    @property
    def nz(self) -> bool:
        return self.gm.ndim == 4

    @property
    def dtype(self):
        return self.gm.dtype

    @property
    def n0(self) -> int:
        return 32 // self.gm.dtype.itemsize


class CubeTiles:
    """An AIC's staging tiles, allocated once per kernel: resident A, A/B staging slots in L1, two L0A and L0B
    slots, two L0C halves. Slots rotate; the per-tile dependencies make the rotation safe (double buffering)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.a_res = ctx.l1.alloc((A_RESIDENT_BYTES,), "uint8", name="a_resident")
        self.a_l1 = [ctx.l1.alloc((SLOT_BYTES,), "uint8", name=f"a_l1_{i}") for i in range(2)]
        self.b_l1 = [ctx.l1.alloc((SLOT_BYTES,), "uint8", name=f"b_l1_{i}") for i in range(2)]
        self.a_l0 = [ctx.l0a.alloc((SLOT_BYTES,), "uint8", name=f"a_l0_{i}") for i in range(2)]
        self.b_l0 = [ctx.l0b.alloc((SLOT_BYTES,), "uint8", name=f"b_l0_{i}") for i in range(2)]
        self.acc = [ctx.l0c.alloc((ACC_HALF_BYTES,), "uint8", name=f"acc_{i}") for i in range(2)]
        self.n_a = self.n_b = self.n_acc = 0

    def load_b(self, w: Weight, k0: int, bk: int, c0: int, c1: int):
        """GM -> L1 -> L0B of W[k0:k0+bk, c0:c1]; returns the L0B tile [bk, c1-c0]."""
        ctx = self.ctx
        s = self.n_b % 2
        self.n_b += 1
        width = c1 - c0
        dt = w.dtype
        if not w.nz:
            l1 = typed(self.b_l1[s], (bk, width), dt)
            # rows, then columns: each slice stays in its parent's memo (one [k0:k0+bk, c0:c1] key per tile of
            # every core would overflow the weight's, and a GM slice built afresh costs more than two lookups)
            yield ctx.copy_gm_to_l1(l1, w.gm[k0:k0 + bk][:, c0:c1])
            l0 = typed(self.b_l0[s], (bk, width), dt)
            yield ctx.copy_l1_to_l0b(l0, l1)
            return l0
        n0 = w.n0
        if c0 % n0 or width % n0 or k0 % 16 or bk % 16:
            raise ShapeError(f"NZ weight tile rows {k0}:{k0 + bk}, columns {c0}:{c1} must align to 16 rows and "
                             f"{n0} columns (fractal {16}x{n0})")
        l1 = typed(self.b_l1[s], (width // n0, bk, n0), dt)       # NZ: fractal columns of the tile, K rows each
        src = w.gm[c0 // n0:c1 // n0][:, k0 // 16:(k0 + bk) // 16]
        yield ctx.copy_gm_to_l1(l1.reshape(*src.shape), src)
        l0 = yield from to_l0(ctx, self.b_l0[s], (l1, True), 0, width, False)
        return l0

    def matmul(self, a_gm, w: Weight, col_ranges, out_view):
        """out_view(m0, m1, c0, c1)[...] = a_gm[m0:m1] @ W[:, c0:c1] for every column range, tile by tile."""
        yield from self.matmul_multi(a_gm, [(w, c0, c1, out_view) for c0, c1 in col_ranges])

    def matmul_multi(self, a_gm, jobs):
        """Like ``matmul`` for several (weight, c0, c1, out_view) jobs sharing the left operand: one pass over A.

        A (tokens x K) stays resident in L1 when it fits, else streams per K step (once per group of N tiles);
        accumulators of a group of N tiles fill half of L0C, and the fixpipe of a group overlaps the mmads of the
        next."""
        ctx = self.ctx
        m_all, k = a_gm.shape
        for w, *_ in jobs:
            if k != w.k:
                raise ShapeError(f"matmul: A has K={k}, weight has K={w.k}")
        dt = a_gm.dtype
        es = dt.itemsize
        acc_dt = "int32" if dt == np.int8 else "fp32"
        bk = step_of(k, BASE_K)
        tiles = [(w, c, min(c + BASE_N, c1), ov) for (w, c0, c1, ov) in jobs for c in range(c0, c1, BASE_N)]
        if not tiles:
            return
        for m0 in range(0, m_all, BASE_M):
            m1 = min(m_all, m0 + BASE_M)
            mt = m1 - m0
            resident = mt * k * es <= A_RESIDENT_BYTES
            if resident:
                a_l1 = typed(self.a_res, (mt, k), dt)
                yield ctx.copy_gm_to_l1(a_l1, a_gm[m0:m1])
            groups, cur, used = [], [], 0
            for tile in tiles:                      # fill half of L0C with accumulators, by bytes
                nbytes = mt * (tile[2] - tile[1]) * 4
                if cur and used + nbytes > ACC_HALF_BYTES:
                    groups.append(cur)
                    cur, used = [], 0
                cur.append(tile)
                used += nbytes
            groups.append(cur)
            for group in groups:
                half = self.acc[self.n_acc % 2]
                self.n_acc += 1
                accs, off = [], 0
                for _, c0, c1, _ in group:
                    n = mt * (c1 - c0)
                    accs.append(half.view_as(acc_dt)[off:off + n].reshape(mt, c1 - c0))
                    off += n
                for ks, k0 in enumerate(range(0, k, bk)):
                    s = self.n_a % 2
                    self.n_a += 1
                    if resident:
                        a_src = a_l1[:, k0:k0 + bk]
                    else:
                        a_src = typed(self.a_l1[s], (mt, bk), dt)
                        yield ctx.copy_gm_to_l1(a_src, a_gm[m0:m1, k0:k0 + bk])
                    a0 = typed(self.a_l0[s], (mt, bk), dt)
                    yield ctx.copy_l1_to_l0a(a0, a_src)
                    for j, (w, c0, c1, _) in enumerate(group):
                        b0 = yield from self.load_b(w, k0, bk, c0, c1)
                        yield ctx.mmad(accs[j], a0, b0, accumulate=ks > 0)
                for j, (_, c0, c1, out_view) in enumerate(group):
                    yield ctx.copy_l0c_to_gm(out_view(m0, m1, c0, c1), accs[j])


def to_l0(ctx, flat, tile, c0, c1, transpose, which="b"):
    """MTE1: columns [c0, c1) of a [w, C] L1 tile -> an L0A/L0B tile [w, c1-c0] (``transpose``: [c1-c0, w]).

    ``tile`` = (LocalTensor, nz). An NZ tile [C/N0, w, N0] is read through a strided view of the same logical
    matrix (row stride N0, column-block stride w*N0, as ``CubeTiles.load_b``): modeled as Load2D of fractal columns
    (transposing on the way when asked), so both layouts give the same L0 tile, bit for bit."""
    t, nz = tile
    cw = c1 - c0
    load = ctx.copy_l1_to_l0a if which == "a" else ctx.copy_l1_to_l0b
    if not nz:
        w = t.shape[0]
        dst = typed(flat, (cw, w) if transpose else (w, cw), t.dtype)
        yield load(dst, t[:, c0:c1], transpose=transpose)
        return dst
    n1, w, n0 = t.shape
    es = t.dtype.itemsize
    if c0 % n0 or cw % n0:
        raise ShapeError(f"NZ tile columns {c0}:{c1} must align to its {n0}-element fractal columns")
    off = t.offset + (c0 // n0) * w * n0 * es
    if transpose:       # [cw/N0, N0, w]: element (c, t) at block c//N0, row t, lane c%N0
        src = LocalTensor(t.store, off, (cw // n0, n0, w), (w * n0 * es, es, n0 * es), t.dtype)
    else:               # [w, cw/N0, N0]
        src = LocalTensor(t.store, off, (w, cw // n0, n0), (n0 * es, w * n0 * es, es), t.dtype)
    dst = typed(flat, src.shape, t.dtype)
    yield load(dst, src)
    return typed(flat, (cw, w) if transpose else (w, cw), t.dtype)


def gm_b_tile(w_gm, g, k0: int, kt: int, col_starts: list, nw: int, nz: bool):
    """The GM view of one B tile: rows k0:k0+kt of expert g, ``nw`` columns from each start in ``col_starts`` (one
    start, or the gate and up starts with SwiGLU), as [kt, parts, nw] (ND) or [kt, parts, nw / N0, N0] (NZ), in the
    order the compact [kt, parts * nw] L1 tile holds them. One DataCopy moves it: bursts of a row's ``nw`` elements
    (ND) or of one 32-byte fractal row (NZ: each column block's K rows are contiguous in GM).

    Built with a raw strided view (a DataCopy's block count / length / source stride): the views API has no
    permute, and column slices written by separate copies would be ordered by their overlapping byte extents."""
    isz = w_gm.dtype.itemsize
    parts = len(col_starts)
    gap = (col_starts[1] - col_starts[0]) if parts > 1 else 0
    if not nz:
        s_e, s_k, _ = w_gm.strides
        off = w_gm.offset + g * s_e + k0 * s_k + col_starts[0] * isz
        return w_gm._new(off, (kt, parts, nw), (s_k, gap * isz, isz))
    s_e, s_n1, _, _, _ = w_gm.strides
    n0 = w_gm.shape[-1]
    off = w_gm.offset + g * s_e + (col_starts[0] // n0) * s_n1 + k0 * n0 * isz
    return w_gm._new(off, (kt, parts, nw // n0, n0), (n0 * isz, (gap // n0) * s_n1, s_n1, isz))
