"""Persistent expert kernels: receive (A2E), compute (grouped GEMM), send (E2A) streams on every expert die, fed by
DP domains of attention dies that take turns with two microbatches each (DESIGN.md 3.3 streams, 4 A2E/E2A).

    pipe = ExpertPipeline(pod, domains=[[0, 1], [2, 3]], expert_dies=[4, 5, 6, 7], num_experts=8, hidden=128)
    res = pipe.run(topk_ids, topk_weights, x=x, weights=w)        # ids/weights/x: [L][attention die] [B, K] / [B, H]
    res.out[l][i]            # [B, H] bf16 MoE output of attention die i (domain-major order) at layer l
    res.die_busy, res.stream_busy, res.layer_us, res.modeled_us

**Rounds.** The work is cut into rounds r = (layer l, domain d, microbatch m), ordered l, d, m: the domains take turns
and each domain sends its microbatches back to back. Microbatch m is rows ``[m B/M, (m+1) B/M)`` of every attention
die's batch. Round r uses buffer slot ``s = r % S`` on the expert dies (``num_slots`` S, default 2: double buffering,
round r+1 is received while round r is computed), its slot's ``use = r // S``-th time, and round ids ``2r + 1`` (A2E
records) and ``2r + 2`` (E2A records).

**Streams.** Per expert die three persistent kernels on disjoint cores (``StreamSplit``: receive AIVs, compute AICs,
send AIVs, each a ``pod.stream(die, ...)`` launched once with ``persistent=True``) loop over every round:
  receive  polls the slot's stage-1 records (trampoline) or forward record (partner), runs xccl.a2e's trampoline step
           (count check, bulk forward of the partners' regions, records), then reorders its own rows expert-major
           into ``xem[s]`` (a row gather over the receive AIVs; the trampoline also reorders the group's gating
           weights into ``gw2[s]`` for E2A), and counts itself done: ``ctl[RECV, s] += 1`` per core.
  compute  polls ``ctl[RECV, s] >= (use + 1) x receive cores``, runs kernels.grouped_matmul's AIC tile loop (bf16,
           fp32 accumulate over K steps of 64, fixpipe to bf16; one group per local expert, tiles dealt over the AICs
           from a start that rotates across rounds) from ``xem[s]`` into the slot's output; ``ctl[COMP, s] += 1``
           per AIC.
  send     polls ``ctl[COMP, s] >= (use + 1) x AICs`` (on a trampoline also its partners' E2A records), runs
           xccl.a2e's E2A step (partner: bulk to the trampoline; trampoline: per-token weighted partials to the
           attention windows, records), then on a trampoline releases the slot: ``ctl[FREE, s] += 1`` per core.
Attention side: per (domain, microbatch) one persistent multi-die kernel on its own AIVs (microbatch m: AIVs
``[m c, (m+1) c)``) loops over the layers: modeled attention, credit wait (every trampoline it writes to has
``ctl[FREE, s] >= use x send cores``: the slot's previous round is done), xccl.a2e's stage 1, xccl.a2e's E2A receive
(poll, gather, fp32 sum, bf16), die barrier (a fence too). The credits are the only back-pressure: slot safety on
partner dies follows from the trampoline's order (forward after credit, credit after the partners' E2A records).
Counters are per slot because a fast core may start round r+1 before a slow core of its stream finished round r;
it can never lap a whole slot cycle (the credits), so ``(use + 1) x cores`` on slot s counts round r exactly.
xccl.a2e's die-local joins get one counter per slot and stream for the same reason.

Per-die GM of this module (``pipe.*``; int32 32-byte fields, word 0 used):
  ``pipe.ctl{die}`` [5, S, 8] every expert die: RECV, COMP, FREE (trampolines), JOIN_RECV, JOIN_SEND counts per slot
  ``pipe.s1{die}`` [S, A, 8], ``pipe.s3{die}`` [S, G-1, 8] trampolines; ``pipe.s2{die}`` [S, 8] every expert die;
  ``pipe.s4{die}`` [M, T, 8] attention dies: xccl.a2e's records, one set per slot (per microbatch on attention dies)
and data: per trampoline ``gbuf [S, cap_g, H]`` bf16, ``gw, gw2 [S, cap_g + 1, 1]`` fp32, ``outg [S, cap_g + 1, H]``
bf16 (the last rows stay zero: gather pads); per expert die ``xem`` (+ partners ``inp``, ``out``) ``[S, cap_e, H]``
bf16, weights ``[E/dies, H, H]`` bf16; per attention die and microbatch an E2A window ``[cap_w + 1, H]``, per layer
the inputs ``x [B/M, H]`` and outputs ``y [B/M, H]``.

Busy time: each core records (GetSystemCycle-style, on the host) the interval from the moment its round's input was
ready (the poll returned) to the moment its done-count landed; a stream's busy time is the union over its cores, an
expert die's busy time the union over its three streams; fractions are of the run's kernel span.

modeled as: routing planned on the host for every round up front (as in xccl.a2e), so slot capacities ``cap_*`` are
the largest round's rows; the round schedule is given at launch and the persistent kernels exit after the last round
(a production kernel polls a doorbell for its next descriptor and a stop flag). An expert is one bf16 GEMM
``[H, H]`` (a real expert is gate/up + SwiGLU + down), the same weights in every layer. Attention compute is a fixed
scalar delay of ``attn_us x (B/M) / B`` per layer and microbatch on the attention cores (no attention kernel), and
each layer's hidden states come from the host (the output of layer l is not fed into layer l+1; the data
dependency is kept in time: layer l+1 is sent only after layer l's E2A arrived). The attention <-> trampoline hops
use the mtu path. Per round each stream re-carves its tiles after a PipeBarrier (Ascend C's TPipe reset): the reused
xccl.a2e / grouped-GEMM bodies allocate per call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from ascend_emu import Pod, RunResult, kernel
from ascend_emu.errors import ArgumentError, DeadlockError
from kernels.grouped_matmul import BASE_N, GemmPlan, GemmTiling, cube_tiles, plan_tiles

from xccl.a2e import (FLAG, MAX_TILE_ROWS, UB_SPARE, Job, a2e_attention_step, a2e_expert_step, e2a_attention_step,
                      e2a_expert_step, fit_rows, plan_domain, plan_groups, reduce_tiling, write_pad_row)

# pipe.ctl{die} [5, slots, 8] int32: per slot a count of round completions x cores. A core may run rounds ahead of
# its stream's slowest core, but never a whole slot cycle (the credits), so per-slot counts are exact.
C_RECV, C_COMP, C_FREE, C_JOIN_RECV, C_JOIN_SEND = range(5)
GEMM_PLAN = GemmPlan(GemmTiling().resolve("bf16"), 0)       # n: the hidden size, set per pipeline


@dataclass(frozen=True)
class StreamSplit:
    """Cores of an expert die per stream: receive AIVs ``[0, recv_aiv)``, send AIVs ``[recv_aiv, recv_aiv +
    send_aiv)``, compute AICs ``[0, aic)``."""
    recv_aiv: int = 24
    send_aiv: int = 24
    aic: int = 24


# ============================================================================================== kernels
def _marks(ctx):
    bufs = [ctx.ub] if ctx.is_aiv else [ctx.l1, ctx.l0a, ctx.l0b, ctx.l0c]
    return [(b, b.mark()) for b in bufs]


def _fresh_tiles(ctx, marks):
    """TPipe reset at a round boundary: once every earlier instruction is done, carve the round's tiles again."""
    yield ctx.pipe_barrier()
    for buf, top in marks:
        buf.release(top)


def _permute(ctx, src, dst, perm, tile, pad=False):
    """dst[j] = src[perm[j]]: row gathers into UB and contiguous stores, tiles dealt over the stream's cores."""
    R = tile.shape[1]
    for j, i in enumerate(range(ctx.block_idx * R, len(perm), R * ctx.block_num)):
        m = min(R, len(perm) - i)
        t = tile[j % 2, :m]
        yield ctx.gather_gm_to_ub(t, src, perm[i:i + m])
        yield ctx.copy_ub_to_gm(dst[i:i + m], t, pad=pad)


@kernel(cores="aiv")
def attention_kernel(ctx, pipe, d, m):
    """Domain ``d``'s microbatch ``m`` on its attention dies, layer after layer: attention (modeled), credits,
    A2E stage 1, E2A receive; logs ("attn", die, round, A2E start us, E2A done us)."""
    marks = _marks(ctx)
    pipe.log.append(("start", ctx.die, -1, ctx.now_us, ctx.now_us))
    for rd in pipe.attn_rounds[(d, m)]:
        yield from _fresh_tiles(ctx, marks)
        if pipe.attn_cycles:
            yield ctx.scalar(pipe.attn_cycles)                    # modeled as: the attention layer
        role = rd.attn_roles[ctx.die]
        if rd.use:                                  # credits: every trampoline released slot s of round r - slots
            for g in role["order"][ctx.block_idx::ctx.block_num]:
                free = pipe.ctl[pipe.tramp_die[g]][C_FREE, rd.slot, 0:1]
                yield ctx.wait_gm(free, "ge", rd.use * pipe.split.send_aiv)
        t0 = ctx.now_us
        yield from a2e_attention_step(ctx, rd.a2e, role)
        yield from e2a_attention_step(ctx, rd.e2a, role)
        yield ctx.barrier("die")                                  # the layer's output is complete on this die
        pipe.log.append(("attn", ctx.die, rd.idx, t0, ctx.now_us))


@kernel(cores="aiv")
def receive_kernel(ctx, pipe):
    """Expert die, receive AIVs: per round, wait for the slot's records, trampoline step, expert-major reorder."""
    die = ctx.die
    e = pipe.expert_index[die]
    ctl = pipe.ctl[die]
    H = pipe.hidden
    xt = ctx.ub.alloc((2, pipe.perm_rows, H), "bf16", name="perm_x")
    wt = ctx.ub.alloc((2, -(-pipe.perm_rows // 8) * 8, 1), "fp32", name="perm_w")
    marks = _marks(ctx)
    for rd in pipe.rounds:
        s = rd.slot
        role = rd.expert_roles[die]
        if role["tramp"]:
            yield ctx.wait_gm(pipe.s1[die][s, :, FLAG], "eq", rd.a2e.round)     # every source's stage-1 record
        else:
            yield ctx.wait_gm(pipe.s2[die][s, FLAG:FLAG + 1], "eq", rd.a2e.round)
        t0 = ctx.now_us
        yield from _fresh_tiles(ctx, marks)
        yield from a2e_expert_step(ctx, rd.a2e, role)          # count check, partners' regions forwarded, records
        n = rd.rows[e]
        if n:
            yield from _permute(ctx, rd.a2e_input[e], pipe.xem[die][s, :n], rd.perm[e], xt)
        if role["tramp"] and rd.group_perm[role["g"]].size:
            yield from _permute(ctx, pipe.gw[die][s], pipe.gw2[die][s], rd.group_perm[role["g"]], wt, pad=True)
        yield ctx.atomic_add(ctl[C_RECV, s, 0:1], 1, after="all")     # input slot s holds round r, expert-major
        pipe.log.append(("recv", die, rd.idx, t0, ctx.now_us))


@kernel(cores="aic")
def compute_kernel(ctx, pipe):
    """Expert die, compute AICs: per round, wait for the receive count, grouped GEMM xem[s] @ W -> output slot."""
    die = ctx.die
    e = pipe.expert_index[die]
    ctl = pipe.ctl[die]
    marks = _marks(ctx)
    p = replace(GEMM_PLAN, n=pipe.hidden)
    for rd in pipe.rounds:
        yield ctx.wait_gm(ctl[C_RECV, rd.slot, 0:1], "ge", (rd.use + 1) * pipe.split.recv_aiv)
        t0 = ctx.now_us
        yield from _fresh_tiles(ctx, marks)
        tiles = plan_tiles(rd.ends[e], pipe.hidden, BASE_N)
        start = rd.tile_start[e]
        mine = [t for i, t in enumerate(tiles) if (start + i) % ctx.block_num == ctx.block_idx]
        if mine:
            yield from cube_tiles(ctx, pipe.xem[die][rd.slot], pipe.w[die], None, None, rd.e2a_output[e], p, mine,
                             pipe.hidden)
        yield ctx.atomic_add(ctl[C_COMP, rd.slot, 0:1], 1, after="all")     # fixpipe writes visible
        pipe.log.append(("compute", die, rd.idx, t0, ctx.now_us))


@kernel(cores="aiv")
def send_kernel(ctx, pipe):
    """Expert die, send AIVs: per round, wait for the compute count (and partners), E2A step, release the slot."""
    die = ctx.die
    ctl = pipe.ctl[die]
    marks = _marks(ctx)
    for rd in pipe.rounds:
        s = rd.slot
        role = rd.send_roles[die]
        yield ctx.wait_gm(ctl[C_COMP, s, 0:1], "ge", (rd.use + 1) * pipe.split.aic)
        if role["tramp"] and role["partners"]:
            yield ctx.wait_gm(pipe.s3[die][s, :role["partners"], FLAG], "eq", rd.e2a.round)
        t0 = ctx.now_us
        yield from _fresh_tiles(ctx, marks)
        yield from e2a_expert_step(ctx, rd.e2a, role)
        if role["tramp"]:
            yield ctx.atomic_add(ctl[C_FREE, s, 0:1], 1, after="all")      # slot s may take round r + slots
        pipe.log.append(("send", die, rd.idx, t0, ctx.now_us))


# ============================================================================================== host side
@dataclass
class _Round:
    """One (layer, domain, microbatch): its slot, its xccl.a2e jobs and every die's role and views."""
    idx: int
    layer: int
    domain: int
    mb: int
    slot: int
    use: int                      # earlier rounds on this slot (credits to wait for)
    a2e: Job
    e2a: Job
    attn_roles: dict              # attention die -> role of xccl.a2e stage 1 + E2A receive (a, x, wsend, order, y)
    expert_roles: dict            # expert die -> role of xccl.a2e's trampoline step (e, g, tramp, join)
    send_roles: dict              # expert die -> role of xccl.a2e's E2A step (e, g, tramp, order, join, partners)
    rows: list                    # [E] rows expert die e computes
    perm: list                    # [E] expert-major order of those rows (positions in the A2E layout)
    group_perm: list              # [T] the same over the whole group buffer (gating weights)
    ends: list                    # [E] cumulative rows per local expert (grouped GEMM group list)
    tile_start: list              # [E] first AIC of the round's tiles (rotates across rounds)
    a2e_input: list               # [E] GM rows as A2E left them
    e2a_output: list              # [E] GM rows the GEMM writes and E2A reads


@dataclass
class _Pipe:
    """Everything a run's kernels read: configuration, GM areas keyed by die (``win``/``ones`` by (die, mb)), the
    rounds, the timing log."""
    hidden: int
    split: StreamSplit
    expert_index: dict
    tramp_die: list
    cap_g: list
    cap_w: int
    perm_rows: int
    attn_cycles: int = 0
    rounds: list = dataclasses.field(default_factory=list)
    attn_rounds: dict = dataclasses.field(default_factory=dict)
    log: list = dataclasses.field(default_factory=list)
    ctl: dict = dataclasses.field(default_factory=dict)
    s1: dict = dataclasses.field(default_factory=dict)
    s2: dict = dataclasses.field(default_factory=dict)
    s3: dict = dataclasses.field(default_factory=dict)
    s4: dict = dataclasses.field(default_factory=dict)
    gbuf: dict = dataclasses.field(default_factory=dict)
    gw: dict = dataclasses.field(default_factory=dict)
    gw2: dict = dataclasses.field(default_factory=dict)
    outg: dict = dataclasses.field(default_factory=dict)
    xem: dict = dataclasses.field(default_factory=dict)
    inp: dict = dataclasses.field(default_factory=dict)
    out: dict = dataclasses.field(default_factory=dict)
    w: dict = dataclasses.field(default_factory=dict)
    win: dict = dataclasses.field(default_factory=dict)
    ones: dict = dataclasses.field(default_factory=dict)


@dataclass
class PipelineResult:
    """A pipeline run. Times in modeled microseconds; fractions of ``window_us`` (the run's kernel span).

    ``layer_us`` [L]: when the last E2A of layer l landed minus the same for layer l-1 (layer 0: from the first
    attention kernel's start, after its launch and communication start-up). ``exchange_us`` [L, D, M]: A2E start
    (after the credits) to E2A output, slowest attention die of the domain.
    ``stream_busy_us`` / ``stream_busy``: {expert die: {"recv", "compute", "send": us / fraction}}; ``die_busy``:
    {expert die: fraction of the window in which any of its streams works}; ``cube_utilization``: CUBE pipe busy
    / (compute AICs x expert dies x window). ``out[l][i]``: [B, H] bf16 output of attention die i (numeric runs).
    ``rounds_us``: {(expert die, stream): [R, 2] first start and last end of each round over the stream's cores}."""
    run: RunResult
    modeled_us: float
    window_us: float
    layer_us: list
    exchange_us: np.ndarray
    stream_busy_us: dict
    stream_busy: dict
    die_busy: dict
    cube_utilization: float
    out: list | None
    rounds_us: dict = dataclasses.field(default_factory=dict)

    @property
    def expert_busy(self) -> float:
        """Mean over expert dies of ``die_busy``: the expert-die busy fraction."""
        return float(np.mean(list(self.die_busy.values())))

    def mean_stream_busy(self, stream: str) -> float:
        return float(np.mean([v[stream] for v in self.stream_busy.values()]))

    def summary(self) -> str:
        return (f"modeled {self.modeled_us:.1f} us, window {self.window_us:.1f} us, expert busy "
                f"{self.expert_busy:.1%} (recv {self.mean_stream_busy('recv'):.1%}, compute "
                f"{self.mean_stream_busy('compute'):.1%}, send {self.mean_stream_busy('send'):.1%}), cube "
                f"{self.cube_utilization:.1%}, per layer " + ", ".join(f"{t:.1f}" for t in self.layer_us) + " us")


class ExpertPipeline:
    """Disaggregated MoE layers on persistent expert kernels (module docstring).

    ``domains``: lists of attention dies, one per DP domain (equal sizes A); ``expert_dies``: E dies holding
    ``num_experts / E`` experts each (contiguous); ``hidden`` H (multiple of 16); ``num_microbatches`` M;
    ``trampoline``: xccl.a2e forwarding through ``min(A, E)`` trampolines, else direct; ``split``: cores per
    expert-die stream; ``attn_cores``: AIVs per microbatch on an attention die (default 48 // M)."""

    def __init__(self, pod: Pod, domains, expert_dies, *, num_experts: int, hidden: int, num_microbatches: int = 2,
                 trampoline: bool = True, split: StreamSplit = StreamSplit(), attn_cores: int | None = None,
                 num_slots: int = 2, mode: str = "graph"):
        prof = pod.profile
        domains = [pod.check_dies(dom, f"domains[{i}]") for i, dom in enumerate(domains)]
        expert_dies = pod.check_dies(expert_dies, "expert_dies")
        if not domains or not domains[0] or len({len(d) for d in domains}) != 1:
            raise ArgumentError(f"domains: {len(domains)} DP domains of sizes {[len(d) for d in domains]}; need "
                                f"one or more non-empty domains of equal size")
        every = [d for dom in domains for d in dom] + expert_dies
        if not expert_dies or len(set(every)) != len(every):
            raise ArgumentError("domains and expert_dies must be distinct dies, with at least one expert die")
        if num_experts < len(expert_dies) or num_experts % len(expert_dies):
            raise ArgumentError(f"num_experts={num_experts} must be a positive multiple of the "
                                f"{len(expert_dies)} expert dies")
        if hidden <= 0 or hidden % 16:
            raise ArgumentError(f"hidden={hidden}: must be a positive multiple of 16")
        if num_microbatches < 1:
            raise ArgumentError(f"num_microbatches={num_microbatches}: must be >= 1")
        if num_slots < 2:
            raise ArgumentError(f"num_slots={num_slots}: the expert dies need at least 2 buffer slots (double "
                                f"buffering)")
        if not isinstance(split, StreamSplit):
            raise ArgumentError(f"split={split!r}: pass a StreamSplit")
        if min(split.recv_aiv, split.send_aiv, split.aic) < 1 or \
                split.recv_aiv + split.send_aiv > prof.aiv_per_die or split.aic > prof.aic_per_die:
            raise ArgumentError(f"split={split}: receive + send AIVs must fit the die's {prof.aiv_per_die} AIVs "
                                f"and compute AICs its {prof.aic_per_die} AICs (each at least 1)")
        attn_cores = prof.aiv_per_die // num_microbatches if attn_cores is None else int(attn_cores)
        if not 1 <= attn_cores * num_microbatches <= prof.aiv_per_die:
            raise ArgumentError(f"attn_cores={attn_cores} x num_microbatches={num_microbatches} AIVs: an attention "
                                f"die has {prof.aiv_per_die}")
        self.pod, self.domains, self.expert_dies = pod, domains, expert_dies
        self.num_experts, self.hidden, self.num_microbatches = num_experts, hidden, num_microbatches
        self.split, self.attn_cores, self.num_slots, self.mode = split, attn_cores, num_slots, mode
        self.groups = plan_groups(len(domains[0]), len(expert_dies), trampoline)

    @property
    def attention_dies(self) -> list:
        return [d for dom in self.domains for d in dom]

    # ------------------------------------------------------------------ inputs
    def _check_inputs(self, topk_ids, topk_weights, x, weights, numeric):
        n_attn = len(self.attention_dies)
        if len(topk_ids) < 1 or len(topk_weights) != len(topk_ids):
            raise ArgumentError(f"topk_ids / topk_weights: {len(topk_ids)} / {len(topk_weights)} layers; need the "
                                f"same number, at least 1")
        ids = [[np.asarray(a, np.int64) for a in layer] for layer in topk_ids]
        ws = [[_host(w, np.float32) for w in layer] for layer in topk_weights]
        if any(len(layer) != n_attn for layer in ids) or any(len(layer) != n_attn for layer in ws):
            raise ArgumentError(f"topk_ids / topk_weights: every layer needs one [B, K] array per attention die "
                                f"({n_attn})")
        B = ids[0][0].shape[0]
        if B < self.num_microbatches or B % self.num_microbatches:
            raise ArgumentError(f"batch B={B} per attention die must be a positive multiple of "
                                f"num_microbatches={self.num_microbatches}")
        if numeric:
            H, E = self.hidden, self.num_experts
            if x is None or weights is None:
                raise ArgumentError("x and weights are required in numeric runs (numeric=False times only)")
            x = [[_host(a, ml_dtypes.bfloat16) for a in layer] for layer in x]
            if len(x) != len(ids) or any(len(layer) != n_attn for layer in x) or \
                    any(a.shape != (B, H) for layer in x for a in layer):
                raise ArgumentError(f"x: need [{len(ids)} layers][{n_attn} attention dies] arrays of [B={B}, "
                                    f"H={H}]")
            weights = _host(weights, ml_dtypes.bfloat16)
            if weights.shape != (E, H, H):
                raise ArgumentError(f"weights: need [num_experts={E}, H={H}, H={H}], got {weights.shape}")
        return ids, ws, x, weights, B

    # ------------------------------------------------------------------ the run
    def run(self, topk_ids, topk_weights, *, x=None, weights=None, numeric: bool = True,
            attn_us: float = 0.0) -> PipelineResult:
        """Run every layer through the pipeline. ``topk_ids[l][i]`` [B, K] int expert ids (-1 masked) and
        ``topk_weights[l][i]`` [B, K] fp32 of attention die i (domain-major order) at layer l; ``x[l][i]`` [B, H]
        bf16 hidden states and ``weights`` [num_experts, H, H] bf16 (numeric runs; None with numeric=False).
        ``attn_us``: modeled attention time per layer of one die's whole batch (a microbatch takes its share)."""
        if attn_us < 0:
            raise ArgumentError(f"attn_us={attn_us}: must be >= 0")
        ids, ws, x, weights, B = self._check_inputs(topk_ids, topk_weights, x, weights, numeric)
        pod, M, sp = self.pod, self.num_microbatches, self.split
        D, A, L = len(self.domains), len(self.domains[0]), len(ids)
        Bm = B // M
        keys = [(l, d, m) for l in range(L) for d in range(D) for m in range(M)]
        plans = [plan_domain([ids[l][d * A + a][m * Bm:(m + 1) * Bm] for a in range(A)],
                             [ws[l][d * A + a][m * Bm:(m + 1) * Bm] for a in range(A)],
                             self.num_experts, len(self.expert_dies), self.groups) for l, d, m in keys]
        pipe = self._areas(plans, numeric, weights)
        pipe.attn_cycles = int(round(attn_us * Bm / B * 1000 * pod.profile.clock_ghz))
        tiles_so_far = [0] * len(self.expert_dies)
        for r, (key, plan) in enumerate(zip(keys, plans)):
            l, d, m = key
            xs = None if x is None else [x[l][d * A + a][m * Bm:(m + 1) * Bm] for a in range(A)]
            rd = self._round(pipe, r, key, plan, [ids[l][d * A + a][m * Bm:(m + 1) * Bm] for a in range(A)], xs,
                             tiles_so_far, numeric)
            pipe.rounds.append(rd)
            pipe.attn_rounds.setdefault((d, m), []).append(rd)
        # three persistent kernels per expert die, one per (domain, microbatch) on the attention dies
        kw = dict(numeric=numeric, persistent=True)
        for dd in self.expert_dies:
            pod.stream(dd, aiv=list(range(sp.recv_aiv)), mode=self.mode).launch(
                receive_kernel, (pipe,), name=f"pipe.recv{dd}", **kw)
            pod.stream(dd, aic=list(range(sp.aic)), mode=self.mode).launch(
                compute_kernel, (pipe,), name=f"pipe.compute{dd}", **kw)
            pod.stream(dd, aiv=list(range(sp.recv_aiv, sp.recv_aiv + sp.send_aiv)), mode=self.mode).launch(
                send_kernel, (pipe,), name=f"pipe.send{dd}", **kw)
        c = self.attn_cores
        for d in range(D):
            for m in range(M):
                pod.stream(dies=self.domains[d], aiv=list(range(m * c, (m + 1) * c)), mode=self.mode).launch(
                    attention_kernel, (pipe, d, m), name=f"pipe.attn.d{d}.m{m}", **kw)
        run = pod.synchronize()
        if run.parked:
            blocked = pod.blocked()
            raise DeadlockError(f"expert pipeline stalled: launches {run.parked} never finished; blocked cores:\n  "
                                + "\n  ".join(blocked[:16]), blocked)
        out = None
        if numeric:
            out = [[np.concatenate([pipe.attn_rounds[d, m][l].attn_roles[dd]["y"].numpy() for m in range(M)])
                    for d in range(D) for dd in self.domains[d]] for l in range(L)]
        return _result(run, pipe, self.expert_dies, sp, (L, D, M), out)

    def _areas(self, plans, numeric: bool, weights) -> _Pipe:
        """Allocate the run's GM (slots sized by the largest round) and the context the kernels read."""
        pod, H, M, S = self.pod, self.hidden, self.num_microbatches, self.num_slots
        groups, edies = self.groups, self.expert_dies
        A, E, T = len(self.domains[0]), len(edies), len(groups)
        epd = self.num_experts // E
        ph = not numeric
        cap_g = [max(max(p.rows_g[g] for p in plans), 1) for g in range(T)]
        cap_e = [max(max(int(p.rows_e[e]) for p in plans), 1) for e in range(E)]
        cap_w = max(max(p.win_rows) for p in plans)
        ub = pod.profile.ub_bytes - UB_SPARE
        pipe = _Pipe(hidden=H, split=self.split, expert_index={dd: e for e, dd in enumerate(edies)},
                     tramp_die=[edies[members[0]] for members in groups], cap_g=cap_g, cap_w=cap_w,
                     perm_rows=fit_rows(2 * H * 2 + 16, ub // 2, MAX_TILE_ROWS))

        def data(dd, shape, dtype, name):
            return pod.alloc(dd, shape, dtype, phantom=ph, name=f"pipe.{name}{dd}")
        for dd in edies:
            pipe.ctl[dd] = pod.alloc(dd, (5, S, 8), "int32", name=f"pipe.ctl{dd}")
            pipe.s2[dd] = pod.alloc(dd, (S, 8), "int32", name=f"pipe.s2{dd}")
        for g, members in enumerate(groups):
            dd = pipe.tramp_die[g]
            pipe.s1[dd] = pod.alloc(dd, (S, A, 8), "int32", name=f"pipe.s1{dd}")
            pipe.s3[dd] = pod.alloc(dd, (S, max(len(members) - 1, 1), 8), "int32", name=f"pipe.s3{dd}")
            pipe.gbuf[dd] = data(dd, (S, cap_g[g], H), "bf16", "gbuf")
            pipe.gw[dd] = write_pad_row(data(dd, (S, cap_g[g] + 1, 1), "fp32", "gw"))
            pipe.gw2[dd] = write_pad_row(data(dd, (S, cap_g[g] + 1, 1), "fp32", "gw2"))
            pipe.outg[dd] = write_pad_row(data(dd, (S, cap_g[g] + 1, H), "bf16", "outg"))
        for e, dd in enumerate(edies):
            pipe.xem[dd] = data(dd, (S, cap_e[e], H), "bf16", "xem")
            if dd not in pipe.s1:
                pipe.inp[dd] = data(dd, (S, cap_e[e], H), "bf16", "in")
                pipe.out[dd] = data(dd, (S, cap_e[e], H), "bf16", "out")
            pipe.w[dd] = (pod.to_gm(dd, weights[e * epd:(e + 1) * epd], name=f"pipe.w{dd}") if numeric else
                          pod.alloc(dd, (epd, H, H), "bf16", phantom=True, name=f"pipe.w{dd}"))
        one = np.ones((cap_w + 1, 1), np.float32)
        one[-1] = 0.0                                          # the pad row of a window sums to nothing
        for dd in self.attention_dies:
            pipe.s4[dd] = pod.alloc(dd, (M, T, 8), "int32", name=f"pipe.s4{dd}")
            for m in range(M):
                pipe.win[dd, m] = write_pad_row(data(dd, (cap_w + 1, H), "bf16", "win"))
                pipe.ones[dd, m] = (pod.to_gm(dd, one, name=f"pipe.ones{dd}") if numeric else
                                    pod.alloc(dd, one.shape, "fp32", phantom=True, name=f"pipe.ones{dd}"))
        return pipe

    def _round(self, pipe: _Pipe, r: int, key, plan, ids, xs, tiles_so_far: list, numeric: bool) -> _Round:
        """Round r's xccl.a2e jobs on slot r % S, every die's role, and the expert-major reorder of its rows.
        ``ids``/``xs``: the round's [B/M, K] routing / [B/M, H] rows per attention rank of the domain."""
        pod, H, S, sp, groups = self.pod, self.hidden, self.num_slots, self.split, self.groups
        prof = pod.profile
        l, d, m = key
        s, dies, edies = r % S, self.domains[d], self.expert_dies
        A, T = len(dies), len(groups)
        ub = prof.ub_bytes - UB_SPARE
        perm, ends, group_perm, plan_e2a = _expert_major(plan, ids, self.num_experts // len(edies), pipe)
        rows = [plan.region[int(plan.group_of[e])][e][1] for e in range(len(edies))]
        ja = Job(plan=plan, round=2 * r + 1, path="mtu", hidden=H, groups=groups, attn_dies=dies, roles={})
        ja.send_rows = fit_rows(2 * (H * 2 + 8), ub // 2, plan.B * plan.K)     # half the UB: E2A tiles take the rest
        ja.fwd_rows = fit_rows(2 * H * 2, ub // 2, MAX_TILE_ROWS)               # half: the reorder tiles take the rest
        je = Job(plan=plan_e2a, round=2 * r + 2, path="mtu", hidden=H, groups=groups, attn_dies=dies, roles={})
        je.fwd_rows = fit_rows(2 * H * 2, ub, MAX_TILE_ROWS)
        for g in range(T):
            dd = pipe.tramp_die[g]
            ja.gbuf.append(pipe.gbuf[dd][s])
            ja.gw.append(pipe.gw[dd][s])
            ja.s1.append(pipe.s1[dd][s])
            je.outg.append(pipe.outg[dd][s])
            je.gw.append(pipe.gw2[dd][s])
            je.s3.append(pipe.s3[dd][s])
            je.red_tiling.append(reduce_tiling(H, plan.S[g], prof.ub_bytes))
        a2e_input, e2a_output = [], []
        for e, dd in enumerate(edies):
            if dd in pipe.s1:                                   # a trampoline: own rows first in its group buffer
                a2e_input.append(pipe.gbuf[dd][s, :rows[e]])
                e2a_output.append(pipe.outg[dd][s, :rows[e]])
                ja.s1_die[e] = pipe.s1[dd][s]
            else:
                ja.inp[e] = pipe.inp[dd][s, :rows[e]]
                je.out[e] = pipe.out[dd][s, :rows[e]]
                a2e_input.append(ja.inp[e])
                e2a_output.append(je.out[e])
            ja.s2[e] = pipe.s2[dd][s]
            ja.ctl[dd] = pipe.ctl[dd][C_JOIN_RECV, s]
            je.ctl[dd] = pipe.ctl[dd][C_JOIN_SEND, s]
        je.s4 = {dd: pipe.s4[dd][m] for dd in dies}
        je.win = [pipe.win[dd, m] for dd in dies]
        je.ones = [pipe.ones[dd, m] for dd in dies]
        je.fin_tiling = reduce_tiling(H, max(idx.shape[1] for idx in plan_e2a.fin_idx), prof.ub_bytes // 2)
        attn_roles = {}
        for a, dd in enumerate(dies):
            Bm = plan.B
            if numeric:
                xg = pod.to_gm(dd, xs[a], dtype="bf16", name=f"pipe.x{dd}")
                wsd = pod.to_gm(dd, plan.wsend[a].reshape(-1, 1) if plan.send_rows[a] else np.zeros((1, 1)),
                                dtype="fp32", name=f"pipe.wsend{dd}")
            else:
                xg = pod.alloc(dd, (Bm, H), "bf16", phantom=True, name=f"pipe.x{dd}")
                wsd = pod.alloc(dd, (max(plan.send_rows[a], 1), 1), "fp32", phantom=True, name=f"pipe.wsend{dd}")
            attn_roles[dd] = {"kind": "attn", "a": a, "x": xg, "wsend": wsd, "order": [(g + a * T // A) % T
                                                                                      for g in range(T)],
                              "y": pod.alloc(dd, (Bm, H), "bf16", phantom=not numeric, name=f"pipe.y{dd}")}
        expert_roles, send_roles = {}, {}
        for e, dd in enumerate(edies):
            g = int(plan.group_of[e])
            tramp = groups[g][0] == e
            expert_roles[dd] = {"kind": "expert", "e": e, "g": g, "tramp": tramp, "join": (r // S + 1) * sp.recv_aiv}
            send_roles[dd] = {"kind": "expert", "e": e, "g": g, "tramp": tramp, "partners": len(groups[g]) - 1,
                              "order": [(i + g * A // T) % A for i in range(A)], "join": (r // S + 1) * sp.send_aiv}
        tile_start = list(tiles_so_far)
        for e in range(len(edies)):
            tiles_so_far[e] += len(plan_tiles(ends[e], H, BASE_N))
        return _Round(idx=r, layer=l, domain=d, mb=m, slot=s, use=r // S, a2e=ja, e2a=je, attn_roles=attn_roles,
                      expert_roles=expert_roles, send_roles=send_roles, rows=rows, perm=perm, group_perm=group_perm,
                      ends=ends, tile_start=tile_start, a2e_input=a2e_input, e2a_output=e2a_output)


def _expert_major(plan, ids, epd: int, pipe: _Pipe):
    """Order each expert die's rows by local expert (stable) for the grouped GEMM. Returns (perm [E], ends [E],
    group_perm [T], E2A plan): perm[e][j] = A2E-layout row of expert-major row j; ends[e] the cumulative rows per
    local expert; group_perm the same over each group buffer; the E2A plan's gather indices point at the reordered
    rows, and its pads at the slot's zero rows (``cap_g`` of the group buffer, ``cap_w`` of the windows)."""
    perm, ends, new_pos = [], [], []
    for e in range(len(plan.group_of)):
        g = int(plan.group_of[e])
        r0, n = plan.region[g][e]
        rid = plan.row_id[g][r0:r0 + n]
        local = np.array([ids[a][t, k] for a, t, k in rid], np.int64).reshape(-1) - e * epd
        order = np.argsort(local, kind="stable")
        inv = np.empty(n, np.int64)
        inv[order] = np.arange(n)
        perm.append(order)
        ends.append(np.cumsum(np.bincount(local, minlength=epd)).tolist())
        new_pos.append(r0 + inv)
    group_perm, red = [], []
    for g, members in enumerate(plan.groups):
        pos = np.empty(plan.rows_g[g] + 1, np.int64)
        pos[-1] = pipe.cap_g[g]
        for e in members:
            r0, n = plan.region[g][e]
            pos[r0:r0 + n] = new_pos[e]
        group_perm.append(np.concatenate([plan.region[g][e][0] + perm[e] for e in members]))
        red.append([(toks, pos[idx]) for toks, idx in plan.red[g]])
    fin = [np.where(idx == plan.win_rows[a], pipe.cap_w, idx) for a, idx in enumerate(plan.fin_idx)]
    return perm, ends, group_perm, dataclasses.replace(plan, red=red, fin_idx=fin)


def _host(a, dtype):
    if hasattr(a, "detach"):                                     # torch tensor
        a = a.detach().float().numpy()
    return np.asarray(a).astype(dtype)


def _union_us(intervals) -> float:
    total, end = 0.0, -np.inf
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


def _result(run, pipe, edies, sp, shape, out) -> PipelineResult:
    """Busy times, spans and layer times from the kernels' (stream, die, round, start us, end us) log."""
    L, D, M = shape
    R = len(pipe.rounds)
    window = max(run.kernel_us, 1e-9)
    streams = ("recv", "compute", "send")
    per = {(kind, die): [] for die in edies for kind in streams}
    spans = {(die, kind): np.full((R, 2), np.nan) for die in edies for kind in streams}
    layer_end = np.zeros(L)
    exchange = np.zeros((L, D, M))
    t_first = np.inf
    for kind, die, r, t0, t1 in pipe.log:
        if kind == "start":
            t_first = min(t_first, t0)
        elif kind == "attn":
            rd = pipe.rounds[r]
            layer_end[rd.layer] = max(layer_end[rd.layer], t1)
            exchange[rd.layer, rd.domain, rd.mb] = max(exchange[rd.layer, rd.domain, rd.mb], t1 - t0)
        else:
            per[kind, die].append((t0, t1))
            span = spans[die, kind][r]
            span[0] = np.fmin(span[0], t0)                     # fmin / fmax skip the NaN of a fresh row
            span[1] = np.fmax(span[1], t1)
    busy_us = {die: {k: _union_us(per[k, die]) for k in streams} for die in edies}
    die_busy = {die: _union_us([iv for k in streams for iv in per[k, die]]) / window for die in edies}
    prev = np.concatenate([[t_first], layer_end[:-1]])
    cube = sum(us for (die, _, pipe_name), us in run.pipe_busy.items() if pipe_name == "CUBE" and die in busy_us)
    return PipelineResult(run=run, modeled_us=run.modeled_us, window_us=window,
                          layer_us=[float(t) for t in layer_end - prev], exchange_us=exchange,
                          stream_busy_us=busy_us,
                          stream_busy={die: {k: v / window for k, v in b.items()} for die, b in busy_us.items()},
                          die_busy=die_busy, cube_utilization=cube / (sp.aic * len(edies) * window), out=out,
                          rounds_us=spans)


def pipeline_reference(x, topk_ids, topk_weights, weights):
    """torch reference: ``out[l][i] [B, H]`` fp32 = sum_k w[t, k] * (x[t] @ W[ids[t, k]]) over unmasked k, in fp64
    from the bf16 inputs; also returns ``mag[l][i]`` = sum_k |w| |x W| (the scale of the bf16 rounding error)."""
    import torch
    W = torch.from_numpy(_host(weights, np.float64))
    out, mag = [], []
    for xl, il, wl in zip(x, topk_ids, topk_weights):
        ol, ml = [], []
        for xa, ia, wa in zip(xl, il, wl):
            xt = torch.from_numpy(_host(xa, ml_dtypes.bfloat16).astype(np.float64))
            ia = np.asarray(ia, np.int64)
            wt = torch.from_numpy(np.where(ia >= 0, _host(wa, np.float32), 0).astype(np.float64))
            y = torch.einsum("th,tkhn->tkn", xt, W[torch.from_numpy(np.maximum(ia, 0))])
            ol.append((wt[..., None] * y).sum(1).numpy())
            ml.append((wt.abs()[..., None] * y.abs()).sum(1).numpy())
        out.append(ol)
        mag.append(ml)
    return out, mag
