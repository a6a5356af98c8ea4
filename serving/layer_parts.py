"""The timing-only decode layer's parts (``serving.timing``) as queue-ahead ``serving.step.StepPod`` bodies.

Each op queues its kernel on the caller's stream (the kernel host functions' ``stream=`` / ``after=``; phantom GM,
real control data, the real shape, inputs given as ``kernels.ranks.HostShape``: torch is not loaded) and yields
``(op name, Pending or launches, [kernels.roofline.Work])``: what the op must do at least (FLOPs and compulsory
bytes), for its roofline. An op waits for the kernel before it on its
stream (stream order) and for the launches in ``after`` (given to the part's first op). A helper returns the
``Pending`` of its last kernel, so a later op on another die or stream can wait for it.
"""
from __future__ import annotations

import numpy as np

from kernels.ranks import HostShape
from kernels.roofline import Work, attention_work, gemm_work

from .config import ModelConfig

CACHE_MODE = "PA_NZ"           # latent / rope cache layout, written by MLAProlog and read by attention (128 pages)


def gemm(stream, tag: str, rows_per_group, k: int, n: int, *, int8: bool, swiglu: bool = False, after=()):
    """Grouped GEMM (one group per entry of rows_per_group) on ``stream``'s AICs, NZ weights; int8 with
    per-channel and per-token scales (the epilogue path), bf16 otherwise."""
    from kernels.grouped_matmul import grouped_matmul
    m = int(sum(rows_per_group))
    dt = "int8" if int8 else "bf16"
    kw = {}
    if int8:
        kw = {"scale": HostShape((len(rows_per_group), n), "fp32"), "per_token_scale": HostShape((m,), "fp32")}
    ends = np.cumsum(np.asarray(rows_per_group, dtype=np.int64))
    work = gemm_work(m=m, k=k, n=n, dtype="int8" if int8 else "bf16", groups=len(rows_per_group), swiglu=swiglu,
                     per_token_scale=int8, channel_scale=int8)
    pending = grouped_matmul(HostShape((m, k), dt), HostShape((len(rows_per_group), k, n), dt), group_list=ends,
                             swiglu=swiglu, weight_format="NZ", numeric=False, stream=stream, after=list(after), **kw)
    yield tag, pending, [work]
    return pending


def quant(stream, tag: str, rows: int, h: int, after=()):
    """Dynamic per-token INT8 quantisation of [rows, h] bf16 on ``stream``'s AIVs."""
    from kernels.dynamic_quant import dynamic_quant
    # per-token absmax, scale, round: about 3 fp32 operations per element
    work = Work(vector_flops=3.0 * rows * h, read_bytes=rows * h * 2, write_bytes=rows * (h + 4))
    pending = dynamic_quant(HostShape((rows, h), "bf16"), numeric=False, stream=stream, after=list(after))
    yield tag, pending, [work]
    return pending


def linear(stream, tag: str, rows: int, k: int, n: int, *, quant_int8: bool, swiglu: bool = False, after=()):
    """A local linear layer on ``rows`` tokens: (dynamic quant +) one-group GEMM."""
    if quant_int8:
        yield from quant(stream, tag, rows, k, after)
        after = ()
    return (yield from gemm(stream, tag, [rows], k, n, int8=quant_int8, swiglu=swiglu, after=after))


def swiglu_ffn(stream, tag: str, rows_per_group, h: int, inter: int, *, quant_int8: bool, after=()):
    """gate_up (+SwiGLU) then down over the groups (experts): [rows, H] -> [rows, I] -> [rows, H]."""
    m = int(sum(rows_per_group))
    if quant_int8:
        yield from quant(stream, tag, m, h, after)
        after = ()
    yield from gemm(stream, tag, rows_per_group, h, 2 * inter, int8=quant_int8, swiglu=True, after=after)
    if quant_int8:
        yield from quant(stream, tag, m, inter)
    return (yield from gemm(stream, tag, rows_per_group, inter, h, int8=quant_int8))


def received_ffn(stream, tag: str, rows, h: int, inter: int, *, quant_int8: bool):
    """Experts on the rows dispatch delivered (one group per local expert): with INT8 dispatch the rows and their
    per-token scales arrive quantised, so gate_up + SwiGLU, re-quantise, down; bf16 otherwise."""
    if not quant_int8:
        return (yield from swiglu_ffn(stream, tag, rows, h, inter, quant_int8=False))
    yield from gemm(stream, tag, rows, h, 2 * inter, int8=True, swiglu=True)
    yield from quant(stream, tag, sum(rows), inter)
    return (yield from gemm(stream, tag, rows, inter, h, int8=True))


# ============================================================================================ attention
def prolog_quant_mode(cfg: ModelConfig, quant_int8: bool) -> int:
    """MLAProlog weight_quant_mode with ``quant_int8`` (W8A8), else 0 (bf16): 2 (an int8 token_x, the normed
    hidden state quantised per token before the prolog, x int8 W_dq / W_dkv_kr; c_q re-quantised per token x
    int8 W_uq_qr) where the shapes allow it, 1 (only W_uq_qr int8) where only W_uq_qr's do. An int8 NZ W_uq_qr is
    split over the AICs by heads, so a head's (nope + rope) columns must fill whole 32-column int8 fractals: V3's
    192 do; the mini config's 48 do not, and its prolog stays bf16. Mode 2 also splits the int8 x projections in
    32-column blocks: hidden, q_lora_rank and kv_lora_rank + rope dims must be multiples of 32 (V3's are)."""
    if not quant_int8 or cfg.qk_head_dim % 32:
        return 0
    x_dims = (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2 if all(v % 32 == 0 for v in x_dims) else 1


def prolog_work(cfg: ModelConfig, t: int, *, quant_int8: bool, kv_int8: bool) -> list:
    """MLAProlog's work (weight_quant_mode as ``prolog_quant_mode``): the x projections W_dq / W_dkv_kr (int8 x
    int8 in mode 2, with the per-token scale of x and the weights' per-channel scales) and the absorbed W_uk
    (bf16) apart from W_uq_qr (int8 in modes 1 and 2); the caches' rows and the queries written once; RMSNorm /
    RoPE as vector work (about 8 fp32 operations per element normalised)."""
    h, hcq, hckv, dr, n = (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                           cfg.num_attention_heads)
    mode = prolog_quant_mode(cfg, quant_int8)
    uq = "int8" if mode else "bf16"
    uq_cols = n * cfg.qk_head_dim
    x_cols = hcq + hckv + dr
    absorb = n * cfg.qk_nope_head_dim * hckv
    vector = 8.0 * t * (hcq + hckv + dr + n * dr)
    written = t * n * (hckv + dr) * 2 + t * (hckv * (1 if kv_int8 else 2) + dr * 2)
    if mode == 2:
        down = [Work(cube_flops=2.0 * t * h * x_cols, cube_dtype="int8",
                     read_bytes=t * h + 4 * t + h * x_cols + 4 * x_cols),
                Work(cube_flops=2.0 * t * absorb, cube_dtype="bf16", vector_flops=vector, read_bytes=absorb * 2,
                     write_bytes=written)]
    else:
        down = [Work(cube_flops=2.0 * t * (h * x_cols + absorb), cube_dtype="bf16", vector_flops=vector,
                     read_bytes=t * h * 2 + h * x_cols * 2 + absorb * 2, write_bytes=written)]
    up = Work(cube_flops=2.0 * t * hcq * uq_cols, cube_dtype=uq,
              read_bytes=hcq * uq_cols * (1 if uq == "int8" else 2))
    return [*down, up]


def attention_ops(stream, cfg: ModelConfig, b: int, s: int, seq_len: int, *, quant_int8: bool, kv_int8: bool,
                  after=()):
    """MLAProlog -> decode attention -> W_uv per head -> o_proj for ``b`` sequences x ``s`` query tokens. In
    weight_quant_mode 2 the prolog's int8 token_x comes from a dynamic quant of the normed hidden state (counted in
    the "mla_prolog" op, as o_proj's quant is in "o_proj")."""
    from kernels.attention import mla_decode_attention_timing
    from kernels.mla import mla_prolog_timing
    t = b * s
    n, hckv = cfg.num_attention_heads, cfg.kv_lora_rank
    mode = prolog_quant_mode(cfg, quant_int8)
    if mode == 2:
        yield from quant(stream, "mla_prolog", t, cfg.hidden_size, after)
        after = ()
    yield "mla_prolog", mla_prolog_timing(
        t, he=cfg.hidden_size, hcq=cfg.q_lora_rank, hckv=hckv, n=n, d=cfg.qk_nope_head_dim,
        dr=cfg.qk_rope_head_dim, weight_quant_mode=mode, kv_cache_quant_mode=int(kv_int8), cache_mode=CACHE_MODE,
        stream=stream, after=list(after)), prolog_work(cfg, t, quant_int8=quant_int8, kv_int8=kv_int8)
    yield "attention", mla_decode_attention_timing(
        b, seq_len, heads=n, mtp=s - 1, hckv=hckv, dr=cfg.qk_rope_head_dim, kv_int8=kv_int8, cache_mode=CACHE_MODE,
        stream=stream), [attention_work(seq_lens=[seq_len] * b, s=s, n=n, hckv=hckv, dr=cfg.qk_rope_head_dim,
                                        kv_int8=kv_int8)]
    # absorbed V up-projection: per head h, out[:, h] @ W_uv[h] ([T, Hckv] x [Hckv, Dv]): one group per head
    yield from gemm(stream, "attn_v_up", [t] * n, hckv, cfg.v_head_dim, int8=False)
    return (yield from linear(stream, "o_proj", t, n * cfg.v_head_dim, cfg.hidden_size, quant_int8=quant_int8))


# ============================================================================================ MoE
def moe_ops(streams: dict, kinds: dict, mirrors: list, release: dict, group, cfg: ModelConfig, ids: list, t: int, *,
            quant_int8: bool, after: dict):
    """router -> gating -> FusedDispatch -> experts -> FusedCombine of ``t`` tokens per rank on the compute dies'
    ``streams`` ({die: Stream}; ``kinds`` {die: "routed" | "shared"}), each die's router after ``after[die]``:
    routed-expert dies run their received rows through their experts (and the shared expert on their own tokens
    when the group has no shared-expert ranks), shared-expert dies the shared expert on theirs. The ``mirrors``
    (the other dies) take part in the dispatch / combine only, released by the events of the compute die
    ``release[die]`` of their kind. ``ids``: per rank [t, K] physical expert ids. Returns the dispatch's handle."""
    from kernels.fused_moe import launch_combine, launch_dispatch
    from kernels.gating import moe_gating_top_k
    h, e, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    shared_slot = 1 if group.shared_ranks else 0
    gate, before = {}, {}
    for d, stream in streams.items():
        yield from gemm(stream, "router", [t], h, e, int8=False, after=after.get(d, ()))
        gating = moe_gating_top_k(
            HostShape((t, e), "fp32"), k, bias=HostShape((e,), "fp32"), k_group=cfg.topk_group,
            group_count=cfg.n_group, group_select_mode=1, routed_scaling_factor=cfg.routed_scaling_factor,
            numeric=False, stream=stream, after=[])
        yield "gating", gating, [Work(vector_flops=10.0 * t * e, read_bytes=t * e * 4 + e * 4, write_bytes=t * k * 8)]
        gate[d] = gating.launches[-1]
    pending = launch_dispatch(None, ids, group, numeric=False,
                              after={**{d: [] for d in streams}, **{m: [gate[release[m]]] for m in mirrors}})
    # modeled as: every routed row leaves the die (EP ranks >> 1), int8 records with their scale, or bf16
    row = h + 4 if quant_int8 else 2 * h
    sent = t * (k + shared_slot) * row
    yield "dispatch", list(pending["launches"].values()), [Work(read_bytes=t * h * 2, write_bytes=sent,
                                                                fabric_bytes=sent)]
    inter = cfg.moe_intermediate_size
    for d, stream in streams.items():
        rank = group.dies.index(d)
        counts = [int(c) for c in sum(p.counts[rank] for p in pending["plans"])]   # rows per local expert
        if kinds[d] == "shared":
            last = yield from received_ffn(stream, "shared_expert", counts[:1], h, inter * cfg.n_shared_experts,
                                           quant_int8=quant_int8)
        else:
            last = yield from received_ffn(stream, "routed_experts", counts, h, inter, quant_int8=quant_int8)
            if not group.shared_ranks:
                last = yield from swiglu_ffn(stream, "shared_expert", [t], h, inter * cfg.n_shared_experts,
                                             quant_int8=quant_int8)
        before[d] = last.launches[-1]
    shared = None
    if not group.shared_ranks:
        shared = [group.pod.alloc(d, (t, h), "bf16", phantom=True, name=f"shared_out{d}") for d in group.dies]
    weights = [np.ones((t, k), np.float32)] * group.size
    launch_combine(None, pending, weights, group, shared_expert_x=shared, numeric=False,
                   after={**{d: [] for d in streams}, **{m: [before[release[m]]] for m in mirrors}})
    yield "combine", list(pending["combine_launches"].values()), [
        Work(vector_flops=2.0 * t * (k + shared_slot) * h,
             read_bytes=t * (k + shared_slot) * h * 2 + t * h * 2 * (1 - shared_slot),
             write_bytes=t * h * 2, fabric_bytes=t * (k + shared_slot) * h * 2)]
    return pending
