"""A2E / E2A: disaggregated MoE-attention token exchange with trampoline forwarding (DESIGN.md 4).

Attention dies (one or more DP domains of ``A`` dies) send each token's hidden state to the expert dies that own its
top-k experts (A2E) and collect the weighted sum of the expert outputs (E2A). ``E`` expert dies hold
``num_experts / E`` experts each (contiguous placement). One host drives the pod, so routing is planned on the host
(as in ``xccl.moe``) and the handshakes (status records, polls, joins) run in the kernels.

**Groups and trampolines.** The ``E`` expert dies are cut into ``T`` contiguous groups; the first die of each group is
its *trampoline*. Trampoline mode: ``T = min(A, E)`` (as many trampolines as attention dies; when ``A >= E`` every
expert die is its own trampoline and the two modes coincide), groups of ``ceil(E / T)`` or ``floor(E / T)``
neighbouring dies; with groups of one or two, the pairs are the two dies of one chip where the numbering allows (the
forwarding hop then takes the die-to-die link, not the fabric ports). Direct mode: ``T = E``, groups of one.
One code path serves both, so the comparison isolates the trampoline.

A2E (one multi-die comm kernel over the domain's attention dies and every expert die, ``cores`` AIVs each):
  1. stage 1, attention die ``a``: for each trampoline ``g`` (rotated start ``a * T // A``, so the sources do not all
     hit one receiver first; trampoline -> core ``position % cores``): the rows for the group (one per (token, k)
     whose expert lives on one of its dies, ordered owner, token, k): mtu path: whole UB tiles of the group's rows,
     each written with one copy into the group buffer on ``g`` (a scatter where a tile spans two owners' regions);
     DMA path: packed into a local send buffer, then one DMA descriptor per group (the descriptor start-up is the
     per-destination cost the trampoline cuts: 160 descriptors per attention die instead of 288 at paper scale); a
     group of several dies lands in its trampoline's landing buffer, one block per source. The gating weight of each
     row travels beside it (DMA path: written from UB by the mtu, a few bytes not worth a descriptor). Then one
     32-byte status record (flag = round, count) on ``g``, ordered after the data (``after=`` the pipes that moved
     it), also when the count is 0: a receiver hears from every source.
  2. trampoline ``g`` (every expert die in direct mode): the ``A`` records are split over the cores in contiguous
     ranges of sources, ordered by when their data completes (the fan-in per core is ``A / cores`` records, not
     ``A``); each core checks its sources' counts and forwards those sources' rows for each partner (contiguous in
     both buffers) as soon as they have landed: cut-through, mtu tiles (DMA path: the AIVs gather each landed
     range from the landing buffer into the partners' inputs, the trampoline's own region and the weights); then a
     die-local join (atomic counter) and one status record per partner. Partners poll that one record.
E2A (one comm kernel over the same dies):
  3. partner ``e`` sends its expert output (same row order as its input) in bulk to the trampoline; join; one record.
  4. trampoline ``g``, per source ``a`` (sources dealt over the cores) and per token with rows in the group: gather
     the token's rows and weights, ``partial = sum w_k * y_k`` in fp32 (cast, multiply, tree add on the vector unit),
     cast to bf16, write the partials as one contiguous block into ``a``'s E2A window (mtu), or stage them locally
     and move the block with one DMA descriptor (the group's dies take turns: every ``len(group)``-th block is
     handed to a partner, whose DMA engine sends it, so no one engine pays every start-up); one record per attention
     die (count may be 0). Tokens whose rows all sit in the trampoline's own region come first in each block and are
     reduced before the partners' records are polled, so the partners' bulk sends overlap the trampoline's own work.
  5. attention die ``a`` polls its ``T`` records (fan-in ``T``: 288 direct vs 160 trampolines at paper scale; each
     core polls ``T / cores`` of them, then a die barrier), gathers each token's partials (one per group it used),
     sums in fp32, casts to bf16: ``out [B, H]``.
So out = bf16(sum_g bf16(sum_{k in g} w_k y_k)): bf16-exact per group, the reference within bf16 tolerance.

GM areas owned by this module (beyond comm.py's layout; int32 32-byte fields: word 0 flag = round, 1 count):
  ``a2e.s1{die}``  [A_max, 8] on every expert die: stage-1 records from the attention dies of the running domain
                   (mtu path, words 2, 3: round and rows once the partners' rows, sent first, have landed)
  ``a2e.s2{die}``  [8]        on every expert die: the forward record from its trampoline
  ``a2e.s3{die}``  [G_max, 8] on every expert die: E2A records from its partners (slot = position in group - 1)
  ``a2e.s4{die}``  [T, 8]     on every attention die: E2A records from the trampolines
  ``a2e.s5{die}``  [A_max, 8] on every expert die: DMA path, a partial block its trampoline staged for this die's
                   DMA engine to send (slot = source)
  ``a2e.ctl{die}`` [8]        on every die: word 0 a monotonic join counter (target = joins so far x cores)
and per call: group buffer ``[rows_g, H]`` bf16 + weights ``[rows_g + 1]`` fp32 on each trampoline (own region first:
its expert input), partner input buffers, expert output buffers (trampoline: ``[rows_g + 1, H]`` with a zero last row
that pads gathers), attention E2A windows ``[rows + 1, H]`` (block per trampoline, zero last row), outputs ``[B, H]``;
DMA path: send packs on the attention dies, landing buffers ``[rows_g, H]`` + ``[rows_g, 1]`` on trampolines with
partners, E2A staging blocks on the trampolines.

modeled as: routing, offsets and counts planned on the host (a device-side count exchange would add one metadata
round trip to both modes alike); identity or host-side experts between A2E and E2A unless a kernel writes the
outputs (``serving.expert_pipeline`` runs a grouped-GEMM stream there, on persistent kernels that call
the per-role steps below: ``a2e_attention_step`` ... ``e2a_attention_step``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.arguments import check_int
from ascend_emu.errors import ArgumentError, CapacityError

from .comm import XcclError, integer_ids

FLAG, COUNT = 0, 1
FWD_FLAG, FWD_COUNT = 2, 3      # stage-1 records: the partners' rows (sent first) have landed: round, rows
UB_SPARE = 8 * 1024
MAX_TILE_ROWS = 64
INT32_MIN = np.iinfo(np.int32).min


# ============================================================================================== host plan
def plan_groups(num_attn: int, num_expert: int, trampoline: bool, chips=None) -> list:
    """Groups of expert-die indices; ``groups[g][0]`` is trampoline ``g``. Trampoline mode: min(A, E) groups.

    ``chips``: the chip of each expert die (optional). With groups of one or two dies, a pair is then formed from the
    two dies of one chip where the count allows, so the forwarding hop uses the die-to-die link instead of the
    fabric ports; otherwise contiguous groups of ``ceil(E / T)`` or ``floor(E / T)`` dies."""
    t = min(num_attn, num_expert) if trampoline else num_expert
    if chips is not None and len(chips) == num_expert and num_expert <= 2 * t:
        groups, i = [], 0
        while i < num_expert:
            pairs_left = (num_expert - i) - (t - len(groups))     # dies left minus groups left
            if pairs_left > 0 and (pairs_left == t - len(groups) or (i + 1 < num_expert and chips[i] == chips[i + 1])):
                groups.append([i, i + 1])
                i += 2
            else:
                groups.append([i])
                i += 1
        return groups
    return [list(range(g * num_expert // t, (g + 1) * num_expert // t)) for g in range(t)]


@dataclass
class _DomainPlan:
    """Where every (attention die, token, k) row goes in one A2E/E2A call (indices are positions in the lists)."""
    A: int
    B: int
    K: int
    groups: list
    group_of: np.ndarray                 # [E] group of each expert die
    runs: list                           # [a][g] -> list of (e, tokens, send offset, dst row in group buffer):
                                         # the partners' runs first, the trampoline's own last
    send_rows: list                      # [a] rows a sends in total (its pack / weight-send length)
    wsend: list                          # [a] fp32 gating weight of each sent row, in send order
    n_ag: np.ndarray                     # [A, T] rows from a to g
    region: list                         # [g] -> {e: (first row, rows)} in the group buffer
    rows_g: list                         # [g] rows of the group buffer
    rows_e: np.ndarray                   # [E] rows expert die e receives
    row_id: list                         # [g] -> [rows_g, 3] (a, t, k) of each group-buffer row
    red: list                            # [g][a] -> (tokens [n], idx [n, S] rows of the group buffer, padded):
                                         # tokens whose rows all sit in the trampoline's own region first
    S: list                              # [g] slots per partial (max rows of one token in the group)
    n_own: np.ndarray                    # [T, A] leading tokens of red[g][a] that need no partner's output
    src_off: list                        # [g] -> {e: [A + 1] first group-buffer row of each source's rows for e}
    n_fwd: np.ndarray                    # [A, T] rows from a to g that g forwards (its partners' rows, sent first)
    win_off: np.ndarray                  # [A, T] first row of trampoline g's block in a's E2A window
    win_rows: list                       # [a] window rows
    fin_idx: list                        # [a] [B, J] window rows of each token's partials (padded with the zero row)


def plan_domain(topk_ids, topk_weights, num_experts: int, num_expert_dies: int, groups: list) -> _DomainPlan:
    ids = [integer_ids(a, f"topk_ids[{r}]") for r, a in enumerate(topk_ids)]
    ws = [np.asarray(w, dtype=np.float32) for w in topk_weights]
    A = len(ids)
    if not A or ids[0].ndim != 2:
        raise ArgumentError(f"topk_ids: per attention die a [tokens, top_k] array, got "
                            f"{ids[0].shape if A else 'no dies'}")
    B, K = ids[0].shape
    E = num_expert_dies
    epd = num_experts // E
    T = len(groups)
    group_of = np.zeros(E, np.int64)
    for g, members in enumerate(groups):
        group_of[members] = g
    for r, a in enumerate(ids):
        if a.shape != (B, K) or ws[r].shape != (B, K):
            raise ArgumentError(f"topk_ids[{r}] / topk_weights[{r}] have shapes {a.shape} / {ws[r].shape}: every "
                                f"attention die routes [{B}, {K}]")
        if a.size and (a.min() < -1 or a.max() >= num_experts):
            bad = int(a.min() if a.min() < -1 else a.max())
            raise ArgumentError(f"topk_ids[{r}] holds expert {bad}: allowed -1 and 0..{num_experts - 1}")
    # rows of (a, e): ordered by expert, token, k
    per_ae = [[None] * E for _ in range(A)]
    for a in range(A):
        t_idx, k_idx = np.nonzero(ids[a] >= 0)
        ex = ids[a][t_idx, k_idx]
        owner = ex // epd
        order = np.lexsort((k_idx, t_idx, ex, owner))
        t_idx, k_idx, owner = t_idx[order], k_idx[order], owner[order]
        cuts = np.searchsorted(owner, np.arange(E + 1))
        for e in range(E):
            s = slice(cuts[e], cuts[e + 1])
            per_ae[a][e] = (t_idx[s], k_idx[s])
    rows_e = np.array([sum(len(per_ae[a][e][0]) for a in range(A)) for e in range(E)], np.int64)
    region, rows_g, row_id, src_off = [], [], [], []
    dst_of = {}                                   # (a, e) -> first row in the group buffer
    sources = np.arange(A)
    for g, members in enumerate(groups):
        reg, r0, ids_g, off = {}, 0, [], {}
        for e in members:           # one array op per expert die, not per (source, expert)
            reg[e] = (r0, int(rows_e[e]))
            pairs = [per_ae[a][e] for a in range(A)]
            lens = np.array([len(tt) for tt, _ in pairs], np.int64)
            off[e] = o = np.empty(A + 1, np.int64)
            o[0] = r0
            np.cumsum(lens, out=o[1:])
            o[1:] += r0
            for a, first in enumerate(o[:A].tolist()):
                dst_of[(a, e)] = first
            ids_g.append(np.stack([np.repeat(sources, lens), np.concatenate([tt for tt, _ in pairs]),
                                   np.concatenate([kk for _, kk in pairs])], 1))
            r0 = int(o[A])
        region.append(reg)
        src_off.append(off)
        rows_g.append(r0)
        row_id.append(np.concatenate(ids_g) if ids_g else np.zeros((0, 3), np.int64))
    runs, send_rows, wsend = [], [], []
    n_ag = np.zeros((A, T), np.int64)
    n_fwd = np.zeros((A, T), np.int64)
    for a in range(A):
        ra, s0, parts, n_a, fwd_a = [], 0, [], [], []
        for g, members in enumerate(groups):
            lst, s_g, own = [], s0, 0
            for e in members[1:] + members[:1]:          # partners first: the trampoline forwards them early
                tt, kk = per_ae[a][e]
                if len(tt):
                    lst.append((e, tt, s0, dst_of[(a, e)]))
                    parts.append(per_ae[a][e])
                    s0 += len(tt)
                    if e == members[0]:
                        own = len(tt)
            ra.append(lst)
            n_a.append(s0 - s_g)
            fwd_a.append(s0 - s_g - own)
        runs.append(ra)
        send_rows.append(s0)
        n_ag[a], n_fwd[a] = n_a, fwd_a
        # one gather of the source's weights in send order
        wsend.append(ws[a][np.concatenate([tt for tt, _ in parts]), np.concatenate([kk for _, kk in parts])]
                     .astype(np.float32) if parts else np.zeros(0, np.float32))
    # E2A: per trampoline and source, the distinct tokens with rows in the group and their rows (padded)
    red, S = [], []
    n_out = np.zeros((A, T), np.int64)
    n_own = np.zeros((T, A), np.int64)
    for g in range(T):
        uniq, idx, bounds, own, smax = _reduce_rows(row_id[g], A, rows_g[g], region[g][groups[g][0]][1])
        S.append(smax)
        n_out[:, g] = np.diff(bounds)
        n_own[g] = own
        red.append([(uniq[b0:b1], idx[b0:b1]) for b0, b1 in zip(bounds[:-1].tolist(), bounds[1:].tolist())])
    win_off = np.cumsum(n_out, axis=1) - n_out
    win_rows = [int(n_out[a].sum()) for a in range(A)]
    fin_idx = []
    for a in range(A):        # each token's window rows, ascending (by trampoline, then place in its part)
        toks = np.concatenate([red[g][a][0] for g in range(T)]) if T else np.zeros(0, np.int64)
        rows = np.concatenate([int(win_off[a, g]) + np.arange(len(red[g][a][0])) for g in range(T)]) if T \
            else np.zeros(0, np.int64)
        order = np.argsort(toks, kind="stable")
        per_tok = np.bincount(toks, minlength=B)
        J = max(1, int(per_tok.max()) if B else 1)
        idx = np.full((B, J), win_rows[a], np.int64)
        first = np.cumsum(per_tok) - per_tok
        st = toks[order]
        idx[st, np.arange(len(st)) - first[st]] = rows[order]
        fin_idx.append(idx)
    return _DomainPlan(A, B, K, groups, group_of, runs, send_rows, wsend, n_ag, region, rows_g, rows_e, row_id,
                       red, S, n_own, src_off, n_fwd, win_off, win_rows, fin_idx)


def _reduce_rows(rid: np.ndarray, A: int, zero: int, own_rows: int) -> tuple:
    """E2A at one trampoline: ``rid`` [rows, 3] (source, token, k) of its group buffer's rows, the first
    ``own_rows`` its own region. Per source ``a``, the distinct tokens with rows here - those whose rows all sit in
    the own region first, each part ascending - and each token's rows ascending, padded with row ``zero`` to the
    most rows of one token (at least 1). Returns (tokens [n], rows [n, S], [A + 1] bounds of each source's part,
    [A] own-only tokens per source, S); all int64."""
    n = len(rid)
    src, tok = rid[:, 0], rid[:, 1]
    order = np.lexsort((tok, src))              # stable: a token's rows stay ascending
    s_src, s_tok = src[order], tok[order]
    first = np.ones(n, bool)
    first[1:] = (s_src[1:] != s_src[:-1]) | (s_tok[1:] != s_tok[:-1])
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, n))
    smax = max(1, int(counts.max()) if n else 1)
    needs = np.maximum.reduceat(order >= own_rows, starts) if n else np.zeros(0, bool)
    g_src, g_tok = s_src[starts], s_tok[starts]
    by = np.lexsort((g_tok, needs, g_src))      # per source: own-only tokens, then the others
    place = np.empty(len(starts), np.int64)
    place[by] = np.arange(len(starts))
    group = np.cumsum(first) - 1
    idx = np.full((len(starts), smax), zero, np.int64)
    idx[place[group], np.arange(n) - starts[group]] = order
    bounds = np.searchsorted(g_src[by], np.arange(A + 1))
    own = np.bincount(g_src[~needs], minlength=A)[:A].astype(np.int64)
    return g_tok[by].astype(np.int64), idx, bounds, own, smax


def _landing_rows(plan: _DomainPlan, g: int, members: list, land_off: np.ndarray) -> dict:
    """DMA path: for each member ``e`` of group ``g``, the landing row of each of ``e``'s group-buffer rows (its
    region is source-major; a source's block in the landing buffer holds its runs in send order)."""
    out = {e: [] for e in members}
    for a in range(plan.A):
        runs = plan.runs[a][g]
        if runs:
            s_first = runs[0][2]
            for e, toks, s0, _ in runs:
                out[e].append(land_off[a] + (s0 - s_first) + np.arange(len(toks)))
    return {e: np.concatenate(v) if v else np.zeros(0, np.int64) for e, v in out.items()}


def _fit(bytes_per_row: int, budget: int, most: int) -> int:
    return int(max(1, min(most, MAX_TILE_ROWS, budget // max(bytes_per_row, 1))))


def reduce_tiling(h: int, s: int, ub_bytes: int) -> tuple[int, int]:
    """(rows R, columns hc) of a gather-reduce tile: 2 x R*S x hc bf16 in (MTE2 -> V: double-buffered), R*S x hc
    fp32 (V only: the vector pipe runs in order, a second buffer would not overlap anything), weights, 2 x R x hc
    bf16 out (V -> MTE3). Whole rows (hc = h) where they fit: one write per partial, not one per column chunk."""
    budget = ub_bytes - UB_SPARE
    for c in range(1, h // 16 + 1):
        if h % c or (h // c) % 16:
            continue
        hc = h // c
        per_row = 2 * s * hc * 2 + s * hc * 4 + 2 * hc * 2 + s * 4 + 64
        if per_row <= budget:
            return _fit(per_row, budget, MAX_TILE_ROWS), hc
    raise CapacityError(f"hidden={h} with {s} rows per token: no column chunk (a divisor of hidden, multiple of 16) "
                        f"fits the {ub_bytes}-byte UB")


# ============================================================================================== kernels
def _join(ctx, ctl, target):
    """Die-local join: every core counts its visible writes; core 0 returns once all have."""
    yield ctx.atomic_add(ctl[0:1], 1, after="all")
    if ctx.block_idx == 0:
        yield ctx.wait_gm(ctl[0:1], "ge", target)


def _record(rnd, count):
    f = np.zeros(8, np.int32)
    f[FLAG], f[COUNT] = rnd, count
    return f


def _bulk(ctx, job, src, dst, rows_per_tile, ub, use_dma, share):
    """Copy contiguous rows src -> dst: mtu tiles dealt over the cores, or one DMA descriptor per share."""
    n = src.shape[0]
    if use_dma:
        if share:
            yield ctx.dma_copy(dst, src)
        return
    for j, r0 in enumerate(range(ctx.block_idx * rows_per_tile, n, rows_per_tile * ctx.block_num)):
        m = min(rows_per_tile, n - r0)
        t = ub[j % 2, :m]
        yield ctx.copy_gm_to_ub(t, src[r0:r0 + m])
        yield ctx.copy_ub_to_gm(dst[r0:r0 + m], t)


def _gather_reduce(ctx, src, wsrc, idx, dst, tiles, R, hc, bufs, stop=None):
    """dst[i] = bf16(sum_s w[idx[i, s]] * src[idx[i, s]]) (fp32) for the row tiles starting at ``tiles`` (up to R
    rows each, none at or past ``stop``, default the end of ``idx``)."""
    h = src.shape[1]
    s = idx.shape[1]
    stop = idx.shape[0] if stop is None else stop
    cols = [(c0, src[:, c0:c0 + hc]) for c0 in range(0, h, hc)]
    tile_views = {}         # rows in the tile -> its UB views (the same for every full tile: made once)
    j = 0
    for r0 in tiles:
        n = min(R, stop - r0)
        views = tile_views.get(n)
        if views is None:
            views = tile_views[n] = _tile_views(bufs, n, s, hc)
        wt, w3, xts, ft, f3, adds, f0, outs = views
        rows = idx[r0:r0 + n].reshape(-1)
        yield ctx.gather_gm_to_ub(wt, wsrc, rows)
        for c0, col in cols:
            b = j % 2
            j += 1
            yield ctx.gather_gm_to_ub(xts[b], col, rows)
            yield ctx.vec.cast(ft, xts[b])
            yield ctx.vec.mul(f3, f3, w3)
            for lo, hi in adds:                            # tree add over the slots
                yield ctx.vec.add(lo, lo, hi)
            yield ctx.vec.cast(outs[b], f0)
            yield ctx.copy_ub_to_gm(dst[r0:r0 + n, c0:c0 + hc], outs[b])


def _tile_views(bufs, n: int, s: int, hc: int) -> tuple:
    """The UB views of a ``_gather_reduce`` tile of ``n`` rows x ``s`` slots x ``hc`` columns: the weights (flat
    and [n, s, 1]), the two row buffers, the fp32 accumulator (flat and [n, s, hc]), the tree add's (first half,
    the half it adds) pairs, slot 0 and the two output buffers."""
    xin, f, w, ob = bufs
    wt = w[:n * s]
    ft = f[:n * s]
    f3 = ft.reshape(n, s, hc)
    adds = []
    k = s
    while k > 1:
        half = k // 2
        adds.append((f3[:, :half], f3[:, k - half:k]))
        k -= half
    return (wt, wt.reshape(n, s, 1), [xin[b, :n * s] for b in range(2)], ft, f3, adds, f3[:, 0],
            [ob[b, :n] for b in range(2)])


def write_pad_row(t):
    """``t`` ``[..., rows + 1, C]`` with its last row (in each leading index) written with zeros: the row that pads
    gathers, initialised as an aclrtMemset would (a read of it is no uninitialised read). Returns ``t``."""
    if not t.phantom:
        t[(slice(None),) * (t.ndim - 2) + (t.shape[-2] - 1,)].write(0)
    return t


def _reduce_bufs(ctx, R, S, hc):
    return (ctx.ub.alloc((2, R * S, hc), "bf16", name="rows"), ctx.ub.alloc((R * S, hc), "fp32", name="acc"),
            ctx.ub.alloc((R * S, 1), "fp32", name="w"), ctx.ub.alloc((2, R, hc), "bf16", name="out"))


# ------------------------------------------------------------------------------------- work per die (ascend_emu.work)
# Trip counts of the role loops above times the instructions per trip, for splitting a pod over workers; the ratio
# between roles is what matters (at paper scale an attention die, a trampoline and a partner run about 4100, 4600
# and 700 engine events per A2E + E2A). A flag wait or a join costs a few events (issue, poll, wake): _POLL.
_POLL = 3


def _tiles(n: int, rows: int) -> int:
    return -(-int(n) // rows)


def _reduce_instructions(job, tiles: int, h: int, hc: int, s: int) -> int:
    """``_gather_reduce`` over ``tiles`` row tiles: a weight gather, then per column chunk a gather, two casts, a
    multiply, the tree of adds and a write."""
    return tiles * (1 + (h // hc) * (5 + max(int(s) - 1, 0).bit_length()))


def _a2e_work(die: int, cores: int, job) -> float:
    r, plan = job.roles[die], job.plan
    if r["kind"] == "attn":
        a, R = r["a"], job.send_rows
        tiles = sum(_tiles(plan.n_fwd[a, g], R) + _tiles(plan.n_ag[a, g] - plan.n_fwd[a, g], R)
                    for g in range(len(job.groups)))
        return 4 * tiles + len(job.groups) + int(np.count_nonzero(plan.n_fwd[a]))
    members = job.groups[r["g"]]
    if not r["tramp"]:
        return _POLL * cores                                # one poll per core
    chunks = min(plan.A, cores)
    forwards = sum(_tiles(plan.rows_e[p], job.fwd_rows) + chunks for p in members[1:])
    return _POLL * (chunks * (1 + (len(members) > 1)) + cores) + 2 * forwards


def _e2a_work(die: int, cores: int, job) -> float:
    r, plan = job.roles[die], job.plan
    if r["kind"] == "attn":
        R, hc = job.fin_tiling
        tiles = _tiles(plan.B, R)
        return _POLL * 2 * cores + 1 + _reduce_instructions(job, tiles, job.hidden, hc, plan.fin_idx[r["a"]].shape[1])
    g = r["g"]
    if not r["tramp"]:
        return 2 * _tiles(plan.region[g][r["e"]][1], job.fwd_rows) + _POLL * cores + 1
    R, hc = job.red_tiling[g]
    tiles = sum(_tiles(plan.n_own[g, a], R) + _tiles(len(plan.red[g][a][0]) - plan.n_own[g, a], R)
                for a in range(plan.A))
    return _reduce_instructions(job, tiles, job.hidden, hc, plan.S[g]) + plan.A + _POLL * cores


@kernel(cores="aiv", work=_a2e_work)
def a2e_kernel(ctx, job):
    role = job.roles[ctx.die]
    if role["kind"] == "attn":
        yield from _a2e_attention(ctx, job, role)
    else:
        yield from _a2e_expert(ctx, job, role)


def _a2e_attention(ctx, job, r):
    a, x, dma = r["a"], r["x"], job.path == "dma"
    R = job.send_rows
    xt = ctx.ub.alloc((2, R, job.hidden), "bf16", name="x")
    wt = ctx.ub.alloc((2, -(-R // 8) * 8), "fp32", name="w")
    j = 0
    for g in r["order"][ctx.block_idx::ctx.block_num]:
        gb, gw = job.gbuf[g], job.gw[g]
        runs = job.plan.runs[a][g]
        n_fwd = int(job.plan.n_fwd[a, g])
        if dma and runs:
            # pack the group's rows (send order) contiguously and move them with one descriptor; the few bytes of
            # weights go straight from UB (mtu): a second descriptor would cost a second start-up. A group of
            # several dies lands in the trampoline's landing buffer (source-major: one block per source), a single
            # die's group straight in its buffer (its rows from a source are one run)
            toks = np.concatenate([t for _, t, _, _ in runs])
            n, s0 = len(toks), runs[0][2]
            if job.land[g] is None:
                dst, dstw = gb[runs[0][3]:runs[0][3] + n], gw[runs[0][3]:runs[0][3] + n, 0]
            else:
                lo = int(job.land_off[g][a])
                dst, dstw = job.land[g][lo:lo + n], job.landw[g][lo:lo + n, 0]
            for i in range(0, n, R):
                m = min(R, n - i)
                b = j % 2
                j += 1
                yield ctx.gather_gm_to_ub(xt[b, :m], x, toks[i:i + m])
                yield ctx.copy_ub_to_gm(r["pack"][s0 + i:s0 + i + m], xt[b, :m])
                yield ctx.copy_gm_to_ub(wt[b, :m], r["wsend"][s0 + i:s0 + i + m, 0], pad=True)
                yield ctx.copy_ub_to_gm(dstw[i:i + m], wt[b, :m], pad=True)
            yield ctx.dma_copy(dst, r["pack"][s0:s0 + n])
        elif runs:
            # the group's rows in send order (partners' runs, then the trampoline's: owner, token, k) as whole
            # tiles: one write per tile to the group, scattered over the owners' regions where a tile spans two
            # owners; tiles break where the partners' rows end, and a half-record says those have landed
            toks = np.concatenate([t for _, t, _, _ in runs])
            dst = np.concatenate([np.arange(d0, d0 + len(t)) for _, t, _, d0 in runs])
            s0 = runs[0][2]
            cuts = [(0, n_fwd), (n_fwd, len(toks))] if n_fwd else [(0, len(toks))]
            for lo, hi in cuts:
                for i in range(lo, hi, R):
                    m = min(R, hi - i)
                    b = j % 2
                    j += 1
                    rows, w_t = dst[i:i + m], wt[b, :m]
                    yield ctx.gather_gm_to_ub(xt[b, :m], x, toks[i:i + m])
                    yield ctx.copy_gm_to_ub(w_t, r["wsend"][s0 + i:s0 + i + m, 0], pad=True)
                    if rows[-1] - rows[0] == m - 1:
                        yield ctx.copy_ub_to_gm(gb[rows[0]:rows[0] + m], xt[b, :m])
                        yield ctx.copy_ub_to_gm(gw[rows[0]:rows[0] + m, 0], w_t, pad=True)
                    else:
                        yield ctx.scatter_ub_to_gm(gb, xt[b, :m], rows)
                        yield ctx.scatter_ub_to_gm(gw, w_t.reshape(m, 1), rows)
                if hi == n_fwd:
                    yield ctx.gm_store(job.s1[g][a, FWD_FLAG:FWD_COUNT + 1], np.array([job.round, n_fwd], np.int32),
                                       after="MTE3")
        yield ctx.gm_store(job.s1[g][a, FLAG:COUNT + 1], np.array([job.round, job.plan.n_ag[a, g]], np.int32),
                           after=("DMA", "MTE3") if dma else "MTE3")


def _chunks(job, g, n):
    """Cut-through units of trampoline ``g``: ``n`` contiguous ranges of attention ranks, in the order their
    stage-1 data completes (source ``a`` starts its round at trampoline ``a * T // A``, so ``g`` hears from the
    ranks just below ``g * A / T`` first). Planned once per die: every core of it takes its share of the list."""
    key = (g, n)
    out = job.chunks.get(key)
    if out is None:
        out = job.chunks[key] = _plan_chunks(job, g, n)
    return out


def _plan_chunks(job, g, n):
    A, T = job.plan.A, len(job.groups)
    cuts = [(i * A // n, (i + 1) * A // n) for i in range(n)]

    def last(c):                      # position of the range's last source in the sources' rotated orders
        return max((g - a * T // A) % T for a in range(*c))
    return sorted((c for c in cuts if c[1] > c[0]), key=lambda c: (last(c), c[0]))


def _a2e_expert(ctx, job, r):
    """Stage 2. Trampoline: each core polls the stage-1 records of its own ranges of sources (the fan-in split over
    the cores) and forwards those sources' rows to the partners as soon as they have landed (cut-through), then a
    die-local join and one record per partner. Partner: polls its one forward record."""
    e, g = r["e"], r["g"]
    if not r["tramp"]:
        yield ctx.wait_gm(job.s2[e][FLAG:FLAG + 1], "eq", job.round)
        return
    A, dma = job.plan.A, job.path == "dma"
    st = job.s1_die[e]
    partners = job.groups[g][1:]
    off = job.plan.src_off[g]
    if dma and partners:
        yield from _unpack_landing(ctx, job, g, st, r["join"])
        return
    ub = ctx.ub.alloc((2, job.fwd_rows, job.hidden), "bf16", name="fwd") if partners else None
    j = 0
    for a0, a1 in _chunks(job, g, min(A, ctx.block_num))[ctx.block_idx::ctx.block_num]:
        if partners:                       # the partners' rows of these sources have landed (count may be 0)
            fwd = np.where(job.plan.n_fwd[a0:a1, g] > 0, job.round, INT32_MIN)
            yield ctx.wait_gm(st[a0:a1, FWD_FLAG], "ge", fwd.astype(np.int32))
        for p in partners:
            lo, hi = int(off[p][a0]), int(off[p][a1])
            if hi == lo:
                continue
            r0 = job.plan.region[g][p][0]
            src, dst = job.gbuf[g][lo:hi], job.inp[p][lo - r0:hi - r0]
            for i in range(0, hi - lo, job.fwd_rows):
                m = min(job.fwd_rows, hi - lo - i)
                t = ub[j % 2, :m]
                j += 1
                yield ctx.copy_gm_to_ub(t, src[i:i + m])
                yield ctx.copy_ub_to_gm(dst[i:i + m], t)
        seen = yield ctx.wait_gm(st[a0:a1, FLAG:FWD_COUNT + 1], "ge",
                                 np.array([job.round, INT32_MIN, INT32_MIN, INT32_MIN], np.int32))
        seen = np.asarray(seen, np.int64).reshape(a1 - a0, 4)
        want = np.stack([job.plan.n_ag[a0:a1, g], job.plan.n_fwd[a0:a1, g]], 1)
        ok = (seen[:, FLAG] == job.round) & (seen[:, COUNT] == want[:, 0])
        if partners:
            ok &= (want[:, 1] == 0) | ((seen[:, FWD_FLAG] == job.round) & (seen[:, FWD_COUNT] == want[:, 1]))
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise XcclError(f"a2e: trampoline die {ctx.die} got record {seen[bad].tolist()} (round, rows, forward "
                            f"round, forward rows) from attention rank {a0 + bad}; the plan says {job.round}, "
                            f"{want[bad].tolist()}")
    if partners:
        yield from _join(ctx, job.ctl[ctx.die], r["join"])
        if ctx.block_idx == 0:
            for p in partners:
                yield ctx.gm_store(job.s2[p], _record(job.round, int(job.plan.rows_e[p])))


def _unpack_landing(ctx, job, g, st, join):
    """Stage 2 of a DMA-path trampoline: the sources' blocks land source-major (one descriptor each); the AIVs move
    each landed range of sources to where its rows belong (partners' rows over the die-to-die link to their input
    buffers, the trampoline's own into its region of the group buffer, every weight into ``gw``), cut-through as
    the ranges complete. Then a die-local join and one record per partner."""
    A, members = job.plan.A, job.groups[g]
    off, region = job.plan.src_off[g], job.plan.region[g]
    R = job.fwd_rows
    xt = ctx.ub.alloc((2, R, job.hidden), "bf16", name="fwd")
    wt = ctx.ub.alloc((2, -(-R // 8) * 8, 1), "fp32", name="fwdw")     # each slot 32-byte aligned
    j = 0
    for a0, a1 in _chunks(job, g, min(A, ctx.block_num))[ctx.block_idx::ctx.block_num]:
        seen = yield ctx.wait_gm(st[a0:a1, FLAG:COUNT + 1], "ge", np.array([job.round, INT32_MIN], np.int32))
        seen = np.asarray(seen, np.int64).reshape(a1 - a0, 2)
        want = job.plan.n_ag[a0:a1, g]
        bad = np.flatnonzero((seen[:, 0] != job.round) | (seen[:, 1] != want))
        if len(bad):
            raise XcclError(f"a2e: trampoline die {ctx.die} got record {seen[bad[0]].tolist()} (round, rows) from "
                            f"attention rank {a0 + bad[0]}; the plan says {job.round}, {int(want[bad[0]])}")
        for e in members[1:] + members[:1]:                 # partners first: their inputs travel further
            r0 = region[e][0]
            lo, hi = int(off[e][a0]), int(off[e][a1])
            src_rows = job.land_idx[g][e][lo - r0:hi - r0]
            dst = job.gbuf[g][lo:hi] if e == members[0] else job.inp[e][lo - r0:hi - r0]
            for i in range(0, hi - lo, R):
                m = min(R, hi - lo - i)
                b = j % 2
                j += 1
                rows = src_rows[i:i + m]
                yield ctx.gather_gm_to_ub(xt[b, :m], job.land[g], rows)
                yield ctx.gather_gm_to_ub(wt[b, :m], job.landw[g], rows)
                yield ctx.copy_ub_to_gm(dst[i:i + m], xt[b, :m])
                yield ctx.copy_ub_to_gm(job.gw[g][lo + i:lo + i + m, 0], wt[b, :m, 0], pad=True)
    yield from _join(ctx, job.ctl[ctx.die], join)
    if ctx.block_idx == 0:
        for p in members[1:]:
            yield ctx.gm_store(job.s2[p], _record(job.round, int(job.plan.rows_e[p])))


@kernel(cores="aiv", work=_e2a_work)
def e2a_kernel(ctx, job):
    role = job.roles[ctx.die]
    if role["kind"] == "attn":
        yield from _e2a_attention(ctx, job, role)
    else:
        yield from _e2a_expert(ctx, job, role)


def _e2a_expert(ctx, job, r):
    e, g = r["e"], r["g"]
    members = job.groups[g]
    dma = job.path == "dma"
    if not r["tramp"]:
        slot = members.index(e) - 1
        r0, n = job.plan.region[g][e]
        ub = ctx.ub.alloc((2, job.fwd_rows, job.hidden), "bf16", name="fwd")
        if n:
            yield from _bulk(ctx, job, job.out[e], job.outg[g][r0:r0 + n], job.fwd_rows, ub, dma, ctx.block_idx == 0)
        yield from _join(ctx, job.ctl[ctx.die], r["join"])
        if ctx.block_idx == 0:
            yield ctx.gm_store(job.s3[g][slot], _record(job.round, n))
        if dma:     # this die's DMA engine moves its share of the trampoline's staged blocks to the attention dies
            share = [a for a in r["order"] if r["sender"][a] == e and len(job.plan.red[g][a][0])]
            for a in share[ctx.block_idx::ctx.block_num]:
                n, w0 = len(job.plan.red[g][a][0]), int(job.plan.win_off[a, g])
                yield ctx.wait_gm(job.s5[e][a, FLAG:FLAG + 1], "eq", job.round)
                yield ctx.dma_copy(job.win[a][w0:w0 + n], job.stage[g][a])
                yield ctx.gm_store(job.s4[job.attn_dies[a]][g], _record(job.round, n), after="DMA")
        return
    R, hc = job.red_tiling[g]
    S = job.plan.S[g]
    bufs = _reduce_bufs(ctx, R, S, hc)
    mover = "DMA" if dma else "MTE3"
    mine = r["order"][ctx.block_idx::ctx.block_num]
    # tokens whose rows are all the trampoline's own go first, while the partners' outputs are on their way
    for phase in (0, 1):
        if phase and len(members) > 1:
            yield ctx.wait_gm(job.s3[g][:len(members) - 1, FLAG], "eq", job.round)
        for a in mine:
            toks, idx = job.plan.red[g][a]
            n, own = len(toks), int(job.plan.n_own[g, a])
            w0 = int(job.plan.win_off[a, g])
            win = job.win[a]
            dst = job.stage[g][a] if dma else win[w0:w0 + n]
            tiles = range(0, own, R) if phase == 0 else range(own, n, R)
            if len(tiles):
                yield from _gather_reduce(ctx, job.outg[g], job.gw[g], idx, dst, tiles, R, hc, bufs,
                                          stop=own if phase == 0 else n)
            if phase == 1:
                if dma and n:
                    p = r["sender"][a]
                    if p != e:      # a partner's DMA engine sends this block
                        yield ctx.gm_store(job.s5[p][a], _record(job.round, n), after="MTE3")
                        continue
                    yield ctx.dma_copy(win[w0:w0 + n], job.stage[g][a])
                yield ctx.gm_store(job.s4[job.attn_dies[a]][g], _record(job.round, n), after=mover)


def _e2a_attention(ctx, job, r):
    a = r["a"]
    # fan-in: every trampoline's record. A scalar poll pays per field, so each core polls its share of the
    # records and a die barrier tells every core that all have landed (T / cores fields each, not T)
    T = job.s4[ctx.die].shape[0]
    lo, hi = ctx.block_idx * T // ctx.block_num, (ctx.block_idx + 1) * T // ctx.block_num
    if hi > lo:
        yield ctx.wait_gm(job.s4[ctx.die][lo:hi, FLAG], "eq", job.round)
    yield ctx.barrier("die")
    if ctx.block_idx == 0:
        seen = yield ctx.gm_load(job.s4[ctx.die][:, COUNT])
        want = np.diff(np.append(job.plan.win_off[a], job.plan.win_rows[a]))
        if not np.array_equal(np.asarray(seen, np.int64), want):
            raise XcclError(f"e2a: attention die {ctx.die} saw counts {np.asarray(seen).tolist()[:8]}..., "
                            f"the plan says {want.tolist()[:8]}...")
    R, hc = job.fin_tiling
    idx = job.plan.fin_idx[a]
    bufs = _reduce_bufs(ctx, R, idx.shape[1], hc)
    tiles = list(range(0, job.plan.B, R))[ctx.block_idx::ctx.block_num]
    yield from _gather_reduce(ctx, job.win[a], job.ones[a], idx, r["y"], tiles, R, hc, bufs)


# ============================================================================================== host API
@dataclass
class _Job:
    plan: _DomainPlan
    round: int
    path: str
    hidden: int
    groups: list
    attn_dies: list
    roles: dict
    s1: list = field(default_factory=list)         # [g] -> [A, 8] view on the trampoline
    s1_die: dict = field(default_factory=dict)
    s2: dict = field(default_factory=dict)
    s3: list = field(default_factory=list)
    s4: dict = field(default_factory=dict)
    s5: dict = field(default_factory=dict)
    ctl: dict = field(default_factory=dict)
    gbuf: list = field(default_factory=list)
    gw: list = field(default_factory=list)
    inp: dict = field(default_factory=dict)
    out: dict = field(default_factory=dict)
    outg: list = field(default_factory=list)
    stage: list = field(default_factory=list)
    land: list = field(default_factory=list)       # [g] DMA path, groups of several dies: landing [rows_g, H]
    landw: list = field(default_factory=list)      # [g] and its weights [rows_g, 1] fp32
    land_off: list = field(default_factory=list)   # [g] [A + 1] first landing row of each source's block
    land_idx: list = field(default_factory=list)   # [g] {e: landing row of each of e's group-buffer rows}
    win: list = field(default_factory=list)
    ones: list = field(default_factory=list)
    send_rows: int = 1
    fwd_rows: int = 1
    red_tiling: list = field(default_factory=list)
    fin_tiling: tuple = (1, 16)
    chunks: dict = field(default_factory=dict)      # (g, n) -> _chunks' list, shared by the die's cores


@dataclass
class A2EHandle:
    """One domain's A2E: the plan, the launch, and the GM buffers E2A and the experts use.

    ``expert_input(e)`` / ``expert_output(e)``: ``[rows_e, H]`` bf16 GM views on expert die index ``e`` (rows ordered
    by source attention die, then expert, token, k; ``row_ids(e)`` gives (attention rank, token, k) per row)."""
    group: "A2EGroup"
    domain: int
    job: _Job
    launch: object
    numeric: bool

    def expert_input(self, e: int):
        g = int(self.job.plan.group_of[e])
        if self.job.groups[g][0] == e:
            r0, n = self.job.plan.region[g][e]
            return self.job.gbuf[g][r0:r0 + n]
        return self.job.inp[e]

    def expert_output(self, e: int):
        return self.job.out[e]

    def row_ids(self, e: int) -> np.ndarray:
        g = int(self.job.plan.group_of[e])
        r0, n = self.job.plan.region[g][e]
        return self.job.plan.row_id[g][r0:r0 + n]


@dataclass
class E2AHandle:
    """One domain's E2A: ``out[a]`` the ``[B, H]`` bf16 GM output of attention rank ``a``; ``launch``."""
    a2e: A2EHandle
    out: list
    launch: object

    def result(self, a: int):
        return self.out[a].numpy()


class A2EGroup:
    """Attention domains and expert dies of a disaggregated MoE layer, with their status areas.

    ``domains``: list of lists of attention dies (one list per DP domain, equal sizes); ``expert_dies``: list;
    ``num_experts`` a multiple of the expert-die count (contiguous placement); ``trampoline``: two-stage forwarding
    through ``min(A, E)`` trampolines, else direct; ``path``: "mtu" or "dma" for the attention <-> trampoline hops
    and the partners' E2A bulk sends (the A2E forward to partners runs on the trampolines' AIVs); ``cores``: AIVs
    per die; ``phantom``: timing-only data buffers (control data stays real)."""

    def __init__(self, pod: Pod, domains, expert_dies, *, num_experts: int, hidden: int, trampoline: bool = True,
                 path: str = "mtu", cores: int = 48, phantom: bool = False, mode: str = "graph"):
        if path not in ("mtu", "dma"):
            raise ArgumentError(f"path={path!r}: use 'mtu' or 'dma'")
        domains = [pod.check_dies(dom, f"domains[{i}]") for i, dom in enumerate(domains)]
        expert_dies = pod.check_dies(expert_dies, "expert_dies")
        if not domains or len({len(d) for d in domains}) != 1 or not domains[0]:
            raise ArgumentError(f"domains: {len(domains)} DP domains of sizes {[len(d) for d in domains]}; need "
                                f"one or more non-empty domains of equal size")
        every = [d for dom in domains for d in dom] + expert_dies
        if len(set(every)) != len(every):
            raise ArgumentError("domains and expert_dies must be distinct dies")
        check_int(num_experts, "num_experts", 1)
        check_int(hidden, "hidden", 1)
        if num_experts < len(expert_dies) or num_experts % len(expert_dies):
            raise ArgumentError(f"num_experts={num_experts} must be a positive multiple of the "
                                f"{len(expert_dies)} expert dies")
        if hidden % 16 or hidden <= 0:
            raise ArgumentError(f"hidden={hidden}: must be a positive multiple of 16")
        check_int(cores, "cores", 1, pod.profile.aiv_per_die)
        self.pod, self.domains, self.expert_dies = pod, domains, expert_dies
        self.num_experts, self.hidden, self.trampoline = num_experts, hidden, trampoline
        self.path, self.cores, self.phantom, self.mode = path, cores, phantom, mode
        A, E = len(domains[0]), len(expert_dies)
        self.groups = plan_groups(A, E, trampoline, chips=[pod.profile.chip_of(d) for d in expert_dies])
        T, gmax = len(self.groups), max(len(g) for g in self.groups)
        self.s1_die = {e: pod.alloc(d, (A, 8), "int32", name=f"a2e.s1{d}") for e, d in enumerate(expert_dies)}
        self.s2 = {e: pod.alloc(d, (8,), "int32", name=f"a2e.s2{d}") for e, d in enumerate(expert_dies)}
        self.s3 = {e: pod.alloc(d, (max(gmax - 1, 1), 8), "int32", name=f"a2e.s3{d}")
                   for e, d in enumerate(expert_dies)}
        self.s4 = {d: pod.alloc(d, (T, 8), "int32", name=f"a2e.s4{d}") for dom in domains for d in dom}
        self.s5 = {e: pod.alloc(d, (A, 8), "int32", name=f"a2e.s5{d}") for e, d in enumerate(expert_dies)}
        self.ctl = {d: pod.alloc(d, (8,), "int32", name=f"a2e.ctl{d}") for d in every}
        self._joins = {d: 0 for d in every}
        self.round = 0
        self._streams: dict = {}
        self._last = None

    @property
    def num_trampolines(self) -> int:
        return len(self.groups)

    def _stream(self, dies):
        key = tuple(dies)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = self.pod.stream(dies=list(dies), aiv=self.cores, mode=self.mode)
        return s

    def _join_target(self, die):
        self._joins[die] += 1
        return self._joins[die] * self.cores

    def a2e(self, domain: int, x, topk_ids, topk_weights, *, numeric: bool = True, after=()) -> A2EHandle:
        """Queue domain ``domain``'s A2E. ``x``: per attention rank ``[B, H]`` bf16 (host arrays; None in
        timing-only runs); ``topk_ids`` ``[B, K]`` expert ids (-1 masked); ``topk_weights`` ``[B, K]`` fp32."""
        check_int(domain, "domain", 0, len(self.domains) - 1)
        pod, dies, E, H = self.pod, self.domains[domain], len(self.expert_dies), self.hidden
        if len(topk_ids) != len(dies) or len(topk_weights) != len(dies):
            raise ArgumentError(f"topk_ids/topk_weights: {len(topk_ids)}/{len(topk_weights)} entries for "
                                f"{len(dies)} attention dies")
        plan = plan_domain(topk_ids, topk_weights, self.num_experts, E, self.groups)
        self.round += 1
        ph = not numeric
        prof = pod.profile
        job = _Job(plan=plan, round=self.round, path=self.path, hidden=H, groups=self.groups, attn_dies=dies,
                   roles={})
        ub = prof.ub_bytes - UB_SPARE
        job.send_rows = _fit(2 * (H * 2 + 8), ub, plan.B * plan.K)
        job.fwd_rows = _fit(2 * H * 2, ub, MAX_TILE_ROWS)
        T = len(self.groups)
        for g, members in enumerate(self.groups):
            d = self.expert_dies[members[0]]
            job.gbuf.append(pod.alloc(d, (max(plan.rows_g[g], 1), H), "bf16", phantom=ph, name=f"a2e.gbuf{d}"))
            gw = pod.alloc(d, (plan.rows_g[g] + 1, 1), "fp32", phantom=ph, name=f"a2e.gw{d}")
            job.gw.append(write_pad_row(gw))
            job.outg.append(write_pad_row(pod.alloc(d, (plan.rows_g[g] + 1, H), "bf16", phantom=ph,
                                                     name=f"a2e.outg{d}")))
            job.s1.append(self.s1_die[members[0]])
            job.s3.append(self.s3[members[0]])
            job.red_tiling.append(reduce_tiling(H, plan.S[g], prof.ub_bytes))
            if self.path == "dma" and len(members) > 1:
                job.land.append(pod.alloc(d, (max(plan.rows_g[g], 1), H), "bf16", phantom=ph, name=f"a2e.land{d}"))
                job.landw.append(pod.alloc(d, (max(plan.rows_g[g], 1), 1), "fp32", phantom=ph,
                                           name=f"a2e.landw{d}"))
                lo = np.concatenate([[0], np.cumsum(plan.n_ag[:, g])])
                job.land_off.append(lo)
                job.land_idx.append(_landing_rows(plan, g, members, lo))
            else:
                job.land.append(None)
                job.landw.append(None)
                job.land_off.append(None)
                job.land_idx.append(None)
            if self.path == "dma":
                job.stage.append([pod.alloc(d, (max(len(plan.red[g][a][0]), 1), H), "bf16", phantom=ph,
                                            name=f"a2e.stage{d}") for a in range(plan.A)])
            for e in members:
                r0, n = plan.region[g][e]
                if e == members[0]:
                    job.out[e] = job.outg[g][r0:r0 + n]
                else:
                    job.inp[e] = pod.alloc(self.expert_dies[e], (max(n, 1), H), "bf16", phantom=ph,
                                           name=f"a2e.in{self.expert_dies[e]}")[0:n]
                    job.out[e] = pod.alloc(self.expert_dies[e], (max(n, 1), H), "bf16", phantom=ph,
                                           name=f"a2e.out{self.expert_dies[e]}")[0:n]
        job.s1_die, job.s2, job.s4, job.s5, job.ctl = self.s1_die, self.s2, self.s4, self.s5, self.ctl
        jmax = max(idx.shape[1] for idx in plan.fin_idx)
        job.fin_tiling = reduce_tiling(H, jmax, prof.ub_bytes)
        for a, d in enumerate(dies):
            xa = None if x is None else x[a]
            if numeric:
                if xa is None:
                    raise ArgumentError("x is required in numeric runs")
                if tuple(xa.shape) != (plan.B, H):
                    raise ArgumentError(f"x[{a}] has shape {tuple(xa.shape)}: expected [{plan.B}, {H}] (the "
                                        f"tokens of topk_ids[{a}], hidden)")
                xg = pod.to_gm(d, xa, dtype="bf16", name=f"a2e.x{d}")
                ws = pod.to_gm(d, plan.wsend[a].reshape(-1, 1) if plan.send_rows[a] else np.zeros((1, 1)),
                               dtype="fp32", name=f"a2e.wsend{d}")
            else:
                xg = pod.alloc(d, (plan.B, H), "bf16", phantom=True, name=f"a2e.x{d}")
                ws = pod.alloc(d, (max(plan.send_rows[a], 1), 1), "fp32", phantom=True, name=f"a2e.wsend{d}")
            win = pod.alloc(d, (plan.win_rows[a] + 1, H), "bf16", phantom=ph, name=f"a2e.win{d}")
            job.win.append(write_pad_row(win))
            ones = np.ones((plan.win_rows[a] + 1, 1), np.float32)
            ones[-1] = 0.0
            job.ones.append(pod.to_gm(d, ones, name=f"a2e.ones{d}") if numeric else
                            pod.alloc(d, ones.shape, "fp32", phantom=True, name=f"a2e.ones{d}"))
            role = {"kind": "attn", "a": a, "x": xg, "wsend": ws,
                    "order": [(g + a * T // plan.A) % T for g in range(T)]}
            if self.path == "dma":
                role["pack"] = pod.alloc(d, (max(plan.send_rows[a], 1), H), "bf16", phantom=ph, name=f"a2e.pack{d}")
            job.roles[d] = role
        for e, d in enumerate(self.expert_dies):
            g = int(plan.group_of[e])
            job.roles[d] = {"kind": "expert", "e": e, "g": g, "tramp": self.groups[g][0] == e}
        for g, members in enumerate(self.groups):
            if len(members) > 1:
                job.roles[self.expert_dies[members[0]]]["join"] = self._join_target(self.expert_dies[members[0]])
        st = self._stream(dies + self.expert_dies)
        la = st.launch(a2e_kernel, (job,), numeric=numeric, name=f"a2e.d{domain}", after=list(after))
        return A2EHandle(self, domain, job, la, numeric)

    def e2a(self, handle: A2EHandle, *, after=()) -> E2AHandle:
        """Queue the E2A of ``handle``'s domain: expert outputs (``handle.expert_output(e)``) back to the
        attention dies, weighted-summed; returns the output handle."""
        import copy
        job = copy.copy(handle.job)
        self.round += 1
        job.round = self.round
        pod, plan, dies = self.pod, job.plan, job.attn_dies
        T = len(self.groups)
        job.roles = {}
        outs = []
        for a, d in enumerate(dies):
            y = pod.alloc(d, (plan.B, self.hidden), "bf16", phantom=not handle.numeric, name=f"e2a.y{d}")
            outs.append(y)
            job.roles[d] = {"kind": "attn", "a": a, "y": y}
        orders, senders = [], []
        for g, members in enumerate(self.groups):
            orders.append([(i + g * plan.A // T) % plan.A for i in range(plan.A)])
            sender = np.empty(plan.A, np.int64)      # DMA path: the group's dies take turns sending the blocks
            sender[orders[g]] = [members[i % len(members)] for i in range(plan.A)]
            senders.append(sender)
        for e, d in enumerate(self.expert_dies):
            g = int(plan.group_of[e])
            role = {"kind": "expert", "e": e, "g": g, "tramp": self.groups[g][0] == e, "order": orders[g],
                    "sender": senders[g]}
            if not role["tramp"]:
                role["join"] = self._join_target(d)
            job.roles[d] = role
        st = self._stream(dies + self.expert_dies)
        la = st.launch(e2a_kernel, (job,), numeric=handle.numeric, name=f"e2a.d{handle.domain}",
                       after=list(after))
        return E2AHandle(handle, outs, la)


def reference(x, topk_ids, topk_weights):
    """Identity experts: out[t] = bf16(sum_k w[t, k] * x[t]) over unmasked k (fp64 sum)."""
    import ml_dtypes
    xs = np.asarray(x, dtype=np.float64)
    ids = np.asarray(topk_ids)
    w = np.where(ids >= 0, np.asarray(topk_weights, np.float64), 0.0)
    return (w.sum(1, keepdims=True) * xs).astype(np.float32).astype(ml_dtypes.bfloat16)


# Building blocks: the per-role steps of one A2E / E2A call, for pipelines that run them inside their own persistent
# kernels (serving.expert_pipeline). Each is a generator over one core's work for ``job`` (a ``Job``) and role.
Job = _Job
fit_rows = _fit
a2e_attention_step, a2e_expert_step = _a2e_attention, _a2e_expert
e2a_expert_step, e2a_attention_step = _e2a_expert, _e2a_attention
