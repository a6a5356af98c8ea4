"""Pull-based MoE dispatch and combine over a communicator (DESIGN.md 4, "dispatch / combine, pull-based").

One host drives every rank, so inputs are per-rank: a list (or a tensor with a leading rank dim) of ``[T, ...]``.

**Routing.** ``expert_placement[e]`` is the rank that owns routed expert id ``e`` (default: contiguous blocks of
``num_experts / ranks``). A rank's local experts are its ids in ascending order. Redundant experts plug in here: map
each token's logical expert to a physical replica first (DESIGN.md 7, a ``tokens x logical`` table), pass the
physical ids as ``topk_ids``, the physical slot count as ``num_experts`` and a placement over the physical slots.

**One row per (token, k) pair.** A token that picks two experts on one rank is sent to that rank twice, one row per
expert, as CANN's ``npu_moe_distribute_dispatch`` does and as the CloudMatrix window sizing assumes
(``max_tokens = batch x min(topK, experts_per_die)``). It costs fabric bytes when experts collide on a rank (about
1.5x at EP 8 with 256 experts, top-8; nothing at large EP) and buys a receiver that only copies contiguous blocks: the
sender's partition for a destination is already in the destination's expert-major order. (DeepEP's normal dispatch
sends once per rank with the expert list instead.) ``-1`` entries of ``topk_ids`` are skipped: no row, no count.

**Dispatch protocol** (one multi-die launch, ``cores`` AIVs per rank):

1. each core loads tiles of its tokens GM -> UB (mtu-in), optionally quantises them to INT8 on the vector unit, and
   writes one message per (token, k) pair into the rank's **local** dispatch window, partitioned by destination rank
   (mtu-out, one row each);
2. each core then adds 1 to the rank's send counter with ``after="all"`` (its writes are visible first); the core
   that publishes to destination ``d`` (core ``d % cores``) waits for the counter to reach ``cores`` and writes the
   32-byte field ``moe_meta[d][me]`` = (event id, offset of the partition in rows, row count, flag = round): one
   posted 32-byte store, so the field lands whole, after the data;
3. every core polls the flags of all ``ranks`` fields of its own die (bounded ``wait_gm``), reads the fields, checks
   event ids and counts, then PULLS its share of segments from the peers' windows (mtu-in from the peer die) and
   writes them to the output (mtu-out): rows grouped expert-major, then source rank, then source token (then k).

Wire format: ``quant=True``: int8 ``[H]`` + a 32-byte block holding the row's fp32 scale (bytes 0-3), one message of
``H + 32`` bytes, so the scale travels with its row; ``quant=False``: bf16 ``[H]``.

**Combine** is the mirror: each rank copies its expert-output rows into its local combine window partitioned by source
rank (the same segment order), publishes (event id, offset, count, flag) to every source rank, and each source rank
polls, pulls the ``K`` rows of each of its tokens from the owning ranks, and accumulates ``sum_k w_k * y_k`` in fp32
on the vector unit (masked slots contribute 0), then casts to bf16 (RNE) or writes fp32 (``out_dtype="fp32"``).

Control state beyond comm.py's documented layout: per die one int32 ``[8]`` field ``xccl.moe_ctl{die}`` (word 0: the
send counter of the current op, reset by the host before each launch), and the dispatch / combine windows
``xccl.moe_dispatch{die}`` / ``xccl.moe_combine{die}`` (uint8, grown on demand) in the managed area.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from ascend_emu import RunResult, kernel
from ascend_emu.arguments import check_int

from .comm import (FIELD_WORDS, M_COUNT, M_EVENT, M_FLAG, M_OFFSET, ArgumentError, Communicator, XcclError,
                   check_event_id, integer_ids)

SCALE_BLOCK = 32          # bytes after an int8 row: the fp32 scale in bytes 0-3, then padding (32-byte aligned)
UB_BYTES_SPARE = 4096     # UB kept free of the big tiles (small control tiles)


# ============================================================================================== routing plan (host)
@dataclass
class RoutingPlan:
    """Where every (token, k) pair goes, computed on the host from ``topk_ids`` and the placement.

    Per source rank ``s``: ``dest[s]``, ``send_row[s]``, ``rel[s]`` are ``[T_s, K]`` int64 (-1 where masked):
    destination rank, row in ``s``'s dispatch window, row within the partition ``s -> dest``. ``counts[s, d]`` rows
    of ``s`` for ``d``; ``offsets[s, d]`` first row of that partition in ``s``'s window. Per destination rank ``d``:
    ``segments[d]`` = list of (src rank, first row within the partition, first output row, rows), one per
    (local expert, source rank) in output order; ``src_rank/src_token/src_k[d]`` ``[N_d]`` identify every output
    row; ``expert_counts[d]`` ``[E_d]`` rows per local expert.
    """

    ranks: int
    num_experts: int
    topk: int
    placement: np.ndarray
    local_experts: list
    tokens: list
    dest: list
    send_row: list
    rel: list
    counts: np.ndarray
    offsets: np.ndarray
    segments: list
    recv_rows: list
    expert_counts: list
    src_rank: list
    src_token: list
    src_k: list

    @property
    def combine_offsets(self) -> np.ndarray:
        """``[d, s]``: first row of the combine partition for source ``s`` in expert rank ``d``'s window."""
        c = self.counts.T                      # [d, s] rows d holds for s
        return np.cumsum(c, axis=1) - c


def default_placement(num_experts: int, ranks: int) -> np.ndarray:
    """Contiguous blocks: expert ``e`` lives on rank ``e // (num_experts / ranks)``."""
    if num_experts < 1 or num_experts % ranks:
        raise ArgumentError(f"num_experts={num_experts} must be a positive multiple of the {ranks} ranks for the "
                            f"default contiguous placement (or pass expert_placement)")
    return np.arange(num_experts, dtype=np.int64) // (num_experts // ranks)


def plan_routing(topk_ids, num_experts: int, ranks: int, expert_placement=None) -> RoutingPlan:
    """Build the ``RoutingPlan`` for per-rank ``topk_ids`` ``[T, K]`` (int, -1 = masked)."""
    check_int(num_experts, "num_experts", 1)
    if expert_placement is None:
        owner = default_placement(num_experts, ranks)
    else:
        owner = integer_ids(expert_placement, "expert_placement").reshape(-1)
        if owner.shape != (num_experts,):
            raise ArgumentError(f"expert_placement has {owner.size} entries: expected one per expert "
                                f"({num_experts})")
        if owner.size and (owner.min() < 0 or owner.max() >= ranks):
            bad = int(owner.max() if owner.max() >= ranks else owner.min())
            raise ArgumentError(f"expert_placement names rank {bad}: ranks are 0..{ranks - 1}")
    ids = _per_rank(topk_ids, ranks, "topk_ids")
    ids = [integer_ids(a, f"topk_ids[{r}]") for r, a in enumerate(ids)]
    k = None
    for r, a in enumerate(ids):
        if a.ndim != 2:
            raise ArgumentError(f"topk_ids[{r}] has shape {a.shape}: expected [tokens, topk]")
        if k is None:
            k = a.shape[1]
        elif a.shape[1] != k:
            raise ArgumentError(f"topk_ids[{r}] has topk {a.shape[1]}, rank 0 has {k}: every rank routes top-{k}")
        if a.size and (a.min() < -1 or a.max() >= num_experts):
            bad = int(a.min() if a.min() < -1 else a.max())
            raise ArgumentError(f"topk_ids[{r}] holds expert {bad}: allowed -1 (masked) and 0..{num_experts - 1}")
    local_experts = [np.flatnonzero(owner == r) for r in range(ranks)]
    local_idx = np.zeros(num_experts, dtype=np.int64)
    for r in range(ranks):
        local_idx[local_experts[r]] = np.arange(len(local_experts[r]))

    counts = np.zeros((ranks, ranks), dtype=np.int64)
    ecounts = np.zeros((ranks, num_experts), dtype=np.int64)
    dest, send_row, rel, pairs_sorted = [], [], [], []
    for s, a in enumerate(ids):
        t_idx, k_idx = np.nonzero(a >= 0)
        e = a[t_idx, k_idx]
        d = owner[e]
        # partition order: destination, then its local expert, then token, then k (= the receiver's output order)
        order = np.lexsort((k_idx, t_idx, local_idx[e], d))
        pos = np.empty(len(order), dtype=np.int64)
        pos[order] = np.arange(len(order))
        counts[s] = np.bincount(d, minlength=ranks)
        ecounts[s] = np.bincount(e, minlength=num_experts)
        off = np.cumsum(counts[s]) - counts[s]
        dd = np.full(a.shape, -1, dtype=np.int64)
        sr = np.full(a.shape, -1, dtype=np.int64)
        rl = np.full(a.shape, -1, dtype=np.int64)
        dd[t_idx, k_idx] = d
        sr[t_idx, k_idx] = pos
        rl[t_idx, k_idx] = pos - off[d]
        dest.append(dd)
        send_row.append(sr)
        rel.append(rl)
        pairs_sorted.append((t_idx[order], k_idx[order]))
    offsets = np.cumsum(counts, axis=1) - counts

    segments, recv_rows, expert_counts, src_rank, src_token, src_k = [], [], [], [], [], []
    for d in range(ranks):
        segs, sr_, st_, sk_ = [], [], [], []
        q = 0
        within = np.zeros(ranks, dtype=np.int64)          # next row within partition s -> d, per source
        for e in local_experts[d]:
            for s in range(ranks):
                n = int(ecounts[s, e])
                if n == 0:
                    continue
                r0 = int(within[s])
                segs.append((s, r0, q, n))
                a0 = int(offsets[s, d]) + r0
                ts, ks = pairs_sorted[s]
                st_.append(ts[a0:a0 + n])
                sk_.append(ks[a0:a0 + n])
                sr_.append(np.full(n, s, dtype=np.int64))
                within[s] += n
                q += n
        segments.append(segs)
        recv_rows.append(q)
        expert_counts.append(ecounts[:, local_experts[d]].sum(axis=0))
        cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
        src_rank.append(cat(sr_))
        src_token.append(cat(st_))
        src_k.append(cat(sk_))
    return RoutingPlan(ranks, num_experts, k, owner, local_experts, [a.shape[0] for a in ids], dest, send_row, rel,
                       counts, offsets, segments, recv_rows, expert_counts, src_rank, src_token, src_k)


# ============================================================================================== per-communicator state
class _MoeState:
    """Rounds (the flag value of each op), control fields and grown-on-demand windows of one communicator."""

    def __init__(self, comm: Communicator):
        self.round = 0
        self.ctl = {d: comm.pod.alloc(d, (FIELD_WORDS,), "int32", name=f"xccl.moe_ctl{d}") for d in comm.dies}
        self.windows: dict = {}

    def window(self, comm: Communicator, kind: str, die: int, nbytes: int, phantom: bool):
        key = (kind, die, phantom)
        w = self.windows.get(key)
        if w is None or w.nbytes < nbytes:
            w = self.windows[key] = comm.pod.alloc(die, (max(nbytes, 512),), "uint8", phantom=phantom,
                                                   name=f"xccl.moe_{kind}{die}")
        return w


_STATES: "weakref.WeakKeyDictionary[Communicator, _MoeState]" = weakref.WeakKeyDictionary()


def _state(comm: Communicator) -> _MoeState:
    st = _STATES.get(comm)
    if st is None:
        st = _STATES[comm] = _MoeState(comm)
    return st


def _typed(window, rows: int, width: int, dtype):
    """A ``[rows, width]`` view of ``dtype`` at the start of a uint8 window."""
    itemsize = np.dtype(dtype).itemsize if not isinstance(dtype, str) else {"int8": 1, "bf16": 2, "fp32": 4}[dtype]
    return window[0:max(rows, 1) * width * itemsize].view_as(dtype).reshape(max(rows, 1), width)


# ============================================================================================== results
@dataclass
class DispatchHandle:
    """What combine needs from a dispatch: the routing plan (host) and the hidden size."""

    plan: RoutingPlan
    hidden: int

    @property
    def src_rank(self) -> list:
        """Per rank ``[N]``: source rank of each received row."""
        return self.plan.src_rank

    @property
    def src_token(self) -> list:
        """Per rank ``[N]``: token index (in its source rank) of each received row."""
        return self.plan.src_token

    @property
    def src_k(self) -> list:
        """Per rank ``[N]``: top-k slot of each received row."""
        return self.plan.src_k


@dataclass
class DispatchResult:
    """Per rank: ``x`` ``[N, H]`` (int8 when quantised, else bf16; None in timing-only runs), ``scales`` ``[N]``
    fp32 (quantised only), ``expert_counts`` ``[E_local]`` and ``rank_counts`` ``[ranks]`` (int64; rank counts are
    what the metadata handshake delivered), the GM tensors ``x_gm``/``scales_gm`` for kernels that follow, the
    ``handle`` for combine and the ``run``."""

    x: list
    scales: list | None
    expert_counts: list
    rank_counts: list
    x_gm: list
    scales_gm: list | None
    handle: DispatchHandle
    run: RunResult


@dataclass
class CombineResult:
    """Per rank ``out`` ``[T, H]`` (bf16 or fp32; None in timing-only runs), ``out_gm``, and the ``run``."""

    out: list
    out_gm: list
    run: RunResult


# ============================================================================================== kernels
def _publish_and_poll(ctx, job, me: int):
    """Steps 2-3 of both ops: count this die's cores done, publish one field per peer, poll all fields.

    Returns the ``[ranks, 8]`` fields seen (after the event id and count checks)."""
    nc = ctx.block_num
    ctl = job.ctl[me]
    yield ctx.atomic_add(ctl[0:1], 1, after="all")          # my window writes are visible before I count
    mine = list(range(ctx.block_idx, job.ranks, nc))        # the peers this core publishes to
    if mine:
        yield ctx.wait_gm(ctl[0:1], "ge", nc)               # every core of this die has written its rows
        for d in mine:
            fld = np.zeros(FIELD_WORDS, dtype=np.int32)
            fld[M_EVENT], fld[M_OFFSET], fld[M_COUNT], fld[M_FLAG] = (job.event_id, job.pub_offset[me][d],
                                                                      job.pub_count[me][d], job.round)
            yield ctx.gm_store(job.meta[d][me], fld)         # one 32-byte posted store: the field lands whole
    meta = job.meta[me]
    yield ctx.wait_gm(meta[:, M_FLAG], "eq", job.round)      # metadata from every rank has arrived
    seen = yield ctx.gm_load(meta)
    for s in range(job.ranks):
        if seen[s, M_EVENT] != job.event_id:
            raise XcclError(f"{job.op}: field from rank {s} on rank {me} carries event id {int(seen[s, M_EVENT])}, "
                            f"expected {job.event_id}")
        if seen[s, M_COUNT] != job.expect_count[me][s]:
            raise XcclError(f"{job.op}: rank {s} announces {int(seen[s, M_COUNT])} rows for rank {me}, the routing "
                            f"plan expects {int(job.expect_count[me][s])}")
    return seen


@kernel(cores="aiv")
def dispatch_kernel(ctx, job):
    """Per rank: x ``[T, H]`` bf16 -> (int8 + scale) messages in the local window -> publish -> poll -> pull
    segments from the peers' windows -> out ``[N, H]`` (+ scales ``[N]`` fp32) grouped expert-major."""
    me = job.rank_of[ctx.die]
    h, rs, rr, quant = job.hidden, job.send_rows, job.recv_rows, job.quant
    x_t = ctx.ub.alloc((2, rs, h), "bf16", name="x")
    if quant:
        q_t = ctx.ub.alloc((2, rs, h), "int8", name="q")
        s_t = ctx.ub.alloc((2, _pad8(rs)), "fp32", name="scale")
        sb_t = ctx.ub.alloc((2, rs, SCALE_BLOCK // 4), "fp32", name="scale_block")    # one 32-byte block a row
        r_t = ctx.ub.alloc((2, rr, h + SCALE_BLOCK), "int8", name="rx")
    else:
        r_t = ctx.ub.alloc((2, rr, h), "bf16", name="rx")

    # 1. tokens -> UB -> (quantise) -> one message per (token, k) into my window, partitioned by destination
    x_gm, win = job.x[me], job.win[me]
    for i, (t0, n, pairs) in enumerate(job.send_prog[me][ctx.block_idx]):
        b = i % 2
        yield ctx.copy_gm_to_ub(x_t[b, :n], x_gm[t0:t0 + n])
        if quant:
            yield ctx.vec.quant_int8(q_t[b, :n], s_t[b, :n], x_t[b, :n])
            yield ctx.vec.broadcast(sb_t[b, :n], s_t[b, :n].reshape(n, 1))       # scale -> its 32-byte block
            sb8 = sb_t[b].view_as("int8")
            for r, row in pairs:
                yield ctx.copy_ub_to_gm(win[row, :h], q_t[b, r])
                yield ctx.copy_ub_to_gm(win[row, h:], sb8[r])
        else:
            for r, row in pairs:
                yield ctx.copy_ub_to_gm(win[row], x_t[b, r])

    # 2-3. publish my partitions, wait for every rank's
    seen = yield from _publish_and_poll(ctx, job, me)
    if ctx.block_idx == 0:
        yield ctx.gm_store(job.rank_counts[me], seen[:, M_COUNT].copy())

    # 3. pull my share of the segments from the peers' windows, write them to the output
    out, out_s = job.out[me], job.out_scales_i8[me]
    for i, (s, r0, q0, n) in enumerate(job.recv_prog[me][ctx.block_idx]):
        b = i % 2
        a0 = int(seen[s, M_OFFSET]) + r0                    # the published offset addresses the peer's window
        yield ctx.copy_gm_to_ub(r_t[b, :n], job.win[s][a0:a0 + n])       # mtu-in from the peer die
        if quant:
            yield ctx.copy_ub_to_gm(out[q0:q0 + n], r_t[b, :n, :h])
            yield ctx.copy_ub_to_gm(out_s[q0:q0 + n], r_t[b, :n, h:h + 4], pad=True)
        else:
            yield ctx.copy_ub_to_gm(out[q0:q0 + n], r_t[b, :n])


@kernel(cores="aiv")
def combine_kernel(ctx, job):
    """Per rank: expert rows ``[N, H]`` bf16 -> local combine window by source rank -> publish -> poll -> for each
    of my tokens pull its K rows, ``sum_k w_k y_k`` in fp32 -> out ``[T, H]`` bf16 (or fp32)."""
    me = job.rank_of[ctx.die]
    h, ra, hc, k = job.hidden, job.stage_rows, job.chunk, job.topk
    st_t = ctx.ub.alloc((2, ra, h), "bf16", name="stage")
    y_t = ctx.ub.alloc((2, k, hc), "bf16", name="y")
    acc_t = ctx.ub.alloc((k, hc), "fp32", name="acc")
    w_t = ctx.ub.alloc((2, _pad8(k)), "fp32", name="w")
    o_t = ctx.ub.alloc((2, hc), "bf16", name="out") if job.out_bf16 else None

    # 1. my expert outputs -> my combine window, partitioned by source rank (local copies through UB)
    ex, win = job.expert_out[me], job.win[me]
    for i, (q0, a0, n) in enumerate(job.stage_prog[me][ctx.block_idx]):
        b = i % 2
        yield ctx.copy_gm_to_ub(st_t[b, :n], ex[q0:q0 + n])
        yield ctx.copy_ub_to_gm(win[a0:a0 + n], st_t[b, :n])

    # 2-3. publish my partitions, wait for every rank's
    seen = yield from _publish_and_poll(ctx, job, me)

    # 4. per token: pull its K rows (column chunks of hc), weight, reduce in fp32, store
    w_gm, out = job.weights[me], job.out[me]
    it = 0
    for j, (t, slots, masked) in enumerate(job.reduce_prog[me][ctx.block_idx]):
        wb = j % 2
        yield ctx.copy_gm_to_ub(w_t[wb, :k], w_gm[t], pad=True)
        for kk in masked:
            yield ctx.set_value(w_t[wb], kk, 0.0)           # a masked slot's weight may be anything: zero it
        for h0 in range(0, h, hc):
            b = it % 2
            it += 1
            for kk, d, r in slots:
                row = int(seen[d, M_OFFSET]) + r
                yield ctx.copy_gm_to_ub(y_t[b, kk], job.win[d][row, h0:h0 + hc])    # mtu-in from the expert's die
            for kk in masked:     # nothing was pulled into a masked slot: zeros, not what the UB held
                yield ctx.vec.duplicate(y_t[b, kk], 0.0)
            yield ctx.vec.cast(acc_t, y_t[b])
            yield ctx.vec.mul(acc_t, acc_t, w_t[wb, :k].reshape(k, 1))
            n = k
            while n > 1:                                    # tree sum over the K slots, in fp32
                half = n // 2
                yield ctx.vec.add(acc_t[0:half], acc_t[0:half], acc_t[n - half:n])
                n -= half
            if o_t is not None:
                yield ctx.vec.cast(o_t[b], acc_t[0])        # RNE to bf16
                yield ctx.copy_ub_to_gm(out[t, h0:h0 + hc], o_t[b])
            else:
                yield ctx.copy_ub_to_gm(out[t, h0:h0 + hc], acc_t[0])


# ============================================================================================== host API
class _Job:
    """Everything a kernel instance reads: per-rank GM views, the per-core programs, the round. Plain data."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def dispatch(comm: Communicator, x, topk_ids, *, num_experts: int, expert_placement=None, quant: bool = False,
             cores: int = 48, event_id: int | None = None, numeric: bool = True,
             wait_timeout_us: float | None = 10_000.0, dies=None) -> DispatchResult:
    """Send every token to the ranks owning its top-k experts (pull-based; see the module docstring).

    ``x``: per rank ``[T, H]`` bf16 (torch or numpy/ml_dtypes; list or ``[ranks, T, H]``); in timing-only runs
    (``numeric=False``) it may be a ``(T, H)`` shape. ``topk_ids``: per rank ``[T, K]`` int, -1 = masked (real in
    both modes). ``expert_placement``: ``[num_experts]`` owning rank of each expert. ``quant``: INT8 + per-row fp32
    scale on the wire and in the output. ``cores``: AIVs per rank. ``event_id``: checked by every receiver (default:
    the op's round number). ``dies``: launch on these member dies only (default all; the others never run, so their
    peers' polls hit the bound: a protocol test hook).
    """
    prep = prepare_dispatch(comm, x, topk_ids, num_experts=num_experts, expert_placement=expert_placement,
                            quant=quant, cores=cores, event_id=event_id, numeric=numeric)
    return prep.launch(wait_timeout_us=wait_timeout_us, dies=dies)


class PreparedDispatch:
    """A planned dispatch with its GM buffers allocated: ``launch()`` runs it and returns a ``DispatchResult``."""

    def __init__(self, comm, job, plan, numeric):
        self.comm, self.job, self.plan, self.numeric = comm, job, plan, numeric

    def launch(self, *, wait_timeout_us: float | None = 10_000.0, dies=None) -> DispatchResult:
        comm, job = self.comm, self.job
        for d in comm.dies:
            job.ctl[comm.rank(d)].write(np.zeros(FIELD_WORDS, np.int32))
        run = comm.pod.launch(dispatch_kernel, dies=comm.dies if dies is None else dies, aiv=job.cores,
                              args=(job,), numeric=self.numeric, wait_timeout_us=wait_timeout_us, name="xccl_dispatch")
        x_out = scales = None
        if self.numeric:
            x_out = [_torch(job.out[r].numpy()) for r in range(job.ranks)]
            if job.quant:
                scales = [_torch(job.out_scales[r].numpy()) for r in range(job.ranks)]
        import torch
        return DispatchResult(
            x=x_out, scales=scales,
            expert_counts=[torch.from_numpy(c.astype(np.int64)) for c in self.plan.expert_counts],
            rank_counts=[torch.from_numpy(job.rank_counts[r].numpy().astype(np.int64)) for r in range(job.ranks)],
            x_gm=job.out, scales_gm=job.out_scales if job.quant else None,
            handle=DispatchHandle(self.plan, job.hidden), run=run)


def prepare_dispatch(comm: Communicator, x, topk_ids, *, num_experts: int, expert_placement=None,
                     quant: bool = False, cores: int = 48, event_id: int | None = None,
                     numeric: bool = True) -> PreparedDispatch:
    """Plan the routing and allocate GM (inputs, windows, outputs) for ``dispatch``; arguments as there."""
    pod, ranks = comm.pod, comm.size
    _check_cores(cores, pod)
    event_id = None if event_id is None else check_event_id(event_id)
    plan = plan_routing(topk_ids, num_experts, ranks, expert_placement)
    xs, hidden = _inputs(comm, x, plan, numeric)
    st = _state(comm)
    st.round += 1
    width = hidden + SCALE_BLOCK if quant else hidden          # elements (int8) or bf16 elements per message
    wdt = "int8" if quant else "bf16"
    wbytes = width * (1 if quant else 2)
    rs = _fit_rows(hidden * 2 * 2 + (hidden * 2 + SCALE_BLOCK * 2 + 8 if quant else 0),
                   (pod.profile.ub_bytes - UB_BYTES_SPARE) // 2, max(plan.tokens, default=1), cores)
    rr = _fit_rows(2 * wbytes, (pod.profile.ub_bytes - UB_BYTES_SPARE) // 2, 64, 1)
    win, out, out_s, out_s8, rcounts = [], [], [], [], []
    for r, d in enumerate(comm.dies):
        nsend = int(plan.counts[r].sum())
        w = st.window(comm, "dispatch", d, nsend * wbytes, not numeric)
        win.append(_typed(w, nsend, width, wdt))
        n = plan.recv_rows[r]
        out.append(pod.alloc(d, (n, hidden), wdt, phantom=not numeric, name=f"moe_dispatch_out{d}"))
        if quant:
            s = pod.alloc(d, (n,), "fp32", phantom=not numeric, name=f"moe_dispatch_scales{d}")
            out_s.append(s)
            out_s8.append(s.view_as("int8").reshape(n, 4))
        else:
            out_s.append(None)
            out_s8.append(None)
        rcounts.append(pod.alloc(d, (ranks,), "int32", name=f"moe_dispatch_rank_counts{d}"))
    job = _Job(op="dispatch", ranks=ranks, rank_of=comm.rank_of, hidden=hidden, quant=quant, cores=cores,
               send_rows=rs, recv_rows=rr, x=xs, win=win, out=out, out_scales=out_s, out_scales_i8=out_s8,
               rank_counts=rcounts, meta=[comm.moe_meta[d] for d in comm.dies],
               ctl=[st.ctl[d] for d in comm.dies], round=st.round,
               event_id=st.round if event_id is None else event_id,
               pub_offset=plan.offsets, pub_count=plan.counts, expect_count=plan.counts.T,
               send_prog=[_send_program(plan, r, rs, cores) for r in range(ranks)],
               recv_prog=[_chunked(_rotated(plan.segments[r], r, ranks), rr, cores) for r in range(ranks)])
    return PreparedDispatch(comm, job, plan, numeric)


def combine(comm: Communicator, handle: DispatchHandle, expert_out, topk_weights, *, out_dtype: str = "bf16",
            cores: int = 48, event_id: int | None = None, numeric: bool = True,
            wait_timeout_us: float | None = 10_000.0, dies=None) -> CombineResult:
    """Return expert outputs to their tokens and reduce: ``out[t] = sum_k w[t, k] * y[t, k]`` (fp32, masked slots
    skipped), cast to ``out_dtype`` ("bf16", RNE, or "fp32").

    ``expert_out``: per rank ``[N, H]`` bf16 in the dispatch output's row order (host tensors, or GM tensors on the
    rank's die such as a following kernel wrote; None in timing-only runs). ``topk_weights``: per rank ``[T, K]``
    fp32 (None in timing-only runs). Other arguments as ``dispatch``."""
    if not isinstance(handle, DispatchHandle):
        raise ArgumentError(f"handle must be the DispatchHandle a dispatch returned, got {type(handle).__name__}")
    if out_dtype not in ("bf16", "fp32"):
        raise ArgumentError(f"out_dtype={out_dtype!r}: use 'bf16' or 'fp32'")
    plan, pod, ranks, h = handle.plan, comm.pod, comm.size, handle.hidden
    if plan.ranks != ranks:
        raise ArgumentError(f"handle was planned for {plan.ranks} ranks, this communicator has {ranks}")
    _check_cores(cores, pod)
    event_id = None if event_id is None else check_event_id(event_id)
    for arg, v in (("expert_out", expert_out), ("topk_weights", topk_weights)):
        if v is not None:
            _per_rank(v, ranks, arg)
    st = _state(comm)
    st.round += 1
    k = plan.topk
    budget = pod.profile.ub_bytes - UB_BYTES_SPARE
    hc = _chunk(h, k, budget * 3 // 4, out_dtype == "bf16")
    ra = _fit_rows(2 * 2 * h, budget - hc * (k * 2 * 2 + k * 4 + 4) - 64, 64, 1)
    coff = plan.combine_offsets
    ex, win, w_gm, out = [], [], [], []
    for r, d in enumerate(comm.dies):
        n = plan.recv_rows[r]
        ex.append(_rank_tensor(pod, d, expert_out, r, (n, h), "bf16", numeric, "expert_out"))
        w = st.window(comm, "combine", d, n * h * 2, not numeric)
        win.append(_typed(w, n, h, "bf16"))
        t = plan.tokens[r]
        w_gm.append(_rank_tensor(pod, d, topk_weights, r, (t, k), "fp32", numeric, "topk_weights"))
        out.append(pod.alloc(d, (t, h), out_dtype, phantom=not numeric, name=f"moe_combine_out{d}"))
    stage = []
    for r in range(ranks):
        segs = [(q0, int(coff[r, s]) + r0, n) for (s, r0, q0, n) in plan.segments[r]]
        stage.append(_chunked([(None, a0, q0, n) for (q0, a0, n) in segs], ra, cores, keep=("q0", "a0")))
    job = _Job(op="combine", ranks=ranks, rank_of=comm.rank_of, hidden=h, topk=k, cores=cores, stage_rows=ra,
               chunk=hc, out_bf16=out_dtype == "bf16", expert_out=ex, win=win, weights=w_gm, out=out,
               meta=[comm.moe_meta[d] for d in comm.dies], ctl=[st.ctl[d] for d in comm.dies], round=st.round,
               event_id=st.round if event_id is None else event_id,
               pub_offset=coff, pub_count=plan.counts.T, expect_count=plan.counts,
               stage_prog=stage, reduce_prog=[_reduce_program(plan, r, cores) for r in range(ranks)])
    for r in range(ranks):
        job.ctl[r].write(np.zeros(FIELD_WORDS, np.int32))
    run = pod.launch(combine_kernel, dies=comm.dies if dies is None else dies, aiv=cores, args=(job,),
                     numeric=numeric, wait_timeout_us=wait_timeout_us, name="xccl_combine")
    res = [_torch(o.numpy()) for o in out] if numeric else None
    return CombineResult(out=res, out_gm=out, run=run)


# ============================================================================================== host helpers
def _send_program(plan: RoutingPlan, s: int, rows: int, cores: int) -> list:
    """Per core: tiles (first token, tokens, [(row in tile, window row), ...]) of rank ``s``; tile i -> core i % n."""
    prog = [[] for _ in range(cores)]
    sr = plan.send_row[s]
    for i, t0 in enumerate(range(0, plan.tokens[s], rows)):
        n = min(rows, plan.tokens[s] - t0)
        blk = sr[t0:t0 + n]
        r_idx, k_idx = np.nonzero(blk >= 0)
        pairs = list(zip(r_idx.tolist(), blk[r_idx, k_idx].tolist()))
        if pairs:
            prog[i % cores].append((t0, n, pairs))
    return prog


def _rotated(segments, me: int, ranks: int) -> list:
    """Segments in pull order: source ``me`` first, then ``me + 1``, ... so that at any moment the ranks pull from
    different peers (an all-to-all schedule) instead of all queueing on rank 0's send port."""
    return sorted(segments, key=lambda seg: ((seg[0] - me) % ranks, seg[2]))


def _chunked(segments, rows: int, cores: int, keep=None) -> list:
    """Split segments (src, first row, first output row, n) into chunks of <= ``rows``; chunk i -> core i % n."""
    prog = [[] for _ in range(cores)]
    i = 0
    for s, r0, q0, n in segments:
        for o in range(0, n, rows):
            m = min(rows, n - o)
            prog[i % cores].append((q0 + o, r0 + o, m) if keep else (s, r0 + o, q0 + o, m))
            i += 1
    return prog


def _reduce_program(plan: RoutingPlan, s: int, cores: int) -> list:
    """Per core: (token, [(k, expert rank, row within its partition), ...], [masked k, ...]); token t -> core t % n."""
    prog = [[] for _ in range(cores)]
    dest, rel = plan.dest[s], plan.rel[s]
    for t in range(plan.tokens[s]):
        slots = [(kk, int(dest[t, kk]), int(rel[t, kk])) for kk in range(plan.topk) if dest[t, kk] >= 0]
        slots.sort(key=lambda sl: (sl[1] - s) % plan.ranks)       # nearest peer first, as in _rotated
        masked = [kk for kk in range(plan.topk) if dest[t, kk] < 0]
        prog[t % cores].append((t, slots, masked))
    return prog


def _fit_rows(bytes_per_row: int, budget: int, most: int, cores: int) -> int:
    """Rows per tile: as many as fit ``budget`` bytes of UB, at most ``most / cores`` (rounded up) and >= 1."""
    fit = max(1, budget // max(bytes_per_row, 1))
    share = max(1, -(-most // max(cores, 1)))
    return int(min(fit, share))


def _chunk(h: int, k: int, budget: int, out_bf16: bool) -> int:
    """Column chunk of the combine reduction: the largest h / c (c | h, multiple of 16) whose tiles fit."""
    per_col = k * 2 * 2 + k * 4 + (2 * 2 if out_bf16 else 0)
    for c in range(1, h + 1):
        if h % c == 0 and (h // c) % 16 == 0 and (h // c) * per_col <= budget:
            return h // c
    raise ArgumentError(f"hidden={h}, topk={k}: no column chunk (a divisor of hidden, multiple of 16) fits the UB")


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _check_cores(cores: int, pod) -> None:
    check_int(cores, "cores", 1, pod.profile.aiv_per_die)


def _per_rank(v, ranks: int, arg: str) -> list:
    if v is None:
        raise ArgumentError(f"{arg} is required")
    n = len(v)
    if n != ranks:
        raise ArgumentError(f"{arg} has {n} per-rank entries, the communicator has {ranks} ranks")
    return [v[i] for i in range(ranks)]


def _np(a):
    if type(a).__module__.startswith("torch"):
        import torch
        if a.dtype == torch.bfloat16:
            import ml_dtypes
            return a.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _torch(a: np.ndarray):
    import ml_dtypes
    import torch
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _inputs(comm: Communicator, x, plan: RoutingPlan, numeric: bool):
    """x per rank -> GM tensors on each rank's die; returns (tensors, hidden)."""
    pod = comm.pod
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(v, (int, np.integer)) for v in x):
        if numeric:
            raise ArgumentError("x given as a (tokens, hidden) shape: only timing-only runs (numeric=False) take one")
        t, hidden = int(x[0]), int(x[1])
        for r, tr in enumerate(plan.tokens):
            if tr != t:
                raise ArgumentError(f"x shape has {t} tokens, topk_ids[{r}] has {tr}")
        _check_hidden(hidden)
        return [pod.alloc(d, (t, hidden), "bf16", phantom=True, name=f"moe_x{d}") for d in comm.dies], hidden
    xs = _per_rank(x, comm.size, "x")
    out, hidden = [], None
    for r, (d, a) in enumerate(zip(comm.dies, xs)):
        a = _np(a)
        if a.dtype.name != "bfloat16":
            raise ArgumentError(f"x[{r}] is {a.dtype.name}: dispatch takes bf16 tokens (cast on the host first)")
        if a.ndim != 2 or a.shape[0] != plan.tokens[r]:
            raise ArgumentError(f"x[{r}] has shape {a.shape}: expected [{plan.tokens[r]}, hidden] to match "
                                f"topk_ids[{r}]")
        if hidden is None:
            hidden = a.shape[1]
            _check_hidden(hidden)
        elif a.shape[1] != hidden:
            raise ArgumentError(f"x[{r}] has hidden {a.shape[1]}, x[0] has {hidden}")
        out.append(pod.to_gm(d, a, name=f"moe_x{d}") if numeric else
                   pod.alloc(d, a.shape, "bf16", phantom=True, name=f"moe_x{d}"))
    return out, hidden


def _check_hidden(hidden: int) -> None:
    if hidden < 32 or hidden % 32:
        raise ArgumentError(f"hidden={hidden}: must be a positive multiple of 32 (int8 rows move in 32-byte bursts)")


def _rank_tensor(pod, die, values, r, shape, dtype, numeric, arg):
    """Per-rank input -> a GM tensor of ``shape``/``dtype`` on ``die`` (GM tensors on that die pass through)."""
    from ascend_emu import GMTensor
    from ascend_emu.dtypes import as_dtype
    v = None if values is None else values[r]
    if isinstance(v, GMTensor):
        if v.die != die or tuple(v.shape) != tuple(shape) or v.dtype != as_dtype(dtype):
            raise ArgumentError(f"{arg}[{r}] is {v.describe()}: expected {tuple(shape)} {dtype} on die {die}")
        return v
    if v is None:
        if numeric:
            raise ArgumentError(f"{arg} is required in numeric runs")
        return pod.alloc(die, shape, dtype, phantom=True, name=f"moe_{arg}{die}")
    a = _np(v)
    if tuple(a.shape) != tuple(shape):
        raise ArgumentError(f"{arg}[{r}] has shape {tuple(a.shape)}: expected {tuple(shape)}")
    if not numeric:
        return pod.alloc(die, shape, dtype, phantom=True, name=f"moe_{arg}{die}")
    return pod.to_gm(die, a, dtype=dtype, name=f"moe_{arg}{die}")
