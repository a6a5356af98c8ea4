"""FusedDispatch / FusedCombine: push-based, AIV-direct MoE token exchange (DESIGN.md 4, the CloudMatrix design).

Mirrors ``torch_npu.npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine``. One host drives every rank, so
inputs and outputs are per-rank lists. Each rank is one die; its kernel runs on the die's vector cores.

Dispatch, per rank (die) ``r``:
  1. each AIV takes tokens ``t = c, c + cores, ...``: load the row into UB (MTE2) | quantise it to INT8 into a
     UB record (VECTOR) | write the record straight into the window of every destination die (MTE3, remote) at the
     slot its routing gives (slot = offset of the expert within r's region + number of earlier (token, k) pairs of
     r for that expert), double-buffered so the three stages overlap across tokens;
  2. barrier (it fences each core's writes), then publish one 32-byte status record (flag = call number, count) per
     (source r, expert) on each destination die;
  3. poll the status records of every source, prefix-sum the counts and assemble the received rows into one
     contiguous buffer, expert-major then source rank then source order, with their scales and source identity.
Combine, per rank: send each expert output row (bf16) back to its source token's (t, k) slot on the source die and
atomically add 1 to that token's arrival counter (MTE3 atomic add, ordered after the row on the same pipe); then
wait until each local token's counter reaches its number of routed experts, weight-sum in fp32 (+ shared expert
output), cast to bf16.

Record layout (int8 window row, ``record_bytes`` = round-up(H * itemsize + 64, 512), e.g. 7.5 KiB at H = 7168):
``[0, H*isz)`` the row (int8, or bf16 without quantisation) | a 64-byte tail of int32 words: 0 scale (fp32 bits),
8 source rank, 9 source token, 10 k slot, others reserved (two 32-byte blocks, so each part copies out aligned). Windows
alternate halves between calls (double buffering), and dispatch and combine have separate windows, so a rank running
ahead cannot overwrite data a slower rank still reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.errors import ArgumentError, HazardError, ShapeError
from ascend_emu.memory import aliasable

from .ranks import Pending, check_finite, integer_array

FLAG, COUNT = 0, 1
T_SCALE, T_RANK, T_TOKEN, T_K = 0, 8, 9, 10     # int32 words of the 64-byte record tail
TAIL_BYTES = 64


class MoeGroup:
    """The EP communication group of fused dispatch/combine (``group_ep``): dies, windows and the call counter.

    ``max_bs`` tokens per rank, ``hidden`` H, ``topk`` K, ``num_experts`` experts placed ``num_experts / (ranks -
    shared_expert_rank_num)`` per rank, contiguous over the routed-expert ranks (expert e on rank
    ``shared_expert_rank_num + e // experts_per_rank``; redundant replicas are experts like any other: the caller
    maps logical to physical ids, e.g. with ``eplb``). ``shared_expert_rank_num`` S (torch_npu's
    ``shared_expert_rank_num``, ``expert_shard_type`` 0): ranks 0 .. S-1 each host a copy of the one shared expert,
    and every token of rank r also goes to shared rank ``r % S`` (CANN's ``epRankId % rankNumPerSharedExpert``) as
    one more record (k slot K); combine brings the shared output back in that slot with weight 1, so a rank then
    receives ``ranks / S`` ranks' tokens and ``shared_expert_x`` is not passed. S = 0: no shared-expert ranks.
    ``phantom``: windows without data (timing-only runs; status records and counters stay real).
    ``double_buffer=False`` makes dispatch and combine share one window half (to show the race it prevents);
    ``mode``: launch overhead of the per-die streams ("single-op" or "graph"; None: the pod's ``launch_mode``).
    ``streams``: {die: stream} to queue each rank's dispatch/combine on (e.g. a serving pipeline's MoE stream);
    default: one stream per die on ``cores`` AIVs."""

    def __init__(self, pod: Pod, dies, *, max_bs: int, hidden: int, topk: int, num_experts: int,
                 quant: bool = True, cores: int | None = None, phantom: bool = False,
                 double_buffer: bool = True, mode: str | None = None, streams: dict | None = None,
                 shared_expert_rank_num: int = 0):
        self.pod = pod
        self.dies = pod.check_dies(dies)        # distinct dies of this pod: one EP rank each
        n = len(self.dies)
        s = shared_expert_rank_num
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < n or (s and n % s):
            raise ArgumentError(f"shared_expert_rank_num={s!r} must be 0, or below the {n} ranks and divide them")
        if num_experts % (n - s):
            raise ArgumentError(f"num_experts={num_experts} must be a multiple of the {n} ranks" if not s else
                                f"num_experts={num_experts} must be a multiple of the {n - s} routed-expert ranks "
                                f"({n} ranks - shared_expert_rank_num={s})")
        if not 0 < topk <= min(8, num_experts):
            raise ArgumentError(f"topk={topk} out of range 1..{min(8, num_experts)}")
        if hidden % 32 or hidden <= 0:
            raise ShapeError(f"hidden={hidden} must be a positive multiple of 32")
        self.max_bs, self.hidden, self.topk, self.num_experts = max_bs, hidden, topk, num_experts
        self.shared_ranks = int(s)
        self.epr = num_experts // (n - s)                 # local experts per routed-expert rank
        self.slots = topk + (1 if s else 0)               # records per token: K routed (+ the shared expert)
        self.quant = quant
        self.cores = cores or pod.profile.aiv_per_die
        self.phantom = phantom
        self.double_buffer = double_buffer
        row_bytes = hidden * (1 if quant else 2)
        self.row_bytes = row_bytes
        self.record_bytes = -(-(row_bytes + TAIL_BYTES) // 512) * 512
        self.max_tokens = max_bs * min(topk, self.epr)    # rows one source can send to one rank
        self.recv_rows = n * self.max_tokens              # A: rows one rank can receive
        halves = 2
        self.dispatch_win = {d: pod.alloc(d, (halves, n, self.max_tokens, self.record_bytes), "int8",
                                          phantom=phantom, name=f"moe.dispatch_win{d}") for d in self.dies}
        self.status = {d: pod.alloc(d, (halves, n, self.epr, 8), "int32", name=f"moe.status{d}")
                       for d in self.dies}
        if double_buffer:
            self.combine_win = {d: pod.alloc(d, (halves, max_bs, self.slots, hidden), "bf16", phantom=phantom,
                                             name=f"moe.combine_win{d}") for d in self.dies}
        else:   # one window for both: combine rows land where dispatch records wait to be assembled
            need = halves * max_bs * self.slots * hidden
            have = self.dispatch_win[self.dies[0]].nbytes // 2
            if have < need:
                raise ArgumentError(f"double_buffer=False needs the dispatch window ({have} bf16) to hold the "
                                    f"combine window ({need} bf16)")
            self.combine_win = {d: self.dispatch_win[d].view_as("bf16").reshape(-1)[:need].reshape(
                halves, max_bs, self.slots, hidden) for d in self.dies}
        self.counters = {d: pod.alloc(d, (halves, max_bs), "int32", name=f"moe.arrivals{d}") for d in self.dies}
        self.calls = 0
        self._deals: dict = {}        # die -> the last combine's row dealing over its cores (_deal_rows)
        if streams is not None and set(streams) != set(self.dies):
            raise ArgumentError(f"streams: one per die of the group {self.dies}, got dies {sorted(streams)}")
        self._streams = dict(streams) if streams is not None else \
            {d: pod.stream(d, aiv=self.cores, mode=mode) for d in self.dies}

    @property
    def size(self) -> int:
        return len(self.dies)

    def window_bytes(self) -> int:
        """Bytes of the dispatch window on one die: 2 halves x ranks x max_tokens x record_bytes."""
        return 2 * self.size * self.max_tokens * self.record_bytes


# ------------------------------------------------------------------------------------------------ host plans
@dataclass
class _DispatchPlan:
    rank: int
    tokens: int
    dest: np.ndarray          # [T, slots] destination rank or -1
    slot: np.ndarray          # [T, slots] slot in the destination window's region of this rank
    counts: np.ndarray        # [ranks, epr] pairs this rank sends per (destination, local expert)
    ids: np.ndarray           # [T, slots] the routing (expert ids, -1 masked; num_experts: the shared expert)
    local: np.ndarray         # [T, slots] local expert index at the destination


def _plan_dispatch(group: MoeGroup, rank: int, ids: np.ndarray) -> _DispatchPlan:
    """Where each (token, k) pair of ``rank`` goes: expert-major slots within the destination's region; with
    shared-expert ranks each token has one more pair, (token, K) -> shared rank ``rank % S``, local expert 0."""
    s = _shared_ranks(group)
    if s:
        ids = np.concatenate([ids, np.full((ids.shape[0], 1), group.num_experts, ids.dtype)], axis=1)
    t_n, k_n = ids.shape
    valid = ids >= 0
    dest = np.where(valid, s + ids // group.epr, -1)
    local = np.where(valid, ids % group.epr, 0)
    if s:
        dest[:, -1], local[:, -1] = rank % s, 0
    key = (dest * group.epr + local)[valid].astype(np.int64)   # = destination * epr + local expert
    counts = np.bincount(key, minlength=group.size * group.epr).astype(np.int64)
    # (token, k) order defines the slot order within an expert: a stable sort by expert keeps it; a pair's slot is
    # the start of its expert within the destination's region plus its place among the expert's pairs
    order = np.argsort(key, kind="stable")
    starts = np.cumsum(counts) - counts                       # start of each expert among all the pairs
    region = starts.reshape(group.size, group.epr)[:, :1]     # start of each destination's region
    place = np.empty(len(key), np.int64)
    place[order] = np.arange(len(key)) - starts[key[order]]
    slot = np.full((t_n, k_n), -1, np.int64)
    slot[valid] = (starts - np.repeat(region.reshape(-1), group.epr))[key] + place
    return _DispatchPlan(rank, t_n, dest, slot, counts.reshape(group.size, group.epr), ids, local)


def _shared_ranks(group) -> int:
    """The group's shared-expert ranks (a bare (size, epr) stand-in for a group has none)."""
    return getattr(group, "shared_ranks", 0)


def _peers(group, rank: int) -> np.ndarray:
    """The ranks that can send rows to ``rank``: the ranks ``r`` with ``r % S == rank`` on a shared-expert rank
    (S = shared_expert_rank_num), every rank otherwise."""
    s = _shared_ranks(group)
    return np.arange(rank, group.size, s) if rank < s else np.arange(group.size)


def _received_identities(plans, ranks: int, epr: int) -> list:
    """Per destination rank d: (source rank, token, k) of the rows d receives, expert-major, then source, then slot
    order ([rows_d, 3] int32); one sort over every pair of every source (not one pass over the sources per d)."""
    src, t, k, dest, le, slot = [], [], [], [], [], []
    for i, p in enumerate(plans):
        tt, kk = np.nonzero((p.dest >= 0) & (p.slot >= 0))
        src.append(np.full(len(tt), i))
        t.append(tt)
        k.append(kk)
        dest.append(p.dest[tt, kk])
        le.append(p.local[tt, kk])
        slot.append(p.slot[tt, kk])
    empty = np.zeros(0, np.int64)
    src, t, k, dest, le, slot = (np.concatenate(a) if a else empty for a in (src, t, k, dest, le, slot))
    order = np.lexsort((slot, src, le, dest))     # destination, then local expert, then source, then slot
    rank_of = np.array([p.rank for p in plans], np.int64)
    rows = np.stack([rank_of[src] if len(src) else empty, t, k], axis=1)[order].astype(np.int32)
    cut = np.searchsorted(dest[order], np.arange(ranks + 1))
    return [rows[cut[d]:cut[d + 1]].reshape(-1, 3) for d in range(ranks)]


def _received_identity(plans, d: int, epr: int) -> np.ndarray:
    """(source rank, token, k) of the rows rank ``d`` receives, expert-major, then source, then slot order."""
    return _received_identities(plans, max(d + 1, len(plans)), epr)[d]


# ------------------------------------------------------------------------------------------------ kernels
@kernel(cores="aiv", comm=True)
def fused_dispatch_kernel(ctx, g: MoeGroup, plan: _DispatchPlan, x_gm, out, half: int, call: int):
    """One rank's dispatch: send (quantised) records, publish status, assemble what arrived."""
    h, rec_b, rank = g.hidden, g.record_bytes, plan.rank
    row_b = g.row_bytes
    rec = ctx.ub.alloc((2, row_b + TAIL_BYTES), "int8", name="record")    # double-buffered send records
    tail = [rec[b, row_b:row_b + TAIL_BYTES].view_as("int32") for b in range(2)]
    x_t = ctx.ub.alloc((2, h), x_gm.dtype, name="x") if g.quant else None
    # 1. load | quantise | remote write, token by token (stages overlap across the two buffers)
    for j, t in enumerate(range(ctx.block_idx, plan.tokens, ctx.block_num)):
        b = j % 2
        if g.quant:
            yield ctx.copy_gm_to_ub(x_t[b], x_gm[t])
            yield ctx.vec.quant_int8(rec[b, :h], tail[b][T_SCALE:T_SCALE + 1].view_as("fp32"), x_t[b])
        else:
            yield ctx.copy_gm_to_ub(rec[b, :row_b].view_as("bf16"), x_gm[t])
        yield ctx.set_value(tail[b], T_TOKEN, t)
        yield ctx.set_value(tail[b], T_RANK, rank)
        for k, (d, slot) in enumerate(zip(plan.dest[t].tolist(), plan.slot[t].tolist())):
            if d < 0:                                                    # masked top-k entry
                continue
            yield ctx.set_value(tail[b], T_K, k)
            win = g.dispatch_win[g.dies[d]]
            yield ctx.copy_ub_to_gm(win[half, rank, slot, :row_b + TAIL_BYTES], rec[b])
    # 2. all sends of this die visible (the barrier orders each core's writes), then one status record per
    # (source = me, expert) on every destination
    yield ctx.barrier()
    for d in range(ctx.block_idx, g.size, ctx.block_num):
        rec_d = np.zeros((g.epr, 8), np.int32)
        rec_d[:, FLAG] = call
        rec_d[:, COUNT] = plan.counts[d]
        yield ctx.gm_store(g.status[g.dies[d]][half, rank], rec_d)
    # 3. wait for every source's status, prefix-sum, assemble expert-major / source-minor
    st = g.status[ctx.die][half]
    yield ctx.wait_gm(st[:, :, FLAG], "eq", call)
    seen = yield ctx.gm_load(st[:, :, COUNT])
    counts = np.asarray(seen, np.int64).T                            # [epr, ranks]
    yield ctx.scalar(2 * counts.size)                                # prefix sums on the scalar unit
    ends = np.cumsum(counts.reshape(-1))
    if ctx.block_idx == 0:
        yield ctx.gm_store(out.expert_token_nums_gm, out.token_nums(counts))
        yield ctx.gm_store(out.ep_recv_counts_gm, ends.astype(np.int32))
    win = g.dispatch_win[ctx.die][half]
    rows_per_tile = max(1, min(64, (ctx.profile.ub_bytes // 2 - 1024) // (2 * rec_b)))
    stage = ctx.ub.alloc((2, rows_per_tile, rec_b), "int8", name="assemble")
    for j, (s, r_src, r_dst, n) in enumerate(_assemble_jobs(out, seen, rows_per_tile)[ctx.block_idx::ctx.block_num]):
        tb = stage[j % 2, :n]
        yield ctx.copy_gm_to_ub(tb, win[s, r_src:r_src + n])
        yield ctx.copy_ub_to_gm(out.expand_x_bytes_gm[r_dst:r_dst + n], tb[:, :row_b], pad=True)
        if g.quant:
            yield ctx.copy_ub_to_gm(out.scales_bytes_gm[r_dst:r_dst + n], tb[:, row_b:row_b + 4], pad=True)
        yield ctx.copy_ub_to_gm(out.assist_bytes_gm[r_dst:r_dst + n], tb[:, row_b + 32:row_b + 44], pad=True)


def _assemble_jobs(out, seen, rows_per_tile: int) -> list:
    """The die's copy jobs (source rank, row in its region, row in the output, rows) from the counts ``seen``
    [ranks, epr], expert-major then source rank, in tiles of ``rows_per_tile``. Every core of the die reads the
    same counts and deals itself every ``block_num``-th job: the list is built once per die and call (kept on
    ``out`` under the counts it came from) instead of once per core; each core still pays its prefix sums."""
    seen = np.asarray(seen, np.int64)
    key = (seen.tobytes(), seen.shape, rows_per_tile)
    jobs = out.jobs.get(key)
    if jobs is None:
        counts = seen.T.reshape(-1)                                  # expert-major: [epr x ranks]
        starts = (np.cumsum(counts) - counts).tolist()
        src_offs = (np.cumsum(seen, axis=1) - seen).T.reshape(-1).tolist()   # an expert's start in s's region
        ranks = seen.shape[0]
        jobs = []
        for idx, n in enumerate(counts.tolist()):
            s = idx % ranks
            for r0 in range(0, n, rows_per_tile):
                jobs.append((s, src_offs[idx] + r0, starts[idx] + r0, min(rows_per_tile, n - r0)))
        out.jobs[key] = jobs
    return jobs


def _deal_rows(g: MoeGroup, die: int, ids: np.ndarray, rank: int, cores: int) -> list:
    """Which received rows each of the die's ``cores`` returns (fused_combine_kernel's dealing), as one list of row
    indices per core in sending order. Every core of the die loads the same ``ids`` [rows, 3]: the plan is built
    once per die and call (kept on the group under the rows it came from), not by each core over all rows."""
    ids = np.asarray(ids)
    key = (ids.tobytes(), ids.shape, rank, cores)
    kept = g._deals.get(die)
    if kept is not None and kept[0] == key:
        return kept[1]
    rows, n = len(ids), g.size
    if n > 1:
        src = ids[:, 0].astype(np.int64)
        # cores own the die's peers (the ranks that can send to it) by their position among them: every rank, or
        # on a shared-expert die the n / S ranks it serves (by rank they would all fall on one core)
        peers = _peers(g, rank)
        m = len(peers)
        s = np.searchsorted(peers, src % n)
        per = cores // m if m < cores else 1          # cores that share one destination rank
        if per == 1:
            owner = s % cores
        else:                                         # the j-th row for rank s goes to its (j % per)-th core
            order = np.argsort(s, kind="stable")
            first = np.searchsorted(s[order], s[order])
            seq = np.empty(rows, np.int64)
            seq[order] = np.arange(rows) - first
            owner = s + m * (seq % per)
        # each core sends to the ranks after this one first (an all-to-all rotation), in row order per rank
        order = np.lexsort((np.arange(rows), (src - rank) % n, owner))
        cut = np.searchsorted(owner[order], np.arange(cores + 1))
        deal = [order[cut[c]:cut[c + 1]].tolist() for c in range(cores)]
    else:
        deal = [list(range(c, rows, cores)) for c in range(cores)]
    g._deals[die] = (key, deal)
    return deal


@kernel(cores="aiv", comm=True)
def fused_combine_kernel(ctx, g: MoeGroup, rank: int, rows: int, assist_gm, expert_out_gm, weights,
                         expected, shared_gm, out_gm, half: int):
    """One rank's combine: return expert outputs to their source tokens, then weight-sum its own tokens."""
    h = g.hidden
    one = ctx.ub.alloc((8,), "int32", phantom=False, name="one")
    yield ctx.vec.duplicate(one, 1)
    row = ctx.ub.alloc((2, h), "bf16", name="row")
    # 1. expert side: every received row goes back to (source rank, token, k); then bump the token's counter.
    # Cores own destination ranks (their position among the die's peers, modulo cores; _deal_rows): a core's
    # in-order MTE3 then never waits on one congested peer
    # while it holds rows for idle ones (head-of-line blocking). With fewer ranks than cores, each rank's rows are
    # dealt over cores // ranks cores: a core keeps only so many bytes in flight to another die, so one core per
    # destination would leave the ports idle. Each rank walks its destinations starting after itself (an
    # all-to-all rotation), so the ranks do not all converge on the same receiver at once (incast)
    ids = (yield ctx.gm_load(assist_gm[0:rows])) if rows else np.zeros((0, 3), np.int32)
    mine = _deal_rows(g, ctx.die, ids, rank, ctx.block_num)[ctx.block_idx] if rows else []
    for j, i in enumerate(mine):
        s, t, k = ids[i].tolist()
        if not (0 <= s < g.size and 0 <= t < g.max_bs and 0 <= k < g.slots):
            raise HazardError(f"combine rank {rank}: received row {i} names source rank {s}, token {t}, k {k} "
                              f"(limits {g.size} ranks, {g.max_bs} tokens, {g.slots} slots): its window record was "
                              f"overwritten before it was read (a rank ran ahead into a window still in use)")
        b = j % 2
        src_die = g.dies[s]
        yield ctx.copy_gm_to_ub(row[b], expert_out_gm[i])
        yield ctx.copy_ub_to_gm(g.combine_win[src_die][half, t, k], row[b])
        yield ctx.copy_ub_to_gm(g.counters[src_die][half, t:t + 1], one[0:1], atomic="add", pad=True)
    # 2. source side: wait for each token's contributions, then sum_k w_k * y_k (+ shared) in fp32
    acc = ctx.ub.alloc((h,), "fp32", name="acc")
    tmp = ctx.ub.alloc((h,), "fp32", name="tmp")
    yk = ctx.ub.alloc((2, h), "bf16", name="yk")
    outb = ctx.ub.alloc((h,), "bf16", name="out")
    tokens = range(ctx.block_idx, len(expected), ctx.block_num)
    zero = ctx.ub.alloc((8,), "int32", phantom=False, name="zero")
    yield ctx.vec.duplicate(zero, 0)
    n = 0
    for t in tokens:
        yield ctx.wait_gm(g.counters[ctx.die][half, t:t + 1], "ge", int(expected[t]))
        if shared_gm is not None:
            yield ctx.copy_gm_to_ub(yk[n % 2], shared_gm[t])
            yield ctx.vec.cast(acc, yk[n % 2])
            n += 1
        else:
            yield ctx.vec.duplicate(acc, 0.0)
        for k in range(g.slots):
            w = weights[t, k]
            if w is None:
                continue
            yield ctx.copy_gm_to_ub(yk[n % 2], g.combine_win[ctx.die][half, t, k])
            yield ctx.vec.cast(tmp, yk[n % 2])
            yield ctx.vec.muls(tmp, tmp, float(w))
            yield ctx.vec.add(acc, acc, tmp)
            n += 1
        yield ctx.vec.cast(outb, acc)
        yield ctx.copy_ub_to_gm(out_gm[t], outb)
        # the counter is free again for the call after next (the halves alternate)
        yield ctx.copy_ub_to_gm(g.counters[ctx.die][half, t:t + 1], zero[0:1], pad=True)


# ------------------------------------------------------------------------------------------------ host API
class _DispatchOut:
    """GM outputs of one rank's dispatch (plus host copies of its counts)."""

    def __init__(self, pod: Pod, die: int, g: MoeGroup, phantom: bool, token_nums_type: int):
        a = g.recv_rows
        self.expand_x_gm = pod.alloc(die, (a, g.hidden), "int8" if g.quant else "bf16", phantom=phantom,
                                     name=f"expand_x{die}")
        self.expand_x_bytes_gm = self.expand_x_gm.view_as("int8")
        self.scales_gm = pod.alloc(die, (a,), "fp32", phantom=phantom, name=f"dynamic_scales{die}")
        self.scales_bytes_gm = self.scales_gm.view_as("int8").reshape(a, 4)
        self.assist_gm = pod.alloc(die, (a, 3), "int32", name=f"assist_info{die}")
        self.assist_bytes_gm = self.assist_gm.view_as("int8").reshape(a, 12)
        self.expert_token_nums_gm = pod.alloc(die, (g.epr,), "int64", name=f"expert_token_nums{die}")
        self.ep_recv_counts_gm = pod.alloc(die, (g.epr * g.size,), "int32", name=f"ep_recv_counts{die}")
        self.token_nums_type = token_nums_type
        self.quant = g.quant
        self.rows = 0                 # rows this rank receives (from the host plan)
        self.jobs: dict = {}          # the die's assemble jobs by the counts they came from (_assemble_jobs)

    def token_nums(self, counts):
        per_expert = counts.sum(axis=1)
        return (np.cumsum(per_expert) if self.token_nums_type == 0 else per_expert).astype(np.int64)


@dataclass
class DispatchResult:
    """Per-rank outputs of ``moe_distribute_dispatch`` (torch_npu names), the combine handle and the run.

    ``expand_x[r]`` [rows_r, H] int8 (bf16 without quantisation), ``dynamic_scales[r]`` [rows_r] fp32,
    ``assist_info_for_combine[r]`` [rows_r, 3] int32 (source rank, source token, k) per received row,
    ``expand_idx[r]`` [BS, K] int32 slot of each of rank r's (token, k) pairs at its destination (-1 masked),
    ``expert_token_nums[r]`` [local experts] int64 (counts, or cumulative with expert_token_nums_type=0),
    ``ep_recv_counts[r]`` [local experts x ranks] int32 prefix sums, expert-major then source rank."""
    expand_x: list
    dynamic_scales: list
    assist_info_for_combine: list
    expand_idx: list
    expert_token_nums: list
    ep_recv_counts: list
    run: object
    handle: dict


def launch_dispatch(x, expert_ids, group_ep: MoeGroup, *, expert_token_nums_type: int = 1,
                    numeric: bool = True, after: dict | None = None, streams: dict | None = None,
                    alias: bool = False) -> dict:
    """Queue one dispatch on every rank's stream without running the pod; returns the pending handle that
    ``launch_combine`` and ``collect_dispatch`` take (its "launches": {die: Launch}). ``after``: {die: launches}
    each rank's launch waits for; ``streams``: {die: Stream} to queue on instead of the group's. ``alias``: host
    rows ``x[r]`` enter GM without a copy where they can (``_input_gm``); the caller then must not change them
    before the run. ``moe_distribute_dispatch`` is launch + run + collect (aliasing, as nothing runs between)."""
    g = group_ep
    if expert_token_nums_type not in (0, 1):
        raise ArgumentError(f"expert_token_nums_type={expert_token_nums_type}: 0 cumulative, 1 counts")
    if len(expert_ids) != g.size or (numeric and len(x) != g.size):
        raise ShapeError(f"expected per-rank inputs for {g.size} ranks")
    pod = g.pod
    plans = []
    for r, die in enumerate(g.dies):
        ids = integer_array(expert_ids[r], f"expert_ids[{r}]")
        if ids.ndim != 2 or ids.shape[1] != g.topk or ids.shape[0] > g.max_bs:
            raise ShapeError(f"expert_ids[{r}] shape {ids.shape}: need [<= {g.max_bs}, {g.topk}]")
        if ids.size and (ids.max() >= g.num_experts or ids.min() < -1):
            raise ArgumentError(f"expert_ids[{r}] has ids outside -1..{g.num_experts - 1}")
        plans.append(_plan_dispatch(g, r, ids))
    half = g.calls % 2 if g.double_buffer else 0
    g.calls += 1
    call = g.calls
    outs, launches = [], {}
    after = after or {}
    if numeric and g.quant:
        for r in range(g.size):
            if not hasattr(x[r], "store"):
                check_finite(x[r], f"x[{r}]", "INT8 dispatch needs finite rows (max|x| would be inf or NaN)")
    received = np.sum([p.counts for p in plans], axis=0).sum(axis=1) if plans else []   # rows per rank
    idents = None if numeric else _received_identities(plans, g.size, g.epr)
    for r, die in enumerate(g.dies):
        plan = plans[r]
        if numeric:
            xr = x[r]
            x_gm = _input_gm(pod, die, xr, alias)
        else:
            x_gm = pod.alloc(die, (plan.tokens, g.hidden), "bf16", phantom=True)
        out = _DispatchOut(pod, die, g, not numeric, expert_token_nums_type)
        out.rows = int(received[r])                               # what rank r will receive (host plan)
        launches[die] = (streams or g._streams)[die].launch(
            fused_dispatch_kernel, (g, plan, x_gm, out, half, call), numeric=numeric, name=f"dispatch r{r}",
            after=list(after.get(die, ())))
        outs.append(out)
        if not numeric:
            # modeled as: the identity words of a phantom record carry no bytes, so the host fills in the values
            # those words would have held (the kernel's assembly order); combine reads them as control data
            ident = idents[r]
            if len(ident):
                out.assist_gm[0:len(ident)].write(ident)
    return {"half": half, "plans": plans, "outs": outs, "numeric": numeric, "launches": launches}


def _input_gm(pod: Pod, die: int, t, alias: bool):
    """A host input (bf16 rows) in ``die``'s GM: the GM tensor itself, the host tensor's own bytes when ``alias``
    and ``pod.to_gm(copy=False)`` can take them (bf16, contiguous, writeable), else a copy. The kernels only read it."""
    if hasattr(t, "store"):
        return t
    return pod.to_gm(die, t, dtype="bf16", copy=not (alias and aliasable(t, "bf16")))


def collect_dispatch(pending: dict, run) -> DispatchResult:
    """Per-rank outputs of a dispatch whose run has finished."""
    numeric = pending["numeric"]
    res = DispatchResult([], [], [], [], [], [], run, pending)
    for out, plan in zip(pending["outs"], pending["plans"]):
        n = out.rows
        res.expand_x.append(out.expand_x_gm[0:n].numpy() if numeric else None)
        res.dynamic_scales.append(out.scales_gm[0:n].numpy() if numeric and out.quant else None)
        res.assist_info_for_combine.append(out.assist_gm[0:n].numpy())
        res.expand_idx.append(plan.slot.astype(np.int32))
        res.expert_token_nums.append(out.expert_token_nums_gm.numpy())
        res.ep_recv_counts.append(out.ep_recv_counts_gm.numpy())
    return res


def moe_distribute_dispatch(x, expert_ids, group_ep: MoeGroup, *, quant_mode: int | None = None,
                            expert_token_nums_type: int = 1, numeric: bool = True, stream=None, after=()):
    """Dispatch each rank's tokens ``x[r]`` [BS, H] bf16 to the experts ``expert_ids[r]`` [BS, K] (-1 = masked).

    ``quant_mode``: 2 dynamic INT8 (per-token scale), 0 none; default follows the group. Returns DispatchResult.
    ``stream`` (one ``Stream`` per rank, on the group's dies in order) / ``after`` (launches every rank waits for,
    or {die: launches}): queue instead of running and return a ``kernels.ranks.Pending`` whose ``collect`` gives
    the DispatchResult (its ``handle`` is what ``moe_distribute_combine`` takes)."""
    if quant_mode is not None and (quant_mode == 2) != group_ep.quant:
        raise ArgumentError(f"quant_mode={quant_mode} but the group was built with quant={group_ep.quant}")
    streams, waits = _queue_args(group_ep, stream, after)
    pending = launch_dispatch(x, expert_ids, group_ep, expert_token_nums_type=expert_token_nums_type,
                              numeric=numeric, after=waits, streams=streams, alias=stream is None)
    if stream is not None:
        return Pending(list(pending["launches"].values()), lambda run: collect_dispatch(pending, run))
    return collect_dispatch(pending, group_ep.pod.synchronize())


def _queue_args(g: MoeGroup, stream, after) -> tuple:
    """({die: Stream} or None, {die: launches}) from a host function's ``stream`` / ``after``."""
    streams = None
    if stream is not None:
        streams = list(stream) if isinstance(stream, (list, tuple)) else [stream]
        if len(streams) != g.size or any(getattr(st, "pod", None) is not g.pod or st.dies != [d]
                                         for st, d in zip(streams, g.dies)):
            raise ArgumentError(f"stream: one Stream per rank of the group, on its dies {g.dies} in order")
        streams = dict(zip(g.dies, streams))
    waits = dict(after) if isinstance(after, dict) else {d: list(after) for d in g.dies}
    return streams, waits


def launch_combine(expand_x, pending: dict, expert_scales, group_ep: MoeGroup, *, shared_expert_x=None,
                   numeric: bool = True, after: dict | None = None, streams: dict | None = None,
                   alias: bool = False) -> list:
    """Queue one combine (after the dispatch ``pending`` on each rank's stream, and after ``after``: {die:
    launches}); returns the output GM tensors. ``pending["combine_launches"]`` gets {die: Launch}. ``streams``:
    {die: Stream} to queue on instead of the group's. ``alias``: as ``launch_dispatch``'s, for ``expand_x`` and
    ``shared_expert_x``."""
    g = group_ep
    pod = g.pod
    half = pending["half"]
    outs_gm = []
    if g.shared_ranks and shared_expert_x is not None:
        raise ArgumentError(f"shared_expert_x: the group has shared_expert_rank_num={g.shared_ranks}; the shared "
                            f"expert's output comes back through the combine (its k slot {g.topk})")
    for r, die in enumerate(g.dies):
        plan = pending["plans"][r]
        dout = pending["outs"][r]
        rows = dout.rows
        if numeric:
            y = expand_x[r]
            y_gm = _input_gm(pod, die, y, alias)
        else:
            y_gm = pod.alloc(die, (max(rows, 1), g.hidden), "bf16", phantom=True)
        w = np.asarray(expert_scales[r], dtype=np.float32)
        if g.shared_ranks:                                 # the shared expert's slot: weight 1
            w = np.concatenate([w.reshape(plan.tokens, g.topk), np.ones((plan.tokens, 1), np.float32)], axis=1)
        weights = np.empty(plan.dest.shape, dtype=object)
        for t in range(plan.dest.shape[0]):
            for k in range(plan.dest.shape[1]):
                weights[t, k] = None if plan.dest[t, k] < 0 else float(w[t, k])
        expected = (plan.dest >= 0).sum(axis=1)
        shared = None
        if shared_expert_x is not None:
            sx = shared_expert_x[r]
            shared = _input_gm(pod, die, sx, alias)
        out_gm = pod.alloc(die, (plan.tokens, g.hidden), "bf16", phantom=not numeric, name=f"combine_out{die}")
        pending.setdefault("combine_launches", {})[die] = (streams or g._streams)[die].launch(
            fused_combine_kernel, (g, r, rows, dout.assist_gm, y_gm, weights, expected, shared, out_gm, half),
            numeric=numeric, name=f"combine r{r}", after=list((after or {}).get(die, ())))
        outs_gm.append(out_gm)
    return outs_gm


def moe_distribute_combine(expand_x, handle: DispatchResult, expert_scales, group_ep: MoeGroup, *,
                           shared_expert_x=None, numeric: bool = True, stream=None, after=()):
    """Return expert outputs ``expand_x[r]`` [rows_r, H] bf16 (in dispatch's received-row order) to their source
    tokens and weight them: out[r][t] = sum_k expert_scales[r][t, k] * y + shared_expert_x[r][t] (fp32 math,
    bf16 result). Returns (list of [BS, H] bf16 arrays (None in timing-only runs), RunResult). ``stream`` /
    ``after``: queue instead (as ``moe_distribute_dispatch``); the ``Pending``'s ``collect`` gives that pair."""
    streams, waits = _queue_args(group_ep, stream, after)
    outs_gm = launch_combine(expand_x, handle.handle, expert_scales, group_ep, shared_expert_x=shared_expert_x,
                             numeric=numeric, after=waits, streams=streams, alias=stream is None)

    def finish(run):
        return [o.numpy() if numeric else None for o in outs_gm], run
    if stream is not None:
        return Pending(list(handle.handle["combine_launches"].values()), finish)
    return finish(group_ep.pod.synchronize())


# ------------------------------------------------------------------------------------------------ references
def dispatch_reference(x, expert_ids, num_experts: int, ranks: int, quant: bool = True):
    """torch/numpy reference: per destination rank, rows expert-major then source rank then (token, k) order.

    Returns per rank: (rows [n, H] fp32 (dequantised when quant), source identity [n, 3], expert counts)."""
    import torch
    epr = num_experts // ranks
    out = []
    for d in range(ranks):
        rows, ident, counts = [], [], np.zeros(epr, np.int64)
        for le in range(epr):
            e = d * epr + le
            for s in range(ranks):
                ids = np.asarray(expert_ids[s])
                xs = torch.as_tensor(np.asarray(x[s], dtype=np.float32))
                for t, k in zip(*np.nonzero(ids == e)):
                    rows.append(xs[t])
                    ident.append((s, t, k))
                    counts[le] += 1
        out.append((torch.stack(rows).numpy() if rows else np.zeros((0, np.asarray(x[0]).shape[1]), np.float32),
                    np.array(ident, np.int32).reshape(-1, 3), counts))
    return out


def combine_reference(x, expert_ids, weights, expert_fn=lambda e, rows: rows, shared=None):
    """sum_k w_k * expert_fn(e_k, x) (+ shared) in fp32 per token; masked (-1) entries skipped."""
    res = []
    for r in range(len(x)):
        xr = np.asarray(x[r], dtype=np.float32)
        ids = np.asarray(expert_ids[r])
        w = np.asarray(weights[r], dtype=np.float32)
        acc = np.zeros_like(xr) if shared is None else np.asarray(shared[r], dtype=np.float32).copy()
        for t in range(xr.shape[0]):
            for k in range(ids.shape[1]):
                if ids[t, k] >= 0:
                    acc[t] += w[t, k] * expert_fn(ids[t, k], xr[t])
        res.append(acc)
    return res
