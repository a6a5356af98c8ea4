"""Decode attention over the MLA latent cache (absorb mode), flash tiling, paged, split over batch and sequence.

Math (DeepSeek-V3 absorb mode): for query row (token t, head h) of sequence b with kv length L_b,
    scores_j = (q_nope[t, h] . kv_c[j] + q_rope[t, h] . k_rope[j]) * softmax_scale,   j <= L_b - S + s(t)
    o[t, h]  = softmax(scores) . kv_c                          [T, N, Hckv] (W_uv is applied by the caller)
where S is the number of query tokens per sequence (1 + MTP depth) and s(t) in 0..S-1 the token's place among
them (causal with offsets). The rope parts are in the library's even/odd order (``kernels.rope``); the dot product
does not care as long as q and k share it.

Execution (one MIX kernel): all N*S query rows of a sequence share its latent KV (MQA in absorb mode), so a work
unit is (sequence, up to 128 query rows, a range of kv tokens). AIC: Q stays in L1, each 128-token kv tile is
paged into L1 once and used twice: S = Qn Kc^T + Qr Kr^T (fixpipe -> GM -> AIV softmax) and O_j = P V (V = Kc).
AIV: online softmax (running max m, sum l, rescale alpha) and the O accumulator, half of the rows each. The AIC
computes S(j+1) while the AIVs run softmax(j) (two workspace slots, cross-core flags). Units of one sequence that
were split (``tiling="balanced"``) write partial O and log-sum-exp; the AIV that finishes last (GM atomic counter)
combines them. All S x N rows of a sequence share one unit when they fit its 128 rows; with more (MTP at 128
heads: 256 rows, whose O accumulators would not fit the two AIVs' UBs) the row tiles of a sequence run on adjacent
AICs side by side over the same kv pieces (``plan_units``), so its cache comes from HBM once and from the L2 for the
other row tile. ``tiling="batch"`` gives each (sequence, row tile) to one core whole: the naive split.
Masked scores are set to -1e30, not -inf, so a tile whose columns are all masked for some row stays finite; its
weight vanishes in the combine. Cache slots past a sequence's length (the unused slots of its last page, read as the
cube's 16-row padding) are never read: those tile rows are zero-filled, so a stale NaN or inf there cannot reach the
output through 0 * NaN (the reference slices them away).

Caches (``KvTiles``): PA_BSND rows land in L1 as ND tiles; PA_NZ pages land as NZ tiles and reach L0B through
strided fractal-column views (``to_l0``), giving the same L0 tiles, so both layouts give bitwise the same output.
INT8 latent cache (per-channel ``key_antiquant_scale``): each 128-token tile is dequantised *on the cube*, 64
channels at a time: int8 chunk @ int8 identity -> int32 (exact) -> fixpipe * scale -> bf16 into L1, then the bf16
path runs unchanged. Why this and not the alternatives:
- AIV dequant: on this chip the AIV reaches the cube only through GM, so the tile would be read as int8, written and
  re-read as bf16: +3 bytes per element of HBM traffic instead of -1.
- int8 cube for Q.K^T and P.V (kv scale folded into q, q quantised per row, P with a fixed 1/127 step): P's absolute
  step of 1/254 per weight is large against the small weights of a long context (worst case L/254 of l), the rope
  part stays bf16 so the scores need a second (int32) workspace round trip, and the output is no longer the bf16
  path's. The cube dequant costs 1/8 of a Q.K^T step of cube time per chunk and keeps the error at exactly that of
  a bf16 cache holding bf16(k8 * scale) (tests: bitwise).
Fidelity note: the emulator tracks local dependencies by byte extent, so with block_size < 128 the several page
copies of one NZ tile (interleaved strided regions) look overlapping and wait for each other to land; real MTE2
queues them back to back. At block_size 128 (one page per tile) PA_NZ and PA_BSND time the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_emu import Pod, RunResult, cloudmatrix384, kernel
from ascend_emu.errors import ArgumentError, ShapeError

from .tiles import KiB, Carve, split, to_l0, typed
from .paged_cache import cache_shapes, check_cache_mode, check_caches
from .ranks import Pending, caller_streams, integer_array, to_gm

KV_TILE = 128          # kv tokens per flash step
ROW_TILE = 128         # query rows (tokens x heads) per work unit
NEG = -1e30
DEQ_CHUNK = 64         # int8 cache channels dequantised per cube step (L1 staging 2 x 8 KiB, identity 4 KiB)
F_S, F_P, F_O = 3, 4, 5     # cross-core flags: scores ready (AIC->AIV), probs ready (AIV->AIC), O_j ready
TILINGS = ("balanced", "batch")


@dataclass(frozen=True)
class Unit:
    """One work unit: sequence b, query rows [r0, r1) of its S*N rows, kv tokens [k0, k1); ``item`` indexes
    (b, row tile), ``part``/``parts`` its kv split (parts == 1: not split), ``slot`` its partial-result slot."""
    b: int
    r0: int
    r1: int
    k0: int
    k1: int
    item: int
    part: int
    parts: int
    slot: int


@dataclass(frozen=True)
class AttnPlan:
    batch: int
    s: int
    n: int
    hckv: int
    dr: int
    block_size: int
    scale: float
    seq_lens: tuple
    units: tuple          # per AIC: tuple of Unit
    n_items: int
    n_slots: int
    aic: int
    cache_mode: str = "PA_BSND"
    kv_int8: bool = False


def plan_units(seq_lens, s: int, n: int, aic: int, tiling: str = "balanced") -> tuple[tuple, int, int]:
    """Host tiling (like Ascend tiling data): per-AIC lists of ``Unit``.

    A sequence's S x N query rows form ``R = ceil(S N / ROW_TILE)`` row tiles (one when they fit a unit's 128 rows:
    its KV is then read once). balanced: cost = kv tiles x row tiles, each AIC gets an equal share, cutting
    sequences at KV_TILE boundaries (flash-decoding split). With R > 1 row tiles (MTP at 128 heads: the state of
    256 rows does not fit an AIC's two UBs) and R dividing the AIC count, the AICs form R-wide lanes: the kv tiles
    of all sequences are shared over ``aic / R`` lanes, and the R AICs of a lane take the same (sequence, kv range)
    pieces in the same order, one row tile each, side by side, so each kv tile comes from HBM once and from the L2
    for the other row tiles. Otherwise the (row tile, kv tile) pairs are shared out directly. batch: (sequence, row
    tile) pairs dealt round-robin, never split."""
    if tiling not in TILINGS:
        raise ArgumentError(f"tiling={tiling!r}: use one of {TILINGS}")
    rows = s * n
    row_tiles = [(r0, min(rows, r0 + ROW_TILE)) for r0 in range(0, rows, ROW_TILE)]
    items = [(b, r0, r1) for b in range(len(seq_lens)) for r0, r1 in row_tiles]
    per_core: list[list] = [[] for _ in range(aic)]
    if tiling == "batch":
        for i, (b, r0, r1) in enumerate(items):
            per_core[i % aic].append(Unit(b, r0, r1, 0, seq_lens[b], i, 0, 1, -1))
        return tuple(tuple(u) for u in per_core), len(items), 0
    lanes = len(row_tiles) if len(row_tiles) > 1 and aic % len(row_tiles) == 0 else 1
    groups = [[i * lanes + r for r in range(lanes)] for i in range(len(items) // lanes)]   # items a lane shares
    pieces = _balanced_pieces([seq_lens[items[grp[0]][0]] for grp in groups], aic // lanes)
    slot = 0
    for grp, grp_pieces in zip(groups, pieces):
        parts = len(grp_pieces)
        for r, i in enumerate(grp):
            b, r0, r1 = items[i]
            for pi, (lane, k0, k1) in enumerate(grp_pieces):
                per_core[lane * lanes + r].append(Unit(b, r0, r1, k0, k1, i, pi, parts, slot if parts > 1 else -1))
                slot += parts > 1
    return tuple(tuple(u) for u in per_core), len(items), slot


def _balanced_pieces(kv_lens: list, cores: int) -> list:
    """Per work item of ``kv_lens[i]`` kv tokens, its pieces (core, k0, k1) in kv order: the KV_TILE tiles of all
    items, in item order, cut into ``cores`` equal contiguous shares."""
    tiles = [(i, k) for i, length in enumerate(kv_lens) for k in range(0, length, KV_TILE)]
    share = -(-len(tiles) // cores)
    pieces: list[list] = [[] for _ in kv_lens]
    for c in range(cores):
        for i, k in tiles[c * share:(c + 1) * share]:
            k1 = min(kv_lens[i], k + KV_TILE)
            if pieces[i] and pieces[i][-1][0] == c:
                pieces[i][-1] = (c, pieces[i][-1][1], k1)
            else:
                pieces[i].append((c, k, k1))
    return pieces


@dataclass(frozen=True)
class AttnTensors:
    """The GM tensors of one attention launch, built in ``_prepare``: query [B, S*N, Hckv] / query_rope
    [B, S*N, Dr] bf16, the paged caches, block_table [B, max_blocks] int32 (control data), key_antiquant_scale
    [Hckv] fp32 and identity [64, 64] int8 (int8 cache), iota [KV_TILE] fp32 and zeros (padding rows), the
    workspaces ws_s / ws_p / ws_o [aic, 2, 128, *] and ws_part / ws_lse (split parts), counters (int32) and out."""
    query: object = None
    query_rope: object = None
    kv_cache: object = None
    kr_cache: object = None
    block_table: object = None
    key_antiquant_scale: object = None
    identity: object = None
    iota: object = None
    zeros: object = None
    ws_s: object = None
    ws_p: object = None
    ws_o: object = None
    ws_part: object = None
    ws_lse: object = None
    counters: object = None
    out: object = None


@kernel(cores="mix")
def mla_attention_kernel(ctx, p: AttnPlan, g: AttnTensors):
    if ctx.is_aic:
        yield from _attn_aic(ctx, p, g)
    else:
        yield from _attn_aiv(ctx, p, g)


def _kv_tiles(k0, k1):
    """(k, w_valid, w) per flash step: w rounded up to 16 (rows past w_valid are masked)."""
    for k in range(k0, k1, KV_TILE):
        wv = min(KV_TILE, k1 - k)
        yield k, wv, -(-wv // 16) * 16


class KvTiles:
    """The AIC's view of one flash step's latent cache tile in L1: where it lands, and how its columns reach L0B.

    Layouts in L1: PA_BSND bf16 rows land as an ND [w, C] tile; PA_NZ pages land as an NZ [C/16, w, 16] tile
    (fractal columns of the page, copied as they are stored). An int8 cache (either layout) is dequantised on the
    cube into an ND bf16 tile: 64-channel chunks are staged in L1, multiplied by a 64x64 int8 identity (exact, int32
    in L0C) and sent back to L1 by the fixpipe with the per-channel ``key_antiquant_scale`` (int32 * scale, rounded
    to bf16 RNE): no AIV work and no GM round trip, at 1/8 of a QK^T step's cube time per channel chunk."""

    def __init__(self, ctx, p, g, bt):
        self.ctx, self.p, self.g, self.bt = ctx, p, g, bt
        self.nz = p.cache_mode == "PA_NZ"
        l1, hc, dr = ctx.l1, p.hckv, p.dr
        self.kv_l1 = [l1.alloc((KV_TILE * hc * 2,), "uint8", name=f"kv_{i}") for i in range(2)]
        self.kr_l1 = [l1.alloc((KV_TILE * dr * 2,), "uint8", name=f"kr_{i}") for i in range(2)]
        if p.kv_int8:
            self.stage = [l1.alloc((KV_TILE * DEQ_CHUNK,), "uint8", name=f"kv_i8_{i}") for i in range(2)]
            self.eye = l1.alloc((DEQ_CHUNK, DEQ_CHUNK), "int8", name="identity")
            # modeled as read by the fixpipe from L1: the hardware stages per-channel scales in FB (7 KiB) first
            self.deq = l1.alloc((hc,), "fp32", name="key_antiquant_scale")
            self.n_stage = 0

    def setup(self):
        if self.p.kv_int8:
            yield self.ctx.copy_gm_to_l1(self.eye, self.g.identity)
            yield self.ctx.copy_gm_to_l1(self.deq, self.g.key_antiquant_scale)

    def _pages(self, k, w):
        """[(page id, tile rows [a, b), first row within the page)] of the flash step's kv tokens [k, k+w)."""
        bs = self.p.block_size
        out = []
        for page in range(k // bs, (k + w - 1) // bs + 1):
            lo, hi = max(k, page * bs), min(k + w, (page + 1) * bs)
            pid = yield self.ctx.get_value(self.bt, page)
            out.append((int(pid), lo - k, hi - k, lo - page * bs))
        return out

    def load(self, sl, k, wv, w, a0, b0, acc, ab):
        """GM -> L1 of kv tokens [k, k+w) into slot ``sl``; returns (kv tile, kr tile) handles for ``to_l0b``.

        Only the ``wv`` tokens of the sequence come from the cache; the rows up to ``w`` (the cube's 16-row padding,
        i.e. the unused slots of the sequence's last page) are filled from a zero GM block: their probabilities are
        0, and 0 times whatever a stale slot holds (NaN, inf) must not reach the output."""
        ctx, p, g = self.ctx, self.p, self.g
        hc, dr = p.hckv, p.dr
        pages = yield from self._pages(k, w)
        valid = [(pid, a, min(b, wv), r) for pid, a, b, r in pages if a < wv]
        kr = g.kr_cache
        if self.nz:
            krt = typed(self.kr_l1[sl], (dr // 16, w, 16), "bf16")
            for pid, a, b, r in valid:
                yield ctx.copy_gm_to_l1(krt[:, a:b], kr[pid, 0, :, r:r + b - a])
        else:
            krt = typed(self.kr_l1[sl], (w, dr), "bf16")
            for pid, a, b, r in valid:
                yield ctx.copy_gm_to_l1(krt[a:b], kr[pid, r:r + b - a, 0])
        yield from self._zero_rows(krt, wv, w)
        kv = g.kv_cache
        if p.kv_int8:       # int8 slots are finite whatever they hold: the padding dequantises to finite rows
            kvt = typed(self.kv_l1[sl], (w, hc), "bf16")
            yield from self._dequant(kvt, pages, w, a0, b0, acc, ab)
            return (kvt, False), (krt, self.nz)
        if self.nz:
            kvt = typed(self.kv_l1[sl], (hc // 16, w, 16), "bf16")
            for pid, a, b, r in valid:
                yield ctx.copy_gm_to_l1(kvt[:, a:b], kv[pid, 0, :, r:r + b - a])
        else:
            kvt = typed(self.kv_l1[sl], (w, hc), "bf16")
            for pid, a, b, r in valid:
                yield ctx.copy_gm_to_l1(kvt[a:b], kv[pid, r:r + b - a, 0])
        yield from self._zero_rows(kvt, wv, w)
        return (kvt, self.nz), (krt, self.nz)

    def _zero_rows(self, tile, wv, w):
        """Rows [wv, w) of an ND [w, H] or NZ [H/16, w, 16] bf16 L1 tile <- zeros (one copy from GM)."""
        if wv == w:
            return
        zeros = self.g.zeros
        if self.nz:
            n1 = tile.shape[0]
            yield self.ctx.copy_gm_to_l1(tile[:, wv:w], zeros[:n1 * (w - wv) * 16].reshape(n1, w - wv, 16))
        else:
            h = tile.shape[1]
            yield self.ctx.copy_gm_to_l1(tile[wv:w], zeros[:(w - wv) * h].reshape(w - wv, h))

    def _dequant(self, kvt, pages, w, a0, b0, acc, ab):
        """int8 cache -> bf16 ND tile in L1, DEQ_CHUNK channels at a time (identity mmad + fixpipe dequant)."""
        ctx, kv = self.ctx, self.g.kv_cache
        c0n = DEQ_CHUNK // 32                        # int8 NZ fractal columns (N0 = 32) per chunk
        for c in range(0, self.p.hckv, DEQ_CHUNK):
            s = self.n_stage % 2
            self.n_stage += 1
            if self.nz:
                raw = typed(self.stage[s], (c0n, w, 32), "int8")
                for pid, a, b, r in pages:
                    yield ctx.copy_gm_to_l1(raw[:, a:b], kv[pid, 0, c // 32:c // 32 + c0n, r:r + b - a])
            else:
                raw = typed(self.stage[s], (w, DEQ_CHUNK), "int8")
                for pid, a, b, r in pages:
                    yield ctx.copy_gm_to_l1(raw[a:b], kv[pid, r:r + b - a, 0, c:c + DEQ_CHUNK])
            la = yield from to_l0(ctx, a0[ab()], (raw, self.nz), 0, DEQ_CHUNK, False, "a")
            lb = typed(b0[ab()], (DEQ_CHUNK, DEQ_CHUNK), "int8")
            yield ctx.copy_l1_to_l0b(lb, self.eye)
            out = typed(acc[s], (w, DEQ_CHUNK), "int32")
            yield ctx.mmad(out, la, lb)
            yield ctx.copy_l0c_to_l1(kvt[:, c:c + DEQ_CHUNK], out, scale=self.deq[c:c + DEQ_CHUNK])


def _attn_aic(ctx, p, g):
    l1, hc, dr = ctx.l1, p.hckv, p.dr
    q_l1 = l1.alloc((ROW_TILE * hc * 2,), "uint8", name="q_nope")
    qr_l1 = l1.alloc((ROW_TILE * dr * 2,), "uint8", name="q_rope")
    p_l1 = l1.alloc((ROW_TILE * KV_TILE * 2,), "uint8", name="probs")
    bt = l1.alloc((g.block_table.shape[1],), "int32", phantom=False, name="block_table")
    cache = KvTiles(ctx, p, g, bt)
    a0 = [ctx.l0a.alloc((32 * KiB,), "uint8", name=f"a_l0_{i}") for i in range(2)]
    b0 = [ctx.l0b.alloc((32 * KiB,), "uint8", name=f"b_l0_{i}") for i in range(2)]
    s_l0 = ctx.l0c.alloc((64 * KiB,), "uint8", name="scores")
    o_l0 = ctx.l0c.alloc((64 * KiB,), "uint8", name="o_j")
    deq_acc = [s_l0[:32 * KiB], s_l0[32 * KiB:]]          # int8 dequant accumulators reuse the score tile
    q3, qr3 = g.query, g.query_rope
    # this core's workspace slots, sliced once: slices of the shared [aic, ...] tensors would outgrow its memo
    ws_s, ws_p, ws_o = g.ws_s[ctx.block_idx], g.ws_p[ctx.block_idx], g.ws_o[ctx.block_idx]
    n_ab = [0]

    def ab():
        n_ab[0] += 1
        return n_ab[0] % 2

    yield from cache.setup()
    step = 0
    kv_tiles = [None, None]
    for u in p.units[ctx.block_idx]:
        m = u.r1 - u.r0
        qn = typed(q_l1, (m, hc), "bf16")
        qr = typed(qr_l1, (m, dr), "bf16")
        yield ctx.copy_gm_to_l1(qn, q3[u.b, u.r0:u.r1])
        yield ctx.copy_gm_to_l1(qr, qr3[u.b, u.r0:u.r1])
        yield ctx.copy_gm_to_l1(bt, g.block_table[u.b], pad=True)
        tiles = list(_kv_tiles(u.k0, u.k1))
        for j in range(len(tiles) + 1):
            if j < len(tiles):                                   # S(j) = Q K^T, one step ahead of PV(j-1)
                k, wv, w = tiles[j]
                sl = (step + j) % 2
                kvt, krt = yield from cache.load(sl, k, wv, w, a0, b0, deq_acc, ab)
                kv_tiles[sl] = kvt
                s_acc = typed(s_l0, (m, w), "fp32")
                parts = [(qn[:, c:min(hc, c + 128)], kvt, c, min(hc, c + 128)) for c in range(0, hc, 128)]
                parts.append((qr, krt, 0, dr))
                for i, (qa, kb, c0, c1) in enumerate(parts):
                    x = ab()
                    la = typed(a0[x], qa.shape, "bf16")
                    yield ctx.copy_l1_to_l0a(la, qa)
                    lb = yield from to_l0(ctx, b0[x], kb, c0, c1, True)
                    yield ctx.mmad(s_acc, la, lb, accumulate=i > 0)
                yield ctx.copy_l0c_to_gm(ws_s[sl, :m, :w], s_acc)
                yield ctx.cross_core_set(F_S)
            if j > 0:                                            # O(j-1) = P V
                kp, wvp, wp = tiles[j - 1]
                sl = (step + j - 1) % 2
                yield ctx.cross_core_wait(F_P)
                pt = typed(p_l1, (m, wp), "bf16")
                yield ctx.copy_gm_to_l1(pt, ws_p[sl, :m, :wp])
                x = ab()
                la = typed(a0[x], (m, wp), "bf16")
                yield ctx.copy_l1_to_l0a(la, pt)
                for c in range(0, hc, 128):
                    cw = min(128, hc - c)
                    x = ab()
                    lb = yield from to_l0(ctx, b0[x], kv_tiles[sl], c, c + cw, False)
                    o_acc = typed(o_l0, (m, cw), "fp32")
                    yield ctx.mmad(o_acc, la, lb)
                    yield ctx.copy_l0c_to_gm(ws_o[sl, :m, c:c + cw], o_acc)
                yield ctx.cross_core_set(F_O)
        step += len(tiles)


class _AivRows:
    """An AIV's tiles for query rows [a, b) of its units, sliced once (the units of a core share their row range,
    and the flash loop would otherwise re-slice them for every instruction): the running max ``m``, sum ``l``,
    ``tmp``, the two steps' ``alpha`` (and as [rn, 1] columns), the O accumulator ``o`` by 128-column chunk with
    its staging tile and ws_o rows per slot, and per (slot, kv width) the score tile and its ws_s / ws_p rows."""

    def __init__(self, ctx, p, g, t, a, b):
        rn = b - a
        gi = ctx.group_idx
        self.g, self.t, self.gi, self.a, self.b, self.rn = g, t, gi, a, b, rn
        self.m, self.l, self.tmp = t.m[:rn], t.l[:rn], t.tmp[:rn]
        self.m_col = self.m.reshape(rn, 1)
        self.alpha = [x[:rn] for x in t.alpha]
        self.alpha_col = [x.reshape(rn, 1) for x in self.alpha]
        self.o = t.o_acc[:rn]
        self.chunks = []                            # (O columns, O_j staging tile, ws_o rows per slot)
        for c in range(0, p.hckv, 128):
            cw = min(128, p.hckv - c)
            self.chunks.append((t.o_acc[:rn, c:c + cw], typed(t.work, (rn, cw), "fp32"),
                                [g.ws_o[gi, sl, a:b, c:c + cw] for sl in range(2)]))
        self._steps = {}

    def step(self, sl, w):
        """(scores [rn, w] fp32, its ws_s rows, probs [rn, w] bf16, their ws_p rows) of slot ``sl``."""
        views = self._steps.get((sl, w))
        if views is None:
            g, t, gi, a, b, rn = self.g, self.t, self.gi, self.a, self.b, self.rn
            views = self._steps[sl, w] = (typed(t.work, (rn, w), "fp32"), g.ws_s[gi, sl, a:b, :w],
                                          t.pb[:rn, :w], g.ws_p[gi, sl, a:b, :w])
        return views


@dataclass
class _AivTiles:
    """The UB tiles of an attention AIV that ``_AivRows`` slices (``_attn_aiv``)."""
    o_acc: object
    work: object
    pb: object
    m: object
    l: object
    alpha: list
    tmp: object


def _attn_aiv(ctx, p, g):
    hc = p.hckv
    ub = Carve(ctx.ub, 190 * KiB, "attn")
    half = ROW_TILE // 2
    o_acc = ub.take((half, hc), "fp32", "o_acc")
    work = ub.take((half * KV_TILE * 4,), "uint8", "scores_or_oj")      # scores, then an O_j column chunk
    pbuf = ub.take((half * KV_TILE * 2,), "uint8", "probs")             # probs; lse of the parts in a combine
    outb = ub.take((half * 64 * 2,), "uint8", "out_bf16")
    pb = typed(pbuf, (half, KV_TILE), "bf16")
    m_t = ub.take((half,), "fp32", "m")
    l_t = ub.take((half,), "fp32", "l")
    alpha = [ub.take((half,), "fp32", f"alpha{i}") for i in range(2)]
    tmp = ub.take((half,), "fp32", "tmp")
    iota = ub.take((KV_TILE,), "fp32", "iota")
    negs = ub.take((KV_TILE,), "fp32", "neg")
    mask = ub.take((KV_TILE,), "uint8", "mask")
    t = _AivTiles(o_acc, work, pb, m_t, l_t, alpha, tmp)
    rows_of = {}
    v = ctx.vec
    yield ctx.copy_gm_to_ub(iota, g.iota)
    yield v.duplicate(negs, NEG)
    step = 0
    for u in p.units[ctx.group_idx]:
        m = u.r1 - u.r0
        a, b = split(m, 2, 8)[ctx.sub_block_idx]
        rn = b - a
        L = p.seq_lens[u.b]
        tiles = list(_kv_tiles(u.k0, u.k1))
        if rn:
            r = rows_of.get((a, b))
            if r is None:
                r = rows_of[a, b] = _AivRows(ctx, p, g, t, a, b)
            yield v.duplicate(r.m, NEG)
            yield v.duplicate(r.l, 0.0)
            yield v.duplicate(r.o, 0.0)
        for j in range(len(tiles) + 1):
            if j < len(tiles):
                k, wv, w = tiles[j]
                sl = (step + j) % 2
                yield ctx.cross_core_wait(F_S)
                if rn:
                    sc, ws_s, pbw, ws_p = r.step(sl, w)
                    yield ctx.copy_gm_to_ub(sc, ws_s)
                    yield v.muls(sc, sc, p.scale)
                    yield from _mask(ctx, p, u, sc, a, b, k, w, L, iota, negs, mask)
                    al = r.alpha[j % 2]
                    yield v.reduce_max(r.tmp, sc)
                    yield v.max(r.tmp, r.tmp, r.m)                         # m_new
                    yield v.sub(al, r.m, r.tmp)
                    yield v.exp(al, al)                                  # alpha = exp(m_old - m_new)
                    yield v.copy(r.m, r.tmp)
                    yield v.sub(sc, sc, r.m_col)
                    yield v.exp(sc, sc)
                    yield v.reduce_sum(r.tmp, sc)
                    yield v.mul(r.l, r.l, al)
                    yield v.add(r.l, r.l, r.tmp)
                    yield v.cast(pbw, sc)
                    yield ctx.copy_ub_to_gm(ws_p, pbw)
                yield ctx.cross_core_set(F_P)
            if j > 0:
                sl = (step + j - 1) % 2
                yield ctx.cross_core_wait(F_O)
                if rn:
                    al = r.alpha_col[(j - 1) % 2]
                    for oc, oj, ws_o in r.chunks:
                        yield ctx.copy_gm_to_ub(oj, ws_o[sl])
                        yield v.mul(oc, oc, al)
                        yield v.add(oc, oc, oj)
        step += len(tiles)
        if rn:
            yield from _finish_unit(ctx, p, g, u, a, b, r.o, r.m, r.l, r.tmp, work, pbuf, outb)


def _mask(ctx, p, u, sc, a, b, k, w, seq_len, iota, negs, mask):
    """Scores of kv columns past the row's causal limit (or past the sequence) -> -1e30."""
    for s in range(p.s):
        ra, rb = max(a, s * p.n - u.r0), min(b, (s + 1) * p.n - u.r0)
        if ra >= rb:
            continue
        limit = seq_len - p.s + s - k          # columns j <= limit are visible to query token s
        if limit >= w - 1:
            continue
        yield ctx.vec.compare(mask[:w], iota[:w], float(limit), "gt")
        yield ctx.vec.select(sc[ra - a:rb - a], mask[:w], negs[:w], sc[ra - a:rb - a])


def _store_bf16(ctx, p, g, u, a, b, o, outb):
    """o [rows, Hckv] fp32 -> bf16 output rows, 64 columns at a time."""
    rn = b - a
    for c in range(0, p.hckv, 64):
        cw = min(64, p.hckv - c)
        ob = typed(outb, (rn, cw), "bf16")
        yield ctx.vec.cast(ob, o[:, c:c + cw])
        yield ctx.copy_ub_to_gm(g.out[u.b, u.r0 + a:u.r0 + b, c:c + cw], ob)


def _finish_unit(ctx, p, g, u, a, b, o, m_t, l_t, tmp, work, pbuf, outb):
    """Normalise; a whole unit stores bf16 output, a split one its partial O and log-sum-exp, and the last
    finisher of a split item combines all partials of its rows."""
    v = ctx.vec
    rn = b - a
    yield v.div(o, o, l_t.reshape(rn, 1))
    if u.parts == 1:
        yield from _store_bf16(ctx, p, g, u, a, b, o, outb)
        return
    yield v.ln(tmp, l_t)
    yield v.add(tmp, tmp, m_t)                                   # lse
    yield ctx.copy_ub_to_gm(g.ws_part[u.slot, a:b], o)
    yield ctx.copy_ub_to_gm(g.ws_lse[u.slot, a:b], tmp, pad=True)
    cnt = 2 * u.item + ctx.sub_block_idx
    old = yield ctx.atomic_add(g.counters[cnt:cnt + 1], 1, after="MTE3")
    if int(np.asarray(old).reshape(-1)[0]) != u.parts - 1:
        return
    # the last one in combines the parts of this item (their slots are consecutive)
    first = u.slot - u.part
    if u.parts * (-(-rn // 8) * 8) * 4 > pbuf.nbytes:
        raise ShapeError(f"{u.parts} kv splits of {rn} rows: their log-sum-exp needs {u.parts * rn * 4} bytes, "
                         f"the combine tile holds {pbuf.nbytes}")
    rn8 = -(-rn // 8) * 8                                        # 32-byte aligned rows
    lse = typed(pbuf, (u.parts, rn8), "fp32")[:, :rn]
    for q in range(u.parts):
        yield ctx.copy_gm_to_ub(lse[q], g.ws_lse[first + q, a:b], pad=True)
    yield v.copy(tmp, lse[0])
    for q in range(1, u.parts):
        yield v.max(tmp, tmp, lse[q])                            # max lse
    for q in range(u.parts):
        yield v.sub(lse[q], lse[q], tmp)
        yield v.exp(lse[q], lse[q])                              # weights exp(lse_q - max)
    yield v.copy(tmp, lse[0])
    for q in range(1, u.parts):
        yield v.add(tmp, tmp, lse[q])
    for q in range(u.parts):
        yield v.div(lse[q], lse[q], tmp)                         # normalised weights
    for c in range(0, p.hckv, 128):
        cw = min(128, p.hckv - c)
        oc = o[:, c:c + cw]
        stage = typed(work, (rn, cw), "fp32")
        for q in range(u.parts):
            yield ctx.copy_gm_to_ub(stage, g.ws_part[first + q, a:b, c:c + cw])
            yield v.mul(stage, stage, lse[q].reshape(rn, 1))
            if q == 0:
                yield v.copy(oc, stage)
            else:
                yield v.add(oc, oc, stage)
    yield from _store_bf16(ctx, p, g, u, a, b, o, outb)


# ============================================================================================ host side
@dataclass
class AttentionResult:
    """``attention_out`` (torch, shaped like ``query``; None in timing-only runs) and the run."""
    attention_out: object
    run: RunResult
    plan: AttnPlan


def _prepare(pod, die, p: AttnPlan, g: dict, numeric: bool, stream=None, after=()):
    """Allocate the workspaces and output, then launch (or, given the caller's ``stream``, queue: returns a
    ``Pending``)."""
    ph = not numeric
    aic = p.aic
    g["ws_s"] = pod.alloc(die, (aic, 2, ROW_TILE, KV_TILE), "fp32", phantom=ph, name="ws_scores")
    g["ws_p"] = pod.alloc(die, (aic, 2, ROW_TILE, KV_TILE), "bf16", phantom=ph, name="ws_probs")
    g["ws_o"] = pod.alloc(die, (aic, 2, ROW_TILE, p.hckv), "fp32", phantom=ph, name="ws_oj")
    slots = max(1, p.n_slots)
    g["ws_part"] = pod.alloc(die, (slots, ROW_TILE, p.hckv), "fp32", phantom=ph, name="ws_partial_o")
    g["ws_lse"] = pod.alloc(die, (slots, ROW_TILE), "fp32", phantom=ph, name="ws_partial_lse")
    g["counters"] = pod.alloc(die, (2 * max(1, p.n_items),), "int32", name="combine_counters")   # control data
    g["iota"] = pod.to_gm(die, np.arange(KV_TILE, dtype=np.float32), name="iota")
    # padding rows of a tile: written by the host (an allocation's zeros are no data: the sanitizer reports reading
    # them as uninitialised, as a real device's fresh GM holds whatever was there)
    g["zeros"] = pod.to_gm(die, np.zeros(16 * max(p.hckv, p.dr), np.float32), dtype="bf16", name="zero_rows")
    if p.kv_int8:
        g["identity"] = pod.to_gm(die, np.eye(DEQ_CHUNK, dtype=np.int8), name="identity")
    g["out"] = pod.alloc(die, (p.batch, p.s * p.n, p.hckv), "bf16", phantom=ph, name="attention_out")
    if stream is not None:
        la = stream.launch(mla_attention_kernel, (p, AttnTensors(**g)), numeric=numeric, name="mla_attention",
                           after=list(after))
        return Pending([la], lambda run: AttentionResult(None, run, p))
    run = pod.launch(mla_attention_kernel, die=die, aic=aic, args=(p, AttnTensors(**g)), numeric=numeric,
                     name="mla_attention")
    return AttentionResult(None, run, p)


def _plan(batch, s, n, hckv, dr, block_size, scale, seq_lens, aic, tiling, max_blocks, cache_mode="PA_BSND",
          kv_int8=False):
    seq_lens = tuple(int(x) for x in seq_lens)
    if len(seq_lens) != batch:
        raise ShapeError(f"actual_seq_lengths_kv has {len(seq_lens)} entries for batch {batch}")
    for b, L in enumerate(seq_lens):
        if not s <= L <= max_blocks * block_size:
            raise ShapeError(f"actual_seq_lengths_kv[{b}]={L} must be in {s}..{max_blocks * block_size} "
                             f"(at least the {s} query tokens; at most block_table's {max_blocks} blocks x "
                             f"{block_size})")
    for name, v in (("Hckv", hckv), ("Dr", dr), ("block_size", block_size)):
        if v % 16:
            raise ShapeError(f"{name}={v} must be a multiple of 16")
    if hckv > 512 or dr > 128:
        raise ShapeError(f"Hckv={hckv} (max 512) or Dr={dr} (max 128) exceed the L1 tiles of one work unit")
    if not 1 <= aic <= 24:
        raise ArgumentError(f"aic={aic} out of range 1..24")
    check_cache_mode(cache_mode)
    if kv_int8 and hckv % DEQ_CHUNK:
        raise ShapeError(f"Hckv={hckv} must be a multiple of {DEQ_CHUNK} for an int8 kv_cache (dequant chunk)")
    units, n_items, n_slots = plan_units(seq_lens, s, n, aic, tiling)
    return AttnPlan(batch, s, n, hckv, dr, block_size, float(scale), seq_lens, units, n_items, n_slots, aic,
                    cache_mode, bool(kv_int8))


def mla_decode_attention(query, query_rope, kv_cache, kr_cache, block_table, actual_seq_lengths_kv, *,
                         softmax_scale: float, key_antiquant_scale=None, key_antiquant_mode: int = 0,
                         cache_mode: str = "PA_BSND", tiling: str = "balanced", pod: Pod | None = None, die: int = 0,
                         aic: int = 24, numeric: bool = True, stream=None, after=()) -> AttentionResult:
    """Absorb-mode MLA decode attention over a paged latent cache (numeric mode, torch inputs; names follow
    torch_npu's npu_fused_infer_attention_score with input_layout="BSND").

    query [B, S, N, Hckv] bf16 (q_nope absorbed through W_uk), query_rope [B, S, N, Dr] bf16; S = 1 + MTP depth
    query tokens per sequence, the last S positions of each sequence. Caches, as ``mla_prolog`` writes them:
    ``cache_mode="PA_BSND"``: kv_cache [blocks, block_size, 1, Hckv], kr_cache [blocks, block_size, 1, Dr];
    ``"PA_NZ"``: kv_cache [blocks, 1, Hckv/N0, block_size, N0] (N0 = 16 bf16, 32 int8), kr_cache
    [blocks, 1, Dr/16, block_size, 16]. kr_cache is bf16; kv_cache is bf16, or int8 with ``key_antiquant_scale``
    [Hckv] fp32, per channel (``key_antiquant_mode=0``, the only mode): latent = int8 * key_antiquant_scale, the
    same scale serving K and V (one latent in absorb mode); from an mla_prolog int8 cache it is
    1 / quant_scale_ckv. block_table [B, max_blocks] int (page ids); actual_seq_lengths_kv [B]: kv length per
    sequence, the S new tokens included. softmax_scale: e.g. 0.135234 for DeepSeek-V3 (192^-0.5 times the YaRN
    mscale^2). Returns ``AttentionResult`` (attention_out [B, S, N, Hckv] bf16, run).

    An int8 tile is dequantised on the cube (``KvTiles``) into the bf16 tile a bf16 cache would give:
    attention over int8 values k8 equals, bit for bit, attention over the bf16 cache bf16(k8 * scale).

    ``numeric=False``: timing only (query and caches may be meta tensors; block_table and the lengths stay real;
    attention_out None). ``stream`` (a ``Stream`` on one die) / ``after``: queue on the caller's stream (its AICs)
    instead of running and return a ``kernels.ranks.Pending`` whose ``collect`` gives the result; the caches, given
    as CPU tensors, are then read through GM aliases (``pod.to_gm(copy=False)``): what a kernel queued before wrote
    into them (``mla_prolog`` with ``stream=``) is read when this one runs."""
    import torch
    if query.dim() != 4:
        raise ShapeError(f"query must be BSND [B, S, N, Hckv], got shape {tuple(query.shape)}")
    batch, s, n, hckv = query.shape
    dr = query_rope.shape[-1]
    kv_int8 = kv_cache.dtype == torch.int8
    bs = check_caches(kv_cache, kr_cache, hckv, dr, cache_mode, kv_int8)
    if kv_int8 != (key_antiquant_scale is not None):
        raise ArgumentError(f"key_antiquant_scale is {'missing' if kv_int8 else 'given'} for a "
                            f"{'int8' if kv_int8 else str(kv_cache.dtype)} kv_cache: it is required exactly when "
                            f"kv_cache is int8")
    if key_antiquant_mode != 0:
        raise ArgumentError(f"key_antiquant_mode={key_antiquant_mode}: only 0 (per channel) is supported")
    if kv_int8 and key_antiquant_scale.numel() != hckv:
        raise ShapeError(f"key_antiquant_scale has {key_antiquant_scale.numel()} values; need Hckv={hckv}")
    if stream is not None:
        pod, (die,), aic, _ = caller_streams(stream, 1, "aic", aic, "aic")
    p = _plan(batch, s, n, hckv, dr, bs, softmax_scale, list(torch.as_tensor(actual_seq_lengths_kv).tolist()),
              aic, tiling, block_table.shape[1], cache_mode, kv_int8)
    _check_block_table(block_table, p.seq_lens, bs, kv_cache.shape[0])
    pod = pod or Pod(cloudmatrix384(dies=1), trace=False)

    def gm(v, name, cache=False):
        if cache and stream is not None and numeric:        # queued: read what earlier queued kernels write
            return pod.to_gm(die, v, name=name, copy=False)
        return to_gm(pod, die, v, name, numeric)       # inputs the kernel only reads: aliased when they can be
    g = {"query": gm(query.reshape(batch, s * n, hckv), "query"),
         "query_rope": gm(query_rope.reshape(batch, s * n, dr), "query_rope"),
         "kv_cache": gm(kv_cache, "kv_cache", True), "kr_cache": gm(kr_cache, "kr_cache", True),
         "block_table": pod.to_gm(die, block_table.to(torch.int32), name="block_table")}     # control data: real
    if kv_int8:
        g["key_antiquant_scale"] = gm(key_antiquant_scale.reshape(-1).float(), "key_antiquant_scale")

    def finish(res):
        if numeric:
            from .mla import _to_torch
            res.attention_out = _to_torch(g["out"].numpy()).reshape(batch, s, n, hckv)
        return res
    res = _prepare(pod, die, p, g, numeric, stream, after)
    if stream is not None:
        return Pending(res.launches, lambda run: finish(res.collect(run)))
    return finish(res)


def _check_block_table(block_table, seq_lens, block_size: int, blocks: int) -> None:
    """Every page a sequence reads must be a block of the caches (checked before launching, not as an address
    error inside the kernel)."""
    bt = integer_array(block_table, "block_table")
    if bt.ndim != 2 or bt.shape[0] != len(seq_lens):
        raise ShapeError(f"block_table has shape {tuple(bt.shape)}: expected [batch={len(seq_lens)}, max_blocks]")
    for b, L in enumerate(seq_lens):
        used = bt[b, :-(-L // block_size)]
        if used.size and (used.min() < 0 or used.max() >= blocks):
            bad = int(used.min() if used.min() < 0 else used.max())
            raise ArgumentError(f"block_table[{b}] names block {bad}: the caches have blocks 0..{blocks - 1}")


def mla_decode_attention_timing(batch: int = 96, seq_len: int = 4096, *, heads: int = 128, mtp: int = 0,
                                hckv: int = 512, dr: int = 64, block_size: int = 128, seq_lens=None,
                                tiling: str = "balanced", kv_int8: bool = False, cache_mode: str = "PA_BSND",
                                aic: int | None = None, pod: Pod | None = None, die: int = 0,
                                trace: bool = False, stream=None, after=()):
    """Timing-only decode attention (default: DeepSeek-V3, batch 96 at 4K context). GM is phantom except the
    control data (block table, counters). ``kv_int8``: int8 latent cache (per-channel scale), ``cache_mode``
    "PA_BSND" or "PA_NZ". ``aic``: AICs (default 24). ``stream`` (one die) / ``after``: queue on the caller's
    stream (its AICs) instead of running, and return a ``kernels.ranks.Pending``."""
    if stream is not None:
        pod, (die,), aic, _ = caller_streams(stream, 1, "aic", aic, "aic")
    aic = 24 if aic is None else aic
    s = 1 + mtp
    seq_lens = list(seq_lens) if seq_lens is not None else [seq_len] * batch
    max_blocks = -(-max(seq_lens) // block_size)
    p = _plan(batch, s, heads, hckv, dr, block_size, 0.135234, seq_lens, aic, tiling, max_blocks, cache_mode,
              kv_int8)
    pod = pod or Pod(cloudmatrix384(dies=1), trace=trace)
    blocks = batch * max_blocks
    kvdt = "int8" if kv_int8 else "bf16"
    kv_shape, kr_shape = cache_shapes(blocks, block_size, hckv, dr, cache_mode, kv_int8)
    g = {"query": pod.alloc(die, (batch, s * heads, hckv), "bf16", phantom=True, name="query"),
         "query_rope": pod.alloc(die, (batch, s * heads, dr), "bf16", phantom=True, name="query_rope"),
         "kv_cache": pod.alloc(die, kv_shape, kvdt, phantom=True, name="kv_cache"),
         "kr_cache": pod.alloc(die, kr_shape, "bf16", phantom=True, name="kr_cache"),
         "key_antiquant_scale": pod.alloc(die, (hckv,), "fp32", phantom=True, name="key_antiquant_scale"),
         "block_table": pod.to_gm(die, np.arange(blocks, dtype=np.int32).reshape(batch, max_blocks))}
    return _prepare(pod, die, p, g, False, stream, after)


def attention_bytes(seq_lens, s: int, n: int, hckv: int, dr: int, kv_bytes: int = 2) -> int:
    """Compulsory HBM bytes: each sequence's latent cache once, queries in and outputs out."""
    kv = sum(seq_lens) * (hckv * kv_bytes + dr * 2)
    q = len(seq_lens) * s * n * (2 * hckv + dr) * 2
    return kv + q


def attention_flops(seq_lens, s: int, n: int, hckv: int, dr: int) -> float:
    """Cube FLOPs: 2 * rows * L * ((Hckv + Dr) + Hckv) per sequence."""
    return float(sum(2.0 * s * n * L * (2 * hckv + dr) for L in seq_lens))


# ============================================================================================ references
def gather_pages(cache, block_table, seq_len: int, b: int):
    """Rows [0, seq_len) of sequence b from a PA_BSND cache [blocks, block_size, 1, H] -> [seq_len, H]."""
    bs = cache.shape[1]
    pages = block_table[b, :-(-seq_len // bs)].long()
    return cache[pages].reshape(-1, cache.shape[-1])[:seq_len]


def attention_reference(query, query_rope, kv_cache, kr_cache, block_table, actual_seq_lengths_kv,
                        softmax_scale: float, kv_dequant_scale=None):
    """Absorb mode, naive fp32 softmax (no tiling): [B, S, N, Hckv] fp32. ``kv_dequant_scale`` [Hckv] turns an
    int8 kv_cache back to real values."""
    import torch
    batch, s, n, hckv = query.shape
    out = torch.empty(batch, s, n, hckv, dtype=torch.float32)
    for b in range(batch):
        L = int(actual_seq_lengths_kv[b])
        kv = gather_pages(kv_cache, block_table, L, b).float()
        if kv_dequant_scale is not None:
            kv = kv * kv_dequant_scale.float().reshape(1, -1)
        kr = gather_pages(kr_cache, block_table, L, b).float()
        sc = (torch.einsum("snc,lc->snl", query[b].float(), kv) +
              torch.einsum("snr,lr->snl", query_rope[b].float(), kr)) * softmax_scale
        pos = torch.arange(L)
        limit = L - s + torch.arange(s)
        sc = sc.masked_fill(pos[None, None, :] > limit[:, None, None], float("-inf"))
        out[b] = torch.einsum("snl,lc->snc", torch.softmax(sc, -1), kv)
    return out


def attention_reference_naive(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, softmax_scale: float, s: int):
    """Naive (non-absorbed) MLA for one sequence, fp64: k_nope = kv_c W_uk^T, v = kv_c W_uv^T per head.
    q_nope [S, N, D], q_pe [S, N, Dr], kv_c [L, Hckv], k_pe [L, Dr], w_uk [N, D, Hckv], w_uv [N, Dv, Hckv].
    Returns [S, N, Dv]; the absorbed path gives attention_out @ W_uv^T."""
    import torch
    L = kv_c.shape[0]
    k_nope = torch.einsum("lc,ndc->lnd", kv_c.double(), w_uk.double())
    v = torch.einsum("lc,nvc->lnv", kv_c.double(), w_uv.double())
    sc = (torch.einsum("snd,lnd->snl", q_nope.double(), k_nope) +
          torch.einsum("snr,lr->snl", q_pe.double(), k_pe.double())) * softmax_scale
    limit = L - s + torch.arange(s)
    sc = sc.masked_fill(torch.arange(L)[None, None, :] > limit[:, None, None], float("-inf"))
    return torch.einsum("snl,lnv->snv", torch.softmax(sc, -1), v)


def attention_flash_reference(query, query_rope, kv_cache, kr_cache, block_table, actual_seq_lengths_kv,
                              softmax_scale: float):
    """The kernel's own algorithm in torch/numpy for ``tiling="batch"`` (bitwise what ``mla_decode_attention``
    returns with that tiling; PA_BSND bf16 caches): per (sequence, 128-row tile), 128-token kv steps padded to 16
    rows; S = sum of fp32 partial products (128 latent channels at a time, then the rope part); scale, mask to
    -1e30, online softmax in fp32 (numpy, as the vector unit), probabilities rounded to bf16, O += P V in fp32,
    O / l rounded to bf16. Returns attention_out [B, S, N, Hckv] bf16."""
    import torch
    batch, s, n, hc = query.shape
    dr = query_rope.shape[-1]
    rows = s * n
    q_all = query.reshape(batch, rows, hc).float()
    qr_all = query_rope.reshape(batch, rows, dr).float()
    bs = kv_cache.shape[1]
    f32 = np.float32
    out = torch.empty(batch, rows, hc, dtype=torch.bfloat16)
    for b in range(batch):
        L = int(actual_seq_lengths_kv[b])
        for r0 in range(0, rows, ROW_TILE):
            r1 = min(rows, r0 + ROW_TILE)
            m = r1 - r0
            qn, qr = q_all[b, r0:r1], qr_all[b, r0:r1]
            m_t = np.full(m, NEG, f32)
            l_t = np.zeros(m, f32)
            o = np.zeros((m, hc), f32)
            for k, wv, w in _kv_tiles(0, L):
                pos = torch.arange(k, k + w)
                pages = torch.as_tensor(block_table[b], dtype=torch.long)[pos // bs]
                kv = kv_cache[pages, pos % bs, 0].float()
                kr = kr_cache[pages, pos % bs, 0].float()
                kv[wv:] = 0.0                                     # the padding rows past the sequence are zeros
                kr[wv:] = 0.0
                acc = None
                for c in range(0, hc, 128):
                    part = qn[:, c:c + 128] @ kv[:, c:c + 128].t().contiguous()
                    acc = part if acc is None else acc + part
                acc = acc + qr @ kr.t().contiguous()
                sc = acc.numpy().astype(f32) * f32(softmax_scale)
                for si in range(s):
                    ra, rb = max(0, si * n - r0), min(m, (si + 1) * n - r0)
                    limit = L - s + si - k
                    if ra < rb and limit < w - 1:
                        sc[ra:rb, np.arange(w) > limit] = f32(NEG)
                new = np.maximum(np.max(sc, axis=-1), m_t)
                alpha = np.exp(m_t - new)
                m_t = new
                sc = np.exp(sc - m_t[:, None])
                l_t = l_t * alpha + np.sum(sc, axis=-1)
                p = torch.from_numpy(sc).to(torch.bfloat16).float()
                for c in range(0, hc, 128):
                    oj = (p @ kv[:, c:c + 128].contiguous()).numpy()
                    o[:, c:c + 128] = o[:, c:c + 128] * alpha[:, None] + oj
            out[b, r0:r1] = torch.from_numpy(o / l_t[:, None]).to(torch.bfloat16)
    return out.reshape(batch, s, n, hc)
