"""Timing-only DeepSeek-V3 decode step on an emulated CloudMatrix384 pod (issue #9): modeled TPOT and tokens/s.

    t = decode_step_timing(V3, dies=32, batch_per_die=96, seq_len=4096, microbatches=2, mtp=1)
    t = decode_step_timing(V3, preset="cloudmatrix-infer", mtp=1)      # the paper's decode instance
    t.tpot_ms, t.tokens_per_s_per_die, t.per_layer_us, t.breakdown_us

Deployment (``serving.deployment``: a ``Deployment`` or a named preset, explicit arguments overriding its fields):
each die is one data-parallel attention rank (its own ``batch_per_die`` sequences, MLA weights replicated) and one
expert-parallel rank. Without shared-expert dies and redundant experts every die holds ``n_routed_experts / dies``
routed experts and computes the shared expert locally on its own tokens. With them (e.g. the preset: 320 dies = 32
shared-expert dies + 288 routed-expert dies holding 256 routed + 32 redundant experts placed by ``eplb``), each
token also goes through FusedDispatch to shared-expert die ``rank % shared_expert_dies`` and its shared output comes
back through FusedCombine (``kernels.fused_moe.MoeGroup(shared_expert_rank_num=...)``). Every kernel runs
timing-only (phantom GM, real control data) on its real V3 shape. The layer is built on the serving step builder
(``serving.step.StepPod``, the numeric runner's too): each attention and MoE part is a queue-ahead part
(``serving.layer_parts``: its kernels queued before the run, as a captured graph), and the figures come from the
step's op records.

One layer, per microbatch of ``b`` sequences x ``S = 1 + mtp`` query tokens (T = b * S tokens):
  attention stream: MLAProlog (with ``quant``: dynamic quant of the normed hidden state, then weight_quant_mode 2,
                    int8 x, W_dq, W_dkv_kr and W_uq_qr) -> decode attention over the latent cache
                    (``seq_len`` tokens, int8 cache with ``kv_int8``) -> W_uv per head (bf16 grouped GEMM, one
                    group per head) -> o_proj (dynamic quant + int8 single-group GEMM, or bf16)
  MoE stream:       router GEMM (bf16, [T, H] x [H, E]) -> gating top-k -> FusedDispatch (INT8 records with
                    ``quant``) -> experts on the received rows (grouped GEMM gate_up + SwiGLU, dynamic quant,
                    grouped GEMM down: the routed experts on a routed-expert die, the shared expert on a
                    shared-expert die; without shared-expert dies the shared expert also runs on [T, H], one group)
                    -> FusedCombine (+ the shared output)
  dense layers replace the MoE stream by the dense SwiGLU FFN (intermediate_size), computed locally.
``microbatches=1``: one stream on the whole die (24 AIC + 48 AIV), the ops one after the other.
``microbatches=2``: the batch splits in two halves; the attention stream (AIC 8..23 with their AIVs 16..47 by
default) and the MoE stream (AIC 0..7, AIV 0..15) run concurrently on disjoint cores of the same die, so HBM
contention between them is modeled: attention of microbatch i overlaps the MoE part of microbatch i - 1.
Dependencies: MoE(i, L) after attention(i, L); attention(i, L + 1) after MoE(i, L) (the die's combine).

Step composition (timing each distinct layer shape once; all MoE layers are alike, all dense layers alike):
    step = fill + dense_layers x P_dense + moe_layers x P_moe + lm_head (+ MTP module)
where P is the steady-state per-layer period and fill = first dense layer's latency - P_dense (pipeline fill and
drain, paid once per step). With two microbatches ``sim_layers`` (2) consecutive layers plus the attention part of
the next one run in one pod (so the last layer's MoE meets the traffic it meets in steady state); P is the larger
of the spacing of the last two layers' ends and each compute die's streams' busy time (kernels + launch overheads)
in the last layer: two layers do not reach steady state when one stream is much busier than the other. With one
microbatch the layer runs serially and one layer is simulated. V3: 3 dense + 58 MoE layers. With ``mtp=1`` the
main model verifies 2 tokens per sequence (S = 2), then the MTP module drafts the next: eh_proj ([b, 2H] x [2H, H])
+ one MoE decoder layer on b tokens (latency of one layer alone, pipeline fill included) + lm_head on b tokens.
Accepted tokens per step = 1 + mtp x ``acceptance``; default 0.85, the low end of the 85-90 % second-token
acceptance DeepSeek-V3 reports (technical report, section 5.4.3); the cloudmatrix-infer preset uses the paper's
70 %. TPOT = step / accepted tokens per step.

modeled as: every DP rank has the same batch and context, and routing is balanced (token t of rank r, choice k ->
logical expert ((r T + t) K + k) mod E, then to a replica as ``serving.deployment`` says), so dies of one kind do
the same work. Compute (every op of both streams) runs on one representative die of each kind: the routed-expert
die that receives the most rows (lowest id on ties: die 0 without shared-expert dies) and, with shared-expert
dies, the shared-expert die that receives the most; the layer's period and ends are the later of the two, so the
step follows the slowest die. The other dies ("mirrors") run only their FusedDispatch / FusedCombine kernels (all
dies take part in the exchange), released by the events of the compute die of their kind (its gating, its last
expert GEMM): their kernels see an idle HBM, the compute dies' see the attention stream's traffic. Mirror dies
start their exchange one graph-launch overhead (2 us) before the compute dies. A routed-expert die with fewer rows
(one holding a replica) is a mirror: it would finish its experts earlier, which the model does not credit.
Two microbatches pay when the die has idle phases to fill (the MoE exchange's latency, single-tile GEMMs) and
spare HBM bandwidth; each microbatch re-reads every weight (MLAProlog, o_proj, router, experts), so where HBM
binds one microbatch can be faster (measured figures: the README's serving section and the benches).
modeled as: graph-mode launches (decode is a captured graph); each die's L2 in front of its HBM (ascend_emu.cache).
Not modeled: input / post-attention RMSNorm, residual adds, embedding lookup, sampling (vector work on [T, H], a few
us per layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ascend_emu import HardwareProfile, cloudmatrix384
from ascend_emu.errors import ArgumentError
from ascend_emu.profile import load_profile
from kernels.roofline import combine

from . import layer_parts as parts
from .config import V3, ModelConfig
from .deployment import DEFAULT_ACCEPTANCE, balanced_routing  # noqa: F401  (this module's public names, kept)
from .deployment import Deployment, resolve
from .layer_parts import CACHE_MODE, prolog_quant_mode  # noqa: F401  (this module's public names, kept)
from .step import StepPod

PS_PER_US = 1_000_000


@dataclass(frozen=True)
class CoreSplit:
    """Cores of a die given to the MoE stream with two microbatches: AIC 0 .. moe_aic-1 with their AIVs
    0 .. 2 moe_aic - 1; the attention stream gets the rest (CloudMatrix-Infer: 16 AIC + 32 AIV attention,
    8 AIC + 16 AIV MoE)."""
    moe_aic: int = 8

    def __post_init__(self):
        if not 1 <= self.moe_aic <= 23:
            raise ArgumentError(f"moe_aic={self.moe_aic} out of range 1..23 (the attention stream needs AICs too)")


# ============================================================================================ layer runs
@dataclass
class LayerTiming:
    """One layer kind simulated over ``sim_layers`` consecutive layers in one pod run.

    ``period_us``: steady-state per-layer latency: the larger of the spacing of the last two layers' ends (over
    every compute die) and each compute die's streams' busy time in the last layer (``bound`` says which); the
    single layer's latency when sim_layers = 1. ``first_layer_us``: from the host's submit to the end of the first
    layer. ``breakdown_us``: per op of the routed-expert compute die, kernel time summed over the microbatches of
    the last simulated layer (launch start to end, contention and waits included; with two microbatches ops
    overlap, so the sum exceeds the period). ``stream_busy_us``: that die's streams. ``utilization``: that die
    over the whole run: hbm (busy fraction), busiest fabric port, and per pipe. ``roofline``: per op of
    ``breakdown_us``, its roofline on its stream's cores (``kernels.roofline``: compute, HBM, mover and fabric
    bounds of the op's FLOPs and compulsory bytes summed over the microbatches, which binds, and the ratio of the
    op's kernel time to it; ``hbm_bytes``: what the op's launches on that die made the HBMs move, from
    ``Launch.traffic``). ``compute_dies``: the same figures per kind of
    compute die ("routed", and "shared" with shared-expert dies): {"die", "received_rows" (per microbatch, last
    layer), "breakdown_us", "stream_busy_us", "roofline", "utilization"}. ``received_rows``: [microbatches][dies]
    rows each die received in the last layer's dispatches (MoE layers)."""
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
    compute_dies: dict = field(default_factory=dict)          # per die kind, see above
    received_rows: list = field(default_factory=list, repr=False)
    deployment: Deployment | None = None


def _deployment(config: ModelConfig, deployment, preset, split, **overrides) -> Deployment:
    """The deployment a call asks for (deployment= / preset= / defaults, then its explicit arguments), checked
    against the model config."""
    if split is not None:
        overrides["moe_aic"] = split.moe_aic
    dep = resolve(deployment, preset, **overrides)
    dep.check(config)
    if dep.mtp > config.num_nextn_predict_layers:
        raise ArgumentError(f"mtp={dep.mtp}: config {config.name!r} has num_nextn_predict_layers="
                            f"{config.num_nextn_predict_layers}")
    return dep


def _representatives(dep: Deployment, cfg: ModelConfig, kind: str, tokens: int) -> tuple:
    """({die: kind} of the compute dies, [dies] rows received per dispatch of ``tokens`` tokens per rank or None):
    the routed-expert die receiving the most rows (lowest id on ties; die 0 without shared-expert dies and
    redundancy) and, with shared-expert dies, the shared-expert die receiving the most."""
    if kind != "moe":
        return {0: "routed"}, None
    rows = dep.received_rows(cfg, tokens)
    s = dep.shared_expert_dies
    compute = {s + int(np.argmax(rows[s:])): "routed"}
    if s:
        compute[int(np.argmax(rows[:s]))] = "shared"
    return compute, rows


def layer_timing(config: ModelConfig = V3, kind: str = "moe", *, dies: int | None = None,
                 batch_per_die: int | None = None, seq_len: int | None = None, microbatches: int | None = None,
                 query_tokens: int | None = None, kv_int8: bool | None = None, quant: bool | None = None,
                 sim_layers: int | None = None, split: CoreSplit | None = None, trace: bool = False,
                 profile: HardwareProfile | None = None, deployment: Deployment | None = None,
                 preset: str | None = None, shared_expert_dies: int | None = None,
                 redundant_experts: int | None = None) -> LayerTiming:
    """Simulate ``sim_layers`` consecutive ``kind`` ("moe" or "dense") decoder layers of ``batch_per_die``
    sequences per die (``query_tokens`` = 1 + MTP depth each) on a pod of ``dies`` dies; see the module doc.

    The deployment: ``deployment`` (a ``serving.deployment.Deployment``) or ``preset`` (a name of
    ``serving.deployment.PRESETS``) or the defaults (16 dies, 96 sequences at 4096, two microbatches, INT8), then
    every argument given here (not None) overrides its field. ``query_tokens`` default 1 + the deployment's mtp.
    ``sim_layers`` default: 1 with one microbatch (the layer runs serially: its latency is the period), 2 with
    two (plus the next layer's attention; the period is set as the module doc says). ``profile``: the hardware
    (default cloudmatrix384)."""
    cfg = config
    dep = _deployment(cfg, deployment, preset, split, dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                      microbatches=microbatches, kv_int8=kv_int8, quant=quant,
                      shared_expert_dies=shared_expert_dies, redundant_experts=redundant_experts)
    s = 1 + dep.mtp if query_tokens is None else query_tokens
    if s not in (1, 2):
        raise ArgumentError(f"query_tokens={query_tokens}: use 1, or 2 with one MTP draft token")
    if dep.seq_len < s:
        raise ArgumentError(f"seq_len={dep.seq_len} must be at least the {s} query tokens per sequence")
    if kind not in ("moe", "dense"):
        raise ArgumentError(f"kind={kind!r}: use 'moe' or 'dense'")
    microbatches, dies = dep.microbatches, dep.dies
    if sim_layers is None:
        sim_layers = 1 if microbatches == 1 else 2
    if sim_layers < 1:
        raise ArgumentError(f"sim_layers={sim_layers} must be >= 1")
    from kernels.fused_moe import MoeGroup
    prof = load_profile(profile, max(dies, 2))
    moe_aic = dep.moe_aic if microbatches == 2 else prof.aic_per_die
    step = StepPod(prof, microbatches=microbatches, attn_cores=prof.aic_per_die - moe_aic, launch_mode="graph",
                   numeric=False, trace=trace)
    mbs = [dep.batch_per_die // microbatches + (i < dep.batch_per_die % microbatches) for i in range(microbatches)]
    compute, _ = _representatives(dep, cfg, kind, max(mbs) * s)
    moe_streams = dict(zip(compute, step.streams("moe", compute)))
    mirrors, release, group = [], {}, None
    if kind == "moe":
        rep = {k: d for d, k in compute.items()}
        mirrors = [d for d in range(dies) if d not in compute]       # in the exchange only
        release = {d: rep["shared" if d < dep.shared_expert_dies else "routed"] for d in mirrors}
        group = MoeGroup(step.pod, range(dies), max_bs=max(mbs) * s, hidden=cfg.hidden_size,
                         topk=cfg.num_experts_per_tok, num_experts=dep.physical_experts(cfg), quant=dep.quant,
                         cores=prof.aiv_per_aic * moe_aic, phantom=True, mode="graph",
                         shared_expert_rank_num=dep.shared_expert_dies,
                         streams=dict(zip(range(dies), step.streams("moe", range(dies)))))
    routing = {b * s: dep.routing(cfg, b * s) for b in set(mbs)} if kind == "moe" else {}
    quant, kv_int8, seq_len = dep.quant, dep.kv_int8, dep.seq_len

    def attention(stream, die, b):
        return lambda after: parts.attention_ops(stream, cfg, b, s, seq_len, quant_int8=quant, kv_int8=kv_int8,
                                                 after=after.get(die, ()))

    def ffn(b):
        if kind == "moe":
            return lambda after: parts.moe_ops(moe_streams, compute, mirrors, release, group, cfg, routing[b * s],
                                               b * s, quant_int8=quant, after=after)

        def dense(after):
            for d, stream in moe_streams.items():
                yield from parts.swiglu_ffn(stream, "dense_ffn", [b * s], cfg.hidden_size, cfg.intermediate_size,
                                            quant_int8=quant, after=after.get(d, ()))
        return dense
    last_ffn = [None] * microbatches            # microbatch i's MoE / FFN part of the previous layer
    received = []
    tail = microbatches > 1 and sim_layers > 1    # the next layer's attention, whose traffic the last MoE meets
    for layer in range(sim_layers + tail):
        attn_parts = [[] for _ in mbs]
        for d, stream in zip(compute, step.streams("attn", compute)):
            for i, b in enumerate(mbs):
                attn_parts[i].append(step.add((layer, i), "attn", attention(stream, d, b), after=[last_ffn[i]],
                                              label="attention", ahead=True))
        if layer == sim_layers:
            break
        for i, b in enumerate(mbs):
            last_ffn[i] = step.add((layer, i), "moe", ffn(b), after=attn_parts[i],
                                   label="moe" if kind == "moe" else "ffn", ahead=True)
            if kind == "moe" and layer == sim_layers - 1:
                received.append([out.rows for out in last_ffn[i].result["outs"]])
    run = step.run()
    res = _layer_figures(kind, microbatches, sum(mbs) * s, sim_layers, step.records(), run, prof, compute)
    res.received_rows, res.deployment = received, dep
    for d, die_kind in compute.items():
        res.compute_dies[die_kind]["received_rows"] = [rows[d] for rows in received]
    return res


def _die_utilization(run, prof, die: int) -> dict:
    """One die over the whole run (fill included): HBM busy fraction, the busiest fabric port (any die), and the
    busy fraction of the CUBE pipe (over the die's 24 AICs), VECTOR (48 AIVs) and MTE2 (all 72 cores)."""
    span = max(run.modeled_us, 1e-12)
    busy: dict = {}
    for (d, _, pipe), us in run.pipe_busy.items():
        if d == die:
            busy[pipe] = busy.get(pipe, 0.0) + us
    port, port_util = run.busiest_port()
    n_aic, n_aiv = prof.aic_per_die, prof.aiv_per_die
    return {"hbm": run.servers.get(f"hbm{die}", {}).get("utilization", 0.0), "fabric_port": port_util,
            "fabric_port_name": port, "cube": busy.get("CUBE", 0.0) / (n_aic * span),
            "vector": busy.get("VECTOR", 0.0) / (n_aiv * span),
            "mte2": busy.get("MTE2", 0.0) / ((n_aic + n_aiv) * span)}


def _layer_figures(kind, microbatches, tokens, sim_layers, records, run, prof, compute) -> LayerTiming:
    """The figures of ``layer_timing`` from the step's op records (``serving.step.OpRecord``, key (layer,
    microbatch), lane the stream's name) on the compute dies."""
    us = lambda ps: ps / PS_PER_US
    ends = [0.0] * sim_layers
    schedule = []
    kinds = list(dict.fromkeys(compute.values()))
    breakdown = {k: {} for k in kinds}
    busy = {k: {} for k in kinds}
    hbm = {k: {} for k in kinds}                                # tag -> HBM bytes of its launches (Launch.traffic)
    works = {k: {} for k in kinds}                              # tag -> ([Work], its stream) of the last layer
    launch_us = prof.launch_graph_us
    for record in records:
        layer, mb = record.key
        tag, stream = record.op, record.lane
        for la in record.launches:
            die_kind = compute.get(la.dies[0])
            if die_kind is None:
                continue                                       # a mirror die's exchange
            if la.end_ps is None:
                raise RuntimeError(f"launch {la.name} of layer {layer} did not finish (parked)")
            if layer == sim_layers:
                continue                                       # the tail: traffic only
            if layer == sim_layers - 1:
                works[die_kind].setdefault(tag, ([], la.stream))[0].extend(record.work)
            if die_kind == kinds[0]:
                schedule.append((layer, mb, tag, us(la.start_ps), us(la.end_ps)))
            ends[layer] = max(ends[layer], us(la.end_ps))
            if layer == sim_layers - 1:
                b = breakdown[die_kind]
                b[tag] = b.get(tag, 0.0) + us(la.end_ps - la.start_ps)
                h = hbm[die_kind]
                h[tag] = h.get(tag, 0) + la.traffic.hbm_bytes
                s = busy[die_kind]
                s[stream] = s.get(stream, 0.0) + us(la.end_ps - la.start_ps) + launch_us
    if sim_layers == 1:
        period, bound = ends[0], "one layer"
    else:
        # modeled as: a stream cannot run a layer's launches in less than their kernel times plus launch
        # overheads; a few simulated layers do not reach steady state when one stream is much busier (the next
        # layer's attention starts early while this layer's MoE still runs), so the period takes the larger
        label = lambda k, stream: f"{stream} stream" if k == kinds[0] else f"{stream} stream ({k}-expert die)"
        period, bound = max((ends[-1] - ends[-2], "pipeline"),
                            *((v, label(k, st)) for k in kinds for st, v in sorted(busy[k].items())))
    per_kind = {}
    for d, k in compute.items():
        # an op's HBM bytes: what its own launches on die d made the HBMs move (Launch.traffic), so the other
        # stream's traffic in the same run is not counted
        roofline = {tag: combine(tag, prof, ws, modeled_us=breakdown[k][tag], kernel_us=breakdown[k][tag],
                                 aic=len(stream.aic), aiv=len(stream.aiv), hbm_bytes=hbm[k][tag]).to_dict()
                    for tag, (ws, stream) in works[k].items() if tag in breakdown[k]}
        per_kind[k] = {"die": d, "received_rows": [], "breakdown_us": breakdown[k], "stream_busy_us": busy[k],
                       "roofline": roofline, "utilization": _die_utilization(run, prof, d)}
    first = per_kind[kinds[0]]
    return LayerTiming(kind, microbatches, tokens, period, ends[0], first["breakdown_us"], first["utilization"],
                       run.instructions, run.bytes_moved, sim_layers, first["stream_busy_us"], bound, schedule, run,
                       first["roofline"], per_kind)


def standalone_us(config: ModelConfig, op: str, tokens: int, *, quant: bool = True,
                  profile: HardwareProfile | None = None) -> float:
    """Modeled us of a local op alone on a whole die (graph launch included): "lm_head" ([T, H] x [H, vocab],
    bf16) or "eh_proj" (MTP's [T, 2H] x [2H, H])."""
    prof = load_profile(profile, 1)
    h = config.hidden_size
    if op == "lm_head":
        # modeled as: bf16 lm_head, the full vocabulary on every die (DP attention ranks, no vocab parallelism)
        body = lambda stream: parts.gemm(stream, op, [tokens], h, config.vocab_size, int8=False)
    elif op == "eh_proj":
        body = lambda stream: parts.linear(stream, op, tokens, 2 * h, h, quant_int8=quant)
    else:
        raise ArgumentError(f"op={op!r}: use 'lm_head' or 'eh_proj'")
    step = StepPod(prof, microbatches=1, attn_cores=prof.aic_per_die, launch_mode="graph", numeric=False)
    stream = step.streams("attn", [0])[0]
    step.add((op,), "attn", lambda after: body(stream), ahead=True)
    step.run()
    return max(record.end_us for record in step.records())


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
    utilization: dict             # {"dense": {...}, "moe": {...}} routed-expert compute die figures
    pipeline: dict                # {kind: {"bound": what sets the period, "stream_busy_us": {...}}}
    hbm_footprint_gib: float      # weights + KV cache per die (the fuller kind of die)
    layers: dict = field(default_factory=dict, repr=False)     # the LayerTiming objects
    hbm_capacity_gib: float = cloudmatrix384().hbm_bytes / 2 ** 30   # HBM per die of the profile
    dies_per_npu: int = cloudmatrix384().dies_per_chip                # dies of one NPU (chip) of the profile
    deployment: Deployment = field(default_factory=Deployment)

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
        dep = self.deployment
        return {"config": self.config, "preset": dep.name, "dies": self.dies, "batch_per_die": self.batch_per_die,
                "seq_len": self.seq_len, "microbatches": self.microbatches, "mtp": self.mtp,
                "acceptance": self.acceptance, "kv_int8": self.kv_int8, "quant": self.quant,
                "shared_expert_dies": dep.shared_expert_dies, "redundant_experts": dep.redundant_experts,
                "moe_aic": dep.moe_aic, "deployment": dep.to_dict(),
                "dense_layers": self.dense_layers, "moe_layers": self.moe_layers,
                "modeled_tpot_ms": self.tpot_ms, "step_us": self.step_us, "tokens_per_step": self.tokens_per_step,
                "tokens_per_s_per_die": self.tokens_per_s_per_die, "tokens_per_s_per_npu": self.tokens_per_s_per_npu,
                "tokens_per_s": self.tokens_per_s,
                "per_layer_us": dict(self.per_layer_us), "breakdown_us": self.breakdown_us,
                "fill_us": self.fill_us, "lm_head_us": self.lm_head_us, "mtp_us": self.mtp_us,
                "utilization": self.utilization, "pipeline": self.pipeline,
                "hbm_footprint_gib": self.hbm_footprint_gib,
                "hbm_capacity_gib": self.hbm_capacity_gib,
                "roofline": {k: layer.roofline for k, layer in self.layers.items()},
                "compute_dies": {k: layer.compute_dies for k, layer in self.layers.items()}}


def hbm_footprint_gib(cfg: ModelConfig, dies: int, batch_per_die: int, seq_len: int, *, quant: bool,
                      kv_int8: bool, mtp: int, shared_expert_dies: int = 0, redundant_experts: int = 0) -> float:
    """Weights held by one die (MLA replicated; its routed experts, or the shared expert on a shared-expert die, or
    both without shared-expert dies, whichever die holds more; dense FFNs; embedding + lm_head) plus its latent KV
    cache, in GiB. The MLA weights' bytes follow ``prolog_quant_mode`` for W_dq / W_dkv_kr (int8 in mode 2)."""
    wb = 1 if quant else 2
    h, n = cfg.hidden_size, cfg.num_attention_heads
    x_wb = 1 if prolog_quant_mode(cfg, quant) == 2 else 2
    mla = (h * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * x_wb
           + cfg.q_lora_rank * n * cfg.qk_head_dim * wb + 2 * n * cfg.qk_nope_head_dim * cfg.kv_lora_rank * 2
           + n * cfg.v_head_dim * h * wb)
    layers = cfg.num_hidden_layers + mtp
    dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    expert = 3 * h * cfg.moe_intermediate_size * wb
    routed = (cfg.n_routed_experts + redundant_experts) // (dies - shared_expert_dies)
    experts = max(routed, cfg.n_shared_experts) if shared_expert_dies else routed + cfg.n_shared_experts
    moe = experts * expert + h * cfg.n_routed_experts * 2
    ffn = dense * 3 * h * cfg.intermediate_size * wb + (layers - dense) * moe
    emb = 2 * cfg.vocab_size * h * 2
    kv = batch_per_die * seq_len * layers * (cfg.kv_lora_rank * (1 if kv_int8 else 2) + cfg.qk_rope_head_dim * 2)
    return (layers * mla + ffn + emb + kv) / 2 ** 30


def decode_step_timing(config: ModelConfig = V3, *, dies: int | None = None, batch_per_die: int | None = None,
                       seq_len: int | None = None, microbatches: int | None = None, mtp: int | None = None,
                       kv_int8: bool | None = None, quant: bool | None = None, layers: int | None = None,
                       acceptance: float | None = None, sim_layers: int | None = None,
                       split: CoreSplit | None = None, progress=None, profile: HardwareProfile | None = None,
                       deployment: Deployment | None = None, preset: str | None = None,
                       shared_expert_dies: int | None = None,
                       redundant_experts: int | None = None) -> DecodeStepTiming:
    """Modeled time of one decode step of ``config`` served on ``dies`` dies (DP attention + EP MoE), timing-only.

    The deployment: ``deployment`` (a ``serving.deployment.Deployment``) or ``preset`` (a name of
    ``serving.deployment.PRESETS``, e.g. "cloudmatrix-infer") or the defaults (16 dies, 96 sequences per die at
    4096 context, two microbatches, mtp 0, acceptance 0.85, INT8, bf16 cache), then every argument given here (not
    None) overrides its field: ``batch_per_die`` sequences per die at ``seq_len`` context; ``microbatches`` 1 or 2
    (see the module doc); ``mtp`` 0 or 1 (at most the config's ``num_nextn_predict_layers``), each draft accepted
    with probability ``acceptance``; ``kv_int8``: int8 latent cache; ``quant``: W8A8 (serving.deployment);
    ``shared_expert_dies`` / ``redundant_experts``: the EP layout (serving.deployment); ``split``: the MoE stream's
    AICs. ``layers``: total decoder layers (default the config's; the first ``first_k_dense_replace`` are dense).
    ``progress(name)`` is called before each simulation. ``profile``: the hardware (a HardwareProfile, preset name
    or TOML file; default cloudmatrix384). Returns ``DecodeStepTiming``."""
    cfg = config
    dep = _deployment(cfg, deployment, preset, split, dies=dies, batch_per_die=batch_per_die, seq_len=seq_len,
                      microbatches=microbatches, mtp=mtp, kv_int8=kv_int8, quant=quant, acceptance=acceptance,
                      shared_expert_dies=shared_expert_dies, redundant_experts=redundant_experts)
    n_layers = cfg.num_hidden_layers if layers is None else int(layers)
    if n_layers < 1:
        raise ArgumentError(f"layers={layers} must be >= 1")
    n_dense = min(cfg.first_k_dense_replace, n_layers)
    n_moe = n_layers - n_dense
    note = progress or (lambda name: None)
    kw = dict(deployment=dep, sim_layers=sim_layers, profile=profile)
    s, b, quant = 1 + dep.mtp, dep.batch_per_die, dep.quant
    runs = {}
    for kind, count in (("dense", n_dense), ("moe", n_moe)):
        if count:
            note(f"{kind} layers")
            runs[kind] = layer_timing(cfg, kind, query_tokens=s, **kw)
    first = runs["dense"] if n_dense else runs["moe"]
    fill = first.first_layer_us - first.period_us
    note("lm_head")
    lm_head = standalone_us(cfg, "lm_head", b * s, quant=quant, profile=profile)
    mtp_us = 0.0
    if dep.mtp:
        note("MTP module")
        one = dict(kw, sim_layers=1)
        runs["mtp"] = layer_timing(cfg, "moe", query_tokens=1, **one)
        mtp_us = (standalone_us(cfg, "eh_proj", b, quant=quant, profile=profile) + runs["mtp"].period_us
                  + standalone_us(cfg, "lm_head", b, quant=quant, profile=profile))
    step = fill + sum(runs[k].period_us * c for k, c in (("dense", n_dense), ("moe", n_moe)) if c) + lm_head + mtp_us
    prof = load_profile(profile, 1)
    return DecodeStepTiming(
        config=cfg.name, dies=dep.dies, batch_per_die=b, seq_len=dep.seq_len, microbatches=dep.microbatches,
        mtp=dep.mtp, acceptance=float(dep.acceptance), kv_int8=dep.kv_int8, quant=quant, dense_layers=n_dense,
        moe_layers=n_moe, per_layer_us={k: runs[k].period_us for k in ("dense", "moe") if k in runs},
        breakdown_us={k: runs[k].breakdown_us for k in runs}, fill_us=fill, lm_head_us=lm_head, mtp_us=mtp_us,
        step_us=step, tokens_per_step=1.0 + dep.mtp * float(dep.acceptance),
        utilization={k: runs[k].utilization for k in runs},
        pipeline={k: {"bound": runs[k].bound, "stream_busy_us": runs[k].stream_busy_us} for k in runs},
        hbm_footprint_gib=hbm_footprint_gib(cfg, dep.dies, b, dep.seq_len, quant=quant, kv_int8=dep.kv_int8,
                                            mtp=dep.mtp, shared_expert_dies=dep.shared_expert_dies,
                                            redundant_experts=dep.redundant_experts),
        layers=runs, hbm_capacity_gib=prof.hbm_bytes / 2 ** 30, dies_per_npu=prof.dies_per_chip, deployment=dep)
