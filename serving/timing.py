"""Timing-only DeepSeek-V3 decode step on an emulated CloudMatrix384 pod (issue #9): modeled TPOT and tokens/s.

    t = decode_step_timing(V3, dies=32, batch_per_die=96, seq_len=4096, microbatches=2, mtp=1)
    t.tpot_ms, t.tokens_per_s_per_die, t.per_layer_us, t.breakdown_us

Deployment: each die is one data-parallel attention rank (its own ``batch_per_die`` sequences, MLA weights
replicated) and one expert-parallel rank (``n_routed_experts / dies`` routed experts; the shared expert is computed
locally on every die). Every kernel runs timing-only (phantom GM, real control data) on its real V3 shape.

One layer, per microbatch of ``b`` sequences x ``S = 1 + mtp`` query tokens (T = b * S tokens):
  attention stream: MLAProlog (int8 W_uq_qr when ``quant``) -> decode attention over the latent cache
                    (``seq_len`` tokens, int8 cache with ``kv_int8``) -> W_uv per head (bf16 grouped GEMM, one
                    group per head) -> o_proj (dynamic quant + int8 single-group GEMM, or bf16)
  MoE stream:       router GEMM (bf16, [T, H] x [H, E]) -> gating top-k -> FusedDispatch (INT8 records with
                    ``quant``) -> routed experts (grouped GEMM gate_up + SwiGLU, dynamic quant, grouped GEMM down)
                    -> shared expert (the same on [T, H], one group) -> FusedCombine (+ the shared output)
  dense layers replace the MoE stream by the dense SwiGLU FFN (intermediate_size), computed locally.
``microbatches=1``: one stream on the whole die (24 AIC + 48 AIV), the ops one after the other.
``microbatches=2``: the batch splits in two halves; the attention stream (AIC 8..23 with their AIVs 16..47 by
default) and the MoE stream (AIC 0..7, AIV 0..15) run concurrently on disjoint cores of the same die, so HBM
contention between them is modeled: attention of microbatch i overlaps the MoE part of microbatch i - 1.
Dependencies: MoE(i, L) after attention(i, L); attention(i, L + 1) after MoE(i, L) (the combine on die 0).

Step composition (timing each distinct layer shape once; all MoE layers are alike, all dense layers alike):
    step = fill + dense_layers x P_dense + moe_layers x P_moe + lm_head (+ MTP module)
where P is the steady-state per-layer period and fill = first dense layer's latency - P_dense (pipeline fill and
drain, paid once per step). With two microbatches ``sim_layers`` (2) consecutive layers plus the attention part of
the next one run in one pod (so the last layer's MoE meets the traffic it meets in steady state); P is the larger
of the spacing of the last two layers' ends and each stream's busy time (kernels + launch overheads) in the last
layer: two layers do not reach steady state when one stream is much busier than the other. With one microbatch
the layer runs serially and one layer is simulated. V3: 3 dense + 58 MoE layers. With ``mtp=1`` the main model
verifies 2 tokens per sequence (S = 2), then the MTP module drafts the next: eh_proj ([b, 2H] x [2H, H]) + one MoE
decoder layer on b tokens (latency of one layer alone, pipeline fill included) + lm_head on b tokens. Accepted
tokens per step = 1 + mtp x ``acceptance``; default 0.85, the low end of the 85-90 % second-token acceptance
DeepSeek-V3 reports (technical report, section 5.4.3). TPOT = step / accepted tokens per step.

modeled as: compute runs on die 0 only; every DP rank has the same batch and context, and routing is balanced
(token t of rank r, choice k -> expert ((r T + t) K + k) mod E: every expert receives the same number of rows, the
EPLB ideal), so all dies do the same work at the same time. The other dies run only their FusedDispatch /
FusedCombine kernels (all dies take part in the exchange), released by die 0's events (its gating, its last
expert GEMM): their kernels see an idle HBM, die 0's see the attention stream's traffic. Mirror dies start their
exchange one graph-launch overhead (2 us) before die 0.
What the model says about two microbatches: they pay when the die has idle phases to fill (the MoE exchange's
latency, single-tile GEMMs) and spare HBM bandwidth; each microbatch re-reads every weight (MLAProlog, o_proj,
router, experts). With the current kernels V3 at 16-64 dies, 96 sequences x 4K, is HBM-bound (the attention
kernel alone keeps HBM ~99 % busy for ~1.7 ms per layer, 2.7 GB of which ~0.5 GB is compulsory, with 16 AICs as
with 24), so one microbatch is faster there; two are faster when attention time and exchange latency are
comparable and HBM is not saturated (tests: the mini shapes at 8K context).
modeled as: graph-mode launches (decode is a captured graph). Not modeled: input / post-attention RMSNorm,
residual adds, embedding lookup, sampling (vector work on [T, H], a few us per layer), the L2 cache (the kernels'
GM workspaces round-trip through HBM: the attention kernel moves ~5x its compulsory bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ascend_emu import HardwareProfile, Pod, cloudmatrix384
from ascend_emu.errors import ArgumentError
from ascend_emu.profile import load_profile
from kernels.roofline import Work, attention_work, combine, gemm_work

from .config import V3, ModelConfig

PS_PER_US = 1_000_000
CACHE_MODE = "PA_NZ"           # latent / rope cache layout, written by MLAProlog and read by attention (128 pages)
DEFAULT_ACCEPTANCE = 0.85      # DeepSeek-V3 report: 85-90 % acceptance of the second (MTP) token


@dataclass(frozen=True)
class CoreSplit:
    """Cores of a die given to the MoE stream with two microbatches: AIC 0 .. moe_aic-1 with their AIVs
    0 .. 2 moe_aic - 1; the attention stream gets the rest (CloudMatrix-Infer: 16 AIC + 32 AIV attention,
    8 AIC + 16 AIV MoE)."""
    moe_aic: int = 8

    def __post_init__(self):
        if not 1 <= self.moe_aic <= 23:
            raise ArgumentError(f"moe_aic={self.moe_aic} out of range 1..23 (the attention stream needs AICs too)")


# ============================================================================================ lanes
class _Lane:
    """One serving stream of one die and what was queued on it. Ops are queued through the kernels' own
    ``stream=`` / ``after=`` arguments (each returns a ``kernels.ranks.Pending``) on the lane's ``stream``, so they
    run on its cores, in order; an op waits for the launches in ``after`` (taken by its first launch). The whole
    schedule runs in one ``Pod.synchronize`` at the end. ``log`` keeps (tag, Launch) for the figures, ``work``
    each op's roofline work; ``aic`` / ``aiv``: the stream's core counts."""

    def __init__(self, stream):
        self.stream = stream
        self.pod, self.die = stream.pod, stream.dies[0]
        self.aic, self.aiv = len(stream.aic), len(stream.aiv)
        self.after: list = []
        self.log: list = []
        self.work: list = []          # (index into log where the op's launches start, tag, kernels.roofline.Work)

    def note(self, tag: str, work) -> None:
        """What the op about to be queued under ``tag`` must do at least (its roofline's FLOPs and bytes)."""
        self.work.append((len(self.log), tag, work))

    def take_after(self) -> list:
        """The launches the next op waits for (then none)."""
        after, self.after = self.after, []
        return after

    def add(self, tag: str, launches) -> None:
        self.log.extend((tag, la) for la in launches)

    def queue(self, tag: str, pending):
        """Log the launches of an op queued with ``stream=self.stream`` (a ``Pending``); returns it."""
        self.add(tag, pending.launches)
        return pending

    @property
    def last(self):
        return self.log[-1][1]


# ============================================================================================ one layer's ops
def _meta(*shape, dtype):
    import torch
    return torch.empty(*shape, dtype=dtype, device="meta")


def _gemm(lane, tag, rows_per_group, k: int, n: int, *, int8: bool, swiglu: bool = False, cores: int):
    """Grouped GEMM (one group per entry of rows_per_group), timing-only, NZ weights; int8 with per-channel and
    per-token scales (the epilogue path), bf16 otherwise."""
    import torch
    from kernels.grouped_matmul import grouped_matmul
    m = int(sum(rows_per_group))
    dt = torch.int8 if int8 else torch.bfloat16
    kw = {}
    if int8:
        kw = {"scale": _meta(len(rows_per_group), n, dtype=torch.float32),
              "per_token_scale": _meta(m, dtype=torch.float32)}
    ends = torch.from_numpy(np.cumsum(np.asarray(rows_per_group, dtype=np.int64)))
    lane.note(tag, gemm_work(m=m, k=k, n=n, dtype="int8" if int8 else "bf16", groups=len(rows_per_group),
                             swiglu=swiglu, per_token_scale=int8, channel_scale=int8))
    lane.queue(tag, grouped_matmul(_meta(m, k, dtype=dt), _meta(len(rows_per_group), k, n, dtype=dt),
                                   group_list=ends, swiglu=swiglu, weight_format="NZ", numeric=False, cores=cores,
                                   stream=lane.stream, after=lane.take_after(), **kw))


def _quant(lane, tag, rows: int, h: int, cores: int):
    import torch
    from kernels.dynamic_quant import dynamic_quant
    # per-token absmax, scale, round: about 3 fp32 operations per element
    lane.note(tag, Work(vector_flops=3.0 * rows * h, read_bytes=rows * h * 2, write_bytes=rows * (h + 4)))
    lane.queue(tag, dynamic_quant(_meta(rows, h, dtype=torch.bfloat16), numeric=False, cores=cores,
                                  stream=lane.stream, after=lane.take_after()))


def _linear(lane, tag, rows: int, k: int, n: int, *, quant: bool, swiglu: bool, aic: int):
    """A local linear layer on ``rows`` tokens: (dynamic quant +) one-group GEMM."""
    if quant:
        _quant(lane, tag, rows, k, 2 * aic)
    _gemm(lane, tag, [rows], k, n, int8=quant, swiglu=swiglu, cores=aic)


def _swiglu_ffn(lane, tag, rows_per_group, h: int, inter: int, *, quant: bool, aic: int):
    """gate_up (+SwiGLU) then down over the groups (experts): [rows, H] -> [rows, I] -> [rows, H]."""
    m = int(sum(rows_per_group))
    if quant:
        _quant(lane, tag, m, h, 2 * aic)
    _gemm(lane, tag, rows_per_group, h, 2 * inter, int8=quant, swiglu=True, cores=aic)
    if quant:
        _quant(lane, tag, m, inter, 2 * aic)
    _gemm(lane, tag, rows_per_group, inter, h, int8=quant, cores=aic)


def _attention_ops(lane, cfg: ModelConfig, b: int, s: int, seq_len: int, *, quant: bool, kv_int8: bool, aic: int):
    """MLAProlog -> decode attention -> W_uv per head -> o_proj, queued on the attention lane."""
    from kernels.attention import mla_decode_attention_timing
    from kernels.mla import mla_prolog_timing
    t = b * s
    n, hckv = cfg.num_attention_heads, cfg.kv_lora_rank
    for work in _prolog_work(cfg, t, quant=quant, kv_int8=kv_int8):
        lane.note("mla_prolog", work)
    lane.queue("mla_prolog", mla_prolog_timing(
        t, he=cfg.hidden_size, hcq=cfg.q_lora_rank, hckv=hckv, n=n, d=cfg.qk_nope_head_dim,
        dr=cfg.qk_rope_head_dim, weight_quant_mode=prolog_quant_mode(cfg, quant), kv_cache_quant_mode=int(kv_int8),
        cache_mode=CACHE_MODE, aic=aic, stream=lane.stream, after=lane.take_after()))
    lane.note("attention", attention_work(seq_lens=[seq_len] * b, s=s, n=n, hckv=hckv, dr=cfg.qk_rope_head_dim,
                                          kv_int8=kv_int8))
    lane.queue("attention", mla_decode_attention_timing(
        b, seq_len, heads=n, mtp=s - 1, hckv=hckv, dr=cfg.qk_rope_head_dim, kv_int8=kv_int8, cache_mode=CACHE_MODE,
        aic=aic, stream=lane.stream, after=lane.take_after()))
    # absorbed V up-projection: per head h, out[:, h] @ W_uv[h] ([T, Hckv] x [Hckv, Dv]): one group per head
    _gemm(lane, "attn_v_up", [t] * n, hckv, cfg.v_head_dim, int8=False, cores=aic)
    _linear(lane, "o_proj", t, n * cfg.v_head_dim, cfg.hidden_size, quant=quant, swiglu=False, aic=aic)


def _prolog_work(cfg: ModelConfig, t: int, *, quant: bool, kv_int8: bool) -> list:
    """MLAProlog's work: W_uq_qr (int8 in weight_quant_mode 1) apart from the bf16 GEMMs; the caches' rows and the
    queries written once; RMSNorm / RoPE as vector work (about 8 fp32 operations per element normalised)."""
    h, hcq, hckv, dr, n = (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                           cfg.num_attention_heads)
    uq = "int8" if prolog_quant_mode(cfg, quant) else "bf16"
    uq_cols = n * cfg.qk_head_dim
    down = Work(cube_flops=2.0 * t * (h * (hcq + hckv + dr) + n * cfg.qk_nope_head_dim * hckv), cube_dtype="bf16",
                vector_flops=8.0 * t * (hcq + hckv + dr + n * dr),
                read_bytes=t * h * 2 + h * (hcq + hckv + dr) * 2 + n * cfg.qk_nope_head_dim * hckv * 2,
                write_bytes=t * n * (hckv + dr) * 2 + t * (hckv * (1 if kv_int8 else 2) + dr * 2))
    up = Work(cube_flops=2.0 * t * hcq * uq_cols, cube_dtype=uq,
              read_bytes=hcq * uq_cols * (1 if uq == "int8" else 2))
    return [down, up]


def prolog_quant_mode(cfg: ModelConfig, quant: bool) -> int:
    """MLAProlog weight_quant_mode: 1 (int8 W_uq_qr, c_q re-quantised per token) with ``quant``, else 0. An int8
    NZ W_uq_qr is split over the AICs by heads, so a head's (nope + rope) columns must fill whole 32-column int8
    fractals: V3's 192 do; the mini config's 48 do not, and its prolog stays bf16."""
    return 1 if quant and cfg.qk_head_dim % 32 == 0 else 0


def balanced_routing(dies: int, tokens: int, topk: int, experts: int) -> list:
    """expert ids [tokens, topk] per rank: ((r T + t) K + k) mod E: distinct experts per token, every expert the
    same number of rows when dies x tokens x topk is a multiple of E."""
    base = np.arange(tokens * topk, dtype=np.int64).reshape(tokens, topk)
    return [(r * tokens * topk + base) % experts for r in range(dies)]


def _moe_ops(lane, mirrors: dict, group, cfg: ModelConfig, t: int, *, quant: bool, aic: int):
    """router -> gating -> FusedDispatch -> routed experts -> shared expert -> FusedCombine, on die 0's MoE lane;
    the other dies (``mirrors``) queue only their dispatch / combine, released by die 0's events."""
    import torch
    from kernels.fused_moe import launch_combine, launch_dispatch
    from kernels.gating import moe_gating_top_k
    h, e, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    _gemm(lane, "router", [t], h, e, int8=False, cores=aic)
    lane.note("gating", Work(vector_flops=10.0 * t * e, read_bytes=t * e * 4 + e * 4, write_bytes=t * k * 8))
    lane.queue("gating", moe_gating_top_k(
        _meta(t, e, dtype=torch.float32), k, bias=_meta(e, dtype=torch.float32), k_group=cfg.topk_group,
        group_count=cfg.n_group, group_select_mode=1, routed_scaling_factor=cfg.routed_scaling_factor,
        numeric=False, cores=2 * aic, stream=lane.stream, after=lane.take_after()))
    gate = lane.last
    ids = balanced_routing(group.size, t, k, e)
    # modeled as: every routed row leaves the die (EP ranks >> 1), int8 records with their scale, or bf16
    row = h + 4 if quant else 2 * h
    lane.note("dispatch", Work(read_bytes=t * h * 2, write_bytes=t * k * row, fabric_bytes=t * k * row))
    pending = launch_dispatch(None, ids, group, numeric=False,
                              after={0: lane.take_after(), **{d: [gate] for d in mirrors}})
    for d, m in [(0, lane), *mirrors.items()]:
        m.add("dispatch", [pending["launches"][d]])
    counts = sum(p.counts[0] for p in pending["plans"])               # rows per local expert on die 0
    if quant:
        _routed_int8(lane, counts, cfg, aic)
    else:
        _swiglu_ffn(lane, "routed_experts", [int(c) for c in counts], h, cfg.moe_intermediate_size, quant=False,
                    aic=aic)
    _swiglu_ffn(lane, "shared_expert", [t], h, cfg.moe_intermediate_size * cfg.n_shared_experts, quant=quant,
                aic=aic)
    before = lane.last
    lane.note("combine", Work(vector_flops=2.0 * t * k * h, read_bytes=t * k * h * 2 + t * h * 2,
                              write_bytes=t * h * 2, fabric_bytes=t * k * h * 2))
    shared = [group.pod.alloc(d, (t, h), "bf16", phantom=True, name=f"shared_out{d}") for d in group.dies]
    weights = [np.ones((t, k), np.float32)] * group.size
    launch_combine(None, pending, weights, group, shared_expert_x=shared, numeric=False,
                   after={0: lane.take_after(), **{d: [before] for d in mirrors}})
    for d, m in [(0, lane), *mirrors.items()]:
        m.add("combine", [pending["combine_launches"][d]])


def _routed_int8(lane, counts, cfg: ModelConfig, aic: int):
    """Routed experts on INT8 dispatch output (rows and per-token scales arrive quantised): gate_up + SwiGLU,
    re-quantise, down."""
    rows = [int(c) for c in counts]
    m, h, inter = sum(rows), cfg.hidden_size, cfg.moe_intermediate_size
    _gemm(lane, "routed_experts", rows, h, 2 * inter, int8=True, swiglu=True, cores=aic)
    _quant(lane, "routed_experts", m, inter, 2 * aic)
    _gemm(lane, "routed_experts", rows, inter, h, int8=True, cores=aic)


# ============================================================================================ layer runs
@dataclass
class LayerTiming:
    """One layer kind simulated over ``sim_layers`` consecutive layers in one pod run.

    ``period_us``: steady-state per-layer latency: the larger of the spacing of the last two layers' ends and each
    stream's busy time in the last layer (``stream_busy_us``; ``bound`` says which); the single layer's latency
    when sim_layers = 1. ``first_layer_us``: from the host's submit to the end of the first layer.
    ``breakdown_us``: per op, kernel time summed over the microbatches of the last simulated layer (launch start
    to end, contention and waits included; with two microbatches ops overlap, so the sum exceeds the period).
    ``utilization``: die 0 over the whole run: hbm (busy fraction), busiest fabric port, and per pipe.
    ``roofline``: per op of ``breakdown_us``, its roofline on its stream's cores (``kernels.roofline``: compute,
    HBM, mover and fabric bounds of the op's FLOPs and compulsory bytes summed over the microbatches, which binds,
    and the ratio of the op's kernel time to it; ``hbm_bytes``: what the op's launches on die 0 made the HBMs move,
    from ``Launch.traffic``)."""
    kind: str
    microbatches: int
    tokens: int
    period_us: float
    first_layer_us: float
    breakdown_us: dict
    utilization: dict
    instructions: int
    bytes_moved: int
    sim_layers: int
    stream_busy_us: dict          # {"attention", "moe" | "ffn"}: per layer, kernel times + graph launch overheads
    bound: str                    # what sets the period: "pipeline", "<stream> stream" or "one layer"
    schedule: list = field(default_factory=list, repr=False)   # (layer, microbatch, op, start_us, end_us)
    run: object = field(default=None, repr=False)             # the pod run (RunResult)
    roofline: dict = field(default_factory=dict)              # per op: kernels.roofline.Roofline.to_dict()


def _check_common(cfg: ModelConfig, dies: int, batch: int, microbatches: int, mtp: int, seq_len: int):
    if not isinstance(dies, (int, np.integer)) or dies < 1 or cfg.n_routed_experts % dies:
        raise ArgumentError(f"dies={dies}: each die is one EP rank and must hold the same number of the "
                            f"{cfg.n_routed_experts} routed experts (use a divisor, e.g. 8, 16, 32, 64)")
    if microbatches not in (1, 2):
        raise ArgumentError(f"microbatches={microbatches}: use 1 or 2")
    if mtp not in (0, 1):
        raise ArgumentError(f"mtp={mtp}: use 0 or 1")
    if batch < microbatches:
        raise ArgumentError(f"batch_per_die={batch} must be at least microbatches={microbatches}")
    if seq_len < 1 + mtp:
        raise ArgumentError(f"seq_len={seq_len} must be at least the {1 + mtp} query tokens per sequence")


def layer_timing(config: ModelConfig = V3, kind: str = "moe", *, dies: int, batch_per_die: int = 96,
                 seq_len: int = 4096, microbatches: int = 2, query_tokens: int = 1, kv_int8: bool = False,
                 quant: bool = True, sim_layers: int | None = None, split: CoreSplit = CoreSplit(),
                 trace: bool = False, profile: HardwareProfile | None = None) -> LayerTiming:
    """Simulate ``sim_layers`` consecutive ``kind`` ("moe" or "dense") decoder layers of ``batch_per_die``
    sequences per die (``query_tokens`` = 1 + MTP depth each) on a pod of ``dies`` dies; see the module doc.

    ``sim_layers`` default: 1 with one microbatch (the layer runs serially: its latency is the period), 2 with
    two (plus the next layer's attention; the period is set as the module doc says). ``profile``: the hardware
    (default cloudmatrix384)."""
    cfg = config
    if query_tokens not in (1, 2):
        raise ArgumentError(f"query_tokens={query_tokens}: use 1, or 2 with one MTP draft token")
    _check_common(cfg, dies, batch_per_die, microbatches, query_tokens - 1, seq_len)
    if kind not in ("moe", "dense"):
        raise ArgumentError(f"kind={kind!r}: use 'moe' or 'dense'")
    if sim_layers is None:
        sim_layers = 1 if microbatches == 1 else 2
    if sim_layers < 1:
        raise ArgumentError(f"sim_layers={sim_layers} must be >= 1")
    from kernels.fused_moe import MoeGroup
    prof = load_profile(profile, max(dies, 2))
    pod = Pod(prof, trace=trace, max_modeled_us=None)
    s = query_tokens
    if microbatches == 1:
        whole = _Lane(pod.stream(0, mode="graph"))
        attn, moe = whole, whole
        attn_aic = moe_aic = prof.aic_per_die
    else:
        moe_aic = split.moe_aic
        attn_aic = prof.aic_per_die - moe_aic
        per = prof.aiv_per_aic
        attn = _Lane(pod.stream(0, aic=range(moe_aic, prof.aic_per_die),
                                aiv=range(per * moe_aic, prof.aiv_per_die), mode="graph"))
        moe = _Lane(pod.stream(0, aic=range(moe_aic), aiv=range(per * moe_aic), mode="graph"))
    mbs = [batch_per_die // microbatches + (i < batch_per_die % microbatches) for i in range(microbatches)]
    mirrors, group = {}, None
    if kind == "moe":
        moe_aiv = prof.aiv_per_aic * moe_aic
        mirrors = {d: _Lane(pod.stream(d, aiv=moe_aiv, mode="graph")) for d in range(1, dies)}
        # the group's per-die launches go to the serving streams
        group = MoeGroup(pod, range(dies), max_bs=max(mbs) * s, hidden=cfg.hidden_size,
                         topk=cfg.num_experts_per_tok, num_experts=cfg.n_routed_experts, quant=quant,
                         cores=moe_aiv, phantom=True, mode="graph",
                         streams={0: moe.stream, **{d: m.stream for d, m in mirrors.items()}})
    marks = []                          # (layer, microbatch, stream name, lane, log index from, to)
    last_moe = [None] * microbatches
    tail = microbatches > 1 and sim_layers > 1    # the next layer's attention, whose traffic the last MoE meets
    for layer in range(sim_layers + tail):
        attn_last = []
        for i, b in enumerate(mbs):
            start = len(attn.log)
            attn.after = [last_moe[i]] if last_moe[i] is not None else []
            _attention_ops(attn, cfg, b, s, seq_len, quant=quant, kv_int8=kv_int8, aic=attn_aic)
            marks.append((layer, i, "attention", attn, start, len(attn.log)))
            attn_last.append(attn.last)
        if layer == sim_layers:
            break
        for i, b in enumerate(mbs):
            start = len(moe.log)
            moe.after = [attn_last[i]]
            if kind == "moe":
                _moe_ops(moe, mirrors, group, cfg, b * s, quant=quant, aic=moe_aic)
            else:
                _swiglu_ffn(moe, "dense_ffn", [b * s], cfg.hidden_size, cfg.intermediate_size, quant=quant,
                            aic=moe_aic)
            marks.append((layer, i, "moe" if kind == "moe" else "ffn", moe, start, len(moe.log)))
            last_moe[i] = moe.last
    run = pod.synchronize()
    return _layer_figures(kind, microbatches, sum(mbs) * s, sim_layers, marks, run, prof)


def _die0_utilization(run, prof) -> dict:
    """Die 0 over the whole run (fill included): HBM busy fraction, the busiest fabric port (any die), and the
    busy fraction of the CUBE pipe (over the die's 24 AICs), VECTOR (48 AIVs) and MTE2 (all 72 cores)."""
    span = max(run.modeled_us, 1e-12)
    busy: dict = {}
    for (die, _, pipe), us in run.pipe_busy.items():
        if die == 0:
            busy[pipe] = busy.get(pipe, 0.0) + us
    port, port_util = run.busiest_port()
    n_aic, n_aiv = prof.aic_per_die, prof.aiv_per_die
    return {"hbm": run.servers.get("hbm0", {}).get("utilization", 0.0), "fabric_port": port_util,
            "fabric_port_name": port, "cube": busy.get("CUBE", 0.0) / (n_aic * span),
            "vector": busy.get("VECTOR", 0.0) / (n_aiv * span),
            "mte2": busy.get("MTE2", 0.0) / ((n_aic + n_aiv) * span)}


def _layer_figures(kind, microbatches, tokens, sim_layers, marks, run, prof) -> LayerTiming:
    us = lambda ps: ps / PS_PER_US
    ends = [0.0] * sim_layers
    schedule, breakdown, busy, hbm = [], {}, {}, {}
    works: dict = {}                                            # tag -> ([Work], lane) of the last layer
    launch_us = prof.launch_graph_us
    for layer, mb, stream, lane, lo, hi in marks:
        if layer == sim_layers - 1:
            for at, tag, work in lane.work:
                if lo <= at < hi:
                    works.setdefault(tag, ([], lane))[0].append(work)
        for tag, la in lane.log[lo:hi]:
            if la.end_ps is None:
                raise RuntimeError(f"launch {la.name} of layer {layer} did not finish (parked)")
            if layer == sim_layers:
                continue                                       # the tail: traffic only
            schedule.append((layer, mb, tag, us(la.start_ps), us(la.end_ps)))
            ends[layer] = max(ends[layer], us(la.end_ps))
            if layer == sim_layers - 1:
                breakdown[tag] = breakdown.get(tag, 0.0) + us(la.end_ps - la.start_ps)
                hbm[tag] = hbm.get(tag, 0) + la.traffic.hbm_bytes
                busy[stream] = busy.get(stream, 0.0) + us(la.end_ps - la.start_ps) + launch_us
    if sim_layers == 1:
        period, bound = ends[0], "one layer"
    else:
        # modeled as: a stream cannot run a layer's launches in less than their kernel times plus launch
        # overheads; a few simulated layers do not reach steady state when one stream is much busier (the next
        # layer's attention starts early while this layer's MoE still runs), so the period takes the larger
        spacing = ends[-1] - ends[-2]
        period, bound = max((spacing, "pipeline"), *((v, f"{k} stream") for k, v in sorted(busy.items())))
    util = _die0_utilization(run, prof)
    # an op's HBM bytes: what its own launches made die 0's and the other dies' HBMs move (Launch.traffic), so the
    # other stream's traffic in the same run is not counted
    roofline = {tag: combine(tag, prof, ws, modeled_us=breakdown[tag], kernel_us=breakdown[tag], aic=lane.aic,
                             aiv=lane.aiv, hbm_bytes=hbm[tag]).to_dict()
                for tag, (ws, lane) in works.items() if tag in breakdown}
    return LayerTiming(kind, microbatches, tokens, period, ends[0], breakdown, util, run.instructions,
                       run.bytes_moved, sim_layers, busy, bound, schedule, run, roofline)


def standalone_us(config: ModelConfig, op: str, tokens: int, *, quant: bool = True,
                  profile: HardwareProfile | None = None) -> float:
    """Modeled us of a local op alone on a whole die (graph launch included): "lm_head" ([T, H] x [H, vocab],
    bf16) or "eh_proj" (MTP's [T, 2H] x [2H, H])."""
    pod = Pod(load_profile(profile, 1), trace=False, max_modeled_us=None)
    lane = _Lane(pod.stream(0, mode="graph"))
    aic = pod.profile.aic_per_die
    h = config.hidden_size
    if op == "lm_head":
        # modeled as: bf16 lm_head, the full vocabulary on every die (DP attention ranks, no vocab parallelism)
        _gemm(lane, op, [tokens], h, config.vocab_size, int8=False, cores=aic)
    elif op == "eh_proj":
        _linear(lane, op, tokens, 2 * h, h, quant=quant, swiglu=False, aic=aic)
    else:
        raise ArgumentError(f"op={op!r}: use 'lm_head' or 'eh_proj'")
    pod.synchronize()
    return max(la.end_ps for _, la in lane.log) / PS_PER_US


# ============================================================================================ the decode step
@dataclass
class DecodeStepTiming:
    """Modeled figures of one decode step (us unless named otherwise); see the module doc for the composition."""
    config: str
    dies: int
    batch_per_die: int
    seq_len: int
    microbatches: int
    mtp: int
    acceptance: float
    kv_int8: bool
    quant: bool
    dense_layers: int
    moe_layers: int
    per_layer_us: dict            # {"dense": P_dense, "moe": P_moe}
    breakdown_us: dict            # {"dense": {op: us}, "moe": {op: us}} per layer
    fill_us: float
    lm_head_us: float
    mtp_us: float                 # eh_proj + MTP layer + draft lm_head (0 without MTP)
    step_us: float
    tokens_per_step: float        # accepted tokens per sequence per step
    utilization: dict             # {"dense": {...}, "moe": {...}} die 0 figures
    pipeline: dict                # {kind: {"bound": what sets the period, "stream_busy_us": {...}}}
    hbm_footprint_gib: float      # weights + KV cache per die
    layers: dict = field(default_factory=dict, repr=False)     # the LayerTiming objects
    hbm_capacity_gib: float = cloudmatrix384().hbm_bytes / 2 ** 30   # HBM per die of the profile
    dies_per_npu: int = cloudmatrix384().dies_per_chip                # dies of one NPU (chip) of the profile

    @property
    def tpot_ms(self) -> float:
        return self.step_us / self.tokens_per_step / 1000.0

    @property
    def tokens_per_s_per_die(self) -> float:
        return self.batch_per_die * self.tokens_per_step / (self.step_us * 1e-6)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_die * self.dies

    @property
    def tokens_per_s_per_npu(self) -> float:
        return self.tokens_per_s_per_die * self.dies_per_npu

    def to_dict(self) -> dict:
        return {"config": self.config, "dies": self.dies, "batch_per_die": self.batch_per_die,
                "seq_len": self.seq_len, "microbatches": self.microbatches, "mtp": self.mtp,
                "acceptance": self.acceptance, "kv_int8": self.kv_int8, "quant": self.quant,
                "dense_layers": self.dense_layers, "moe_layers": self.moe_layers,
                "modeled_tpot_ms": self.tpot_ms, "step_us": self.step_us, "tokens_per_step": self.tokens_per_step,
                "tokens_per_s_per_die": self.tokens_per_s_per_die, "tokens_per_s_per_npu": self.tokens_per_s_per_npu,
                "tokens_per_s": self.tokens_per_s,
                "per_layer_us": dict(self.per_layer_us), "breakdown_us": self.breakdown_us,
                "fill_us": self.fill_us, "lm_head_us": self.lm_head_us, "mtp_us": self.mtp_us,
                "utilization": self.utilization, "pipeline": self.pipeline,
                "hbm_footprint_gib": self.hbm_footprint_gib,
                "hbm_capacity_gib": self.hbm_capacity_gib,
                "roofline": {k: layer.roofline for k, layer in self.layers.items()}}


def hbm_footprint_gib(cfg: ModelConfig, dies: int, batch_per_die: int, seq_len: int, *, quant: bool,
                      kv_int8: bool, mtp: int) -> float:
    """Weights held by one die (MLA replicated, routed experts / dies + shared, dense FFNs, embedding + lm_head)
    plus its latent KV cache, in GiB."""
    wb = 1 if quant else 2
    h, n = cfg.hidden_size, cfg.num_attention_heads
    mla = (h * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
           + cfg.q_lora_rank * n * cfg.qk_head_dim * wb + 2 * n * cfg.qk_nope_head_dim * cfg.kv_lora_rank * 2
           + n * cfg.v_head_dim * h * wb)
    layers = cfg.num_hidden_layers + mtp
    dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    expert = 3 * h * cfg.moe_intermediate_size * wb
    moe = (cfg.n_routed_experts // dies + cfg.n_shared_experts) * expert + h * cfg.n_routed_experts * 2
    ffn = dense * 3 * h * cfg.intermediate_size * wb + (layers - dense) * moe
    emb = 2 * cfg.vocab_size * h * 2
    kv = batch_per_die * seq_len * layers * (cfg.kv_lora_rank * (1 if kv_int8 else 2) + cfg.qk_rope_head_dim * 2)
    return (layers * mla + ffn + emb + kv) / 2 ** 30


def decode_step_timing(config: ModelConfig = V3, *, dies: int, batch_per_die: int = 96, seq_len: int = 4096,
                       microbatches: int = 2, mtp: int = 0, kv_int8: bool = False, quant: bool = True,
                       layers: int | None = None, acceptance: float = DEFAULT_ACCEPTANCE,
                       sim_layers: int | None = None,
                       split: CoreSplit = CoreSplit(), progress=None,
                       profile: HardwareProfile | None = None) -> DecodeStepTiming:
    """Modeled time of one decode step of ``config`` served on ``dies`` dies (DP attention + EP MoE), timing-only.

    ``batch_per_die`` sequences per die at ``seq_len`` context; ``microbatches`` 1 or 2 (see the module doc);
    ``mtp`` 0 or 1 (at most the config's ``num_nextn_predict_layers``), each draft accepted with probability
    ``acceptance``; ``kv_int8``: int8 latent cache; ``quant``: INT8 experts, dense FFN, o_proj, dispatch and
    W_uq_qr; ``layers``: total decoder layers (default the config's; the first ``first_k_dense_replace`` are
    dense). ``progress(name)`` is called before each simulation. ``profile``: the hardware (a HardwareProfile,
    preset name or TOML file; default cloudmatrix384). Returns ``DecodeStepTiming``."""
    cfg = config
    _check_common(cfg, dies, batch_per_die, microbatches, mtp, seq_len)
    if mtp > cfg.num_nextn_predict_layers:
        raise ArgumentError(f"mtp={mtp}: config {cfg.name!r} has num_nextn_predict_layers="
                            f"{cfg.num_nextn_predict_layers}")
    if not 0.0 <= acceptance <= 1.0:
        raise ArgumentError(f"acceptance={acceptance} must be in 0..1")
    n_layers = cfg.num_hidden_layers if layers is None else int(layers)
    if n_layers < 1:
        raise ArgumentError(f"layers={layers} must be >= 1")
    n_dense = min(cfg.first_k_dense_replace, n_layers)
    n_moe = n_layers - n_dense
    note = progress or (lambda name: None)
    kw = dict(dies=dies, batch_per_die=batch_per_die, seq_len=seq_len, microbatches=microbatches, kv_int8=kv_int8,
              quant=quant, sim_layers=sim_layers, split=split, profile=profile)
    s = 1 + mtp
    runs = {}
    for kind, count in (("dense", n_dense), ("moe", n_moe)):
        if count:
            note(f"{kind} layers")
            runs[kind] = layer_timing(cfg, kind, query_tokens=s, **kw)
    first = runs["dense"] if n_dense else runs["moe"]
    fill = first.first_layer_us - first.period_us
    note("lm_head")
    lm_head = standalone_us(cfg, "lm_head", batch_per_die * s, quant=quant, profile=profile)
    mtp_us = 0.0
    if mtp:
        note("MTP module")
        one = dict(kw, sim_layers=1)
        runs["mtp"] = layer_timing(cfg, "moe", query_tokens=1, **one)
        mtp_us = (standalone_us(cfg, "eh_proj", batch_per_die, quant=quant, profile=profile) + runs["mtp"].period_us
                  + standalone_us(cfg, "lm_head", batch_per_die, quant=quant, profile=profile))
    step = fill + sum(runs[k].period_us * c for k, c in (("dense", n_dense), ("moe", n_moe)) if c) + lm_head + mtp_us
    return DecodeStepTiming(
        config=cfg.name, dies=dies, batch_per_die=batch_per_die, seq_len=seq_len, microbatches=microbatches,
        mtp=mtp, acceptance=float(acceptance), kv_int8=kv_int8, quant=quant, dense_layers=n_dense,
        moe_layers=n_moe, per_layer_us={k: runs[k].period_us for k in ("dense", "moe") if k in runs},
        breakdown_us={k: runs[k].breakdown_us for k in runs}, fill_us=fill, lm_head_us=lm_head, mtp_us=mtp_us,
        step_us=step, tokens_per_step=1.0 + mtp * float(acceptance),
        utilization={k: runs[k].utilization for k in runs},
        pipeline={k: {"bound": runs[k].bound, "stream_busy_us": runs[k].stream_busy_us} for k in runs},
        hbm_footprint_gib=hbm_footprint_gib(cfg, dies, batch_per_die, seq_len, quant=quant, kv_int8=kv_int8,
                                            mtp=mtp),
        layers=runs, hbm_capacity_gib=load_profile(profile, 1).hbm_bytes / 2 ** 30,
        dies_per_npu=load_profile(profile, 1).dies_per_chip)
