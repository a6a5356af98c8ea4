"""The mini DeepSeek-V3-shaped model: seeded weights in kernel-ready layouts, and its plain-torch reference forward.

Weights are stored the way the kernels take them (``[in, out]``, RoPE columns in the library's even/odd order,
``kernels.rope``), so the emulated runner and the reference read the same tensors. Precision follows the kernels,
so "same model" means the same rounding points:

- activations between ops are bf16; matmuls accumulate in fp32 (bf16 weights) or exactly in int32 (int8 x int8);
- MLA: ``mla_prolog`` (q-LoRA with RMSNorm, absorbed W_uk, RoPE, normalised latent + rope key written to the paged
  cache) -> absorbed decode attention over the latent cache -> per-head W_uv (``[N, Hckv, Dv]``) -> ``wo``;
- dense layers: SwiGLU (``[gate | up]`` halves) in bf16;
- MoE layers: router logits in fp32, sigmoid scores + selection bias, group-limited top-k (groups ranked by the sum of
  their top 2), renormalised weights x ``routed_scaling_factor``; routed experts are W8A8 (the FusedDispatch wire
  format: per-token dynamic INT8 activations, int8 weights with per-output-channel fp32 scales), the intermediate
  re-quantised per token; the shared expert is bf16; the weighted sum is fp32 in top-k order after the shared
  expert's output, rounded to bf16 once;
- bf16 GEMMs accumulate K steps of 64 in fp32 in order (as the cube does), attention is the kernel's flash
  algorithm (``attention_flash_reference``: 128-token steps, bf16 probabilities, fp32 online softmax);
- RMSNorm in fp32, result bf16; residual adds in bf16; logits fp32, greedy = argmax with ties to the lowest id;
- MTP head (``num_nextn_predict_layers`` = 1): h' = W_proj [RMSNorm(emb(next token)) | RMSNorm(h)], one dense
  decoder layer with its own latent cache, the shared final norm and ``lm_head``.

``load_deepseek_state_dict`` is the loader hook for real checkpoints (DeepSeek-V3 ``model.layers.*`` names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ascend_emu.errors import ArgumentError, ShapeError
from kernels.attention import attention_flash_reference
from kernels.dynamic_quant import dynamic_quant_reference
from kernels.gating import moe_gating_top_k_reference
from kernels.grouped_matmul import grouped_matmul_reference
from kernels.mla import mla_prolog_reference
from kernels.rope import rope_angles, rope_sin_cos

from .config import ModelConfig

BF16 = torch.bfloat16


# ============================================================================================== weights
@dataclass
class AttnWeights:
    """MLA weights of one layer, as ``mla_prolog`` takes them, plus the value / output projections."""
    norm: torch.Tensor            # [H] bf16, input RMSNorm
    weight_dq: torch.Tensor       # [H, Hcq] bf16
    gamma_cq: torch.Tensor        # [Hcq] bf16
    weight_uq_qr: torch.Tensor    # [Hcq, N*(D+Dr)] bf16, per head [nope | rope], rope columns even/odd
    weight_uk: torch.Tensor       # [N, D, Hckv] bf16
    weight_dkv_kr: torch.Tensor   # [H, Hckv+Dr] bf16
    gamma_ckv: torch.Tensor       # [Hckv] bf16
    weight_uv: torch.Tensor       # [N, Hckv, Dv] bf16 (absorbed value up-projection, per head)
    wo: torch.Tensor              # [N*Dv, H] bf16
    wo_int8: "Int8Linear | None" = None     # W8A8 copy of wo (``init_weights(int8=True)``)


@dataclass
class Int8Linear:
    """A W8A8 linear: int8 weight [K, N] with per-output-channel fp32 ``scale`` [N]; activations are quantised per
    token at run time (dynamic INT8, ``kernels.dynamic_quant``)."""
    weight: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor) -> "Int8Linear":
        q, s = quantize_per_channel(w.float())
        return cls(q, s)


@dataclass
class FfnWeights:
    """A SwiGLU block: ``w13`` [K=H, 2F] ([gate | up]) and ``w2`` [F, H]; bf16 (dense / shared), with W8A8 copies
    when the model is quantised."""
    w13: torch.Tensor
    w2: torch.Tensor
    w13_int8: Int8Linear | None = None
    w2_int8: Int8Linear | None = None


@dataclass
class MoeWeights:
    """Router and experts of one MoE layer. Routed experts are int8 with per-output-channel fp32 scales."""
    router: torch.Tensor          # [H, E] bf16
    bias: torch.Tensor            # [E] fp32, e_score_correction_bias (selection only)
    w13: torch.Tensor             # [E, H, 2F] int8
    s13: torch.Tensor             # [E, 2F] fp32
    w2: torch.Tensor              # [E, F, H] int8
    s2: torch.Tensor              # [E, H] fp32
    shared: FfnWeights            # bf16, width n_shared_experts * F


@dataclass
class LayerWeights:
    attn: AttnWeights
    ffn_norm: torch.Tensor        # [H] bf16
    dense: FfnWeights | None = None
    moe: MoeWeights | None = None


@dataclass
class MtpWeights:
    enorm: torch.Tensor           # [H] bf16, RMSNorm of the next token's embedding
    hnorm: torch.Tensor           # [H] bf16, RMSNorm of the main model's last hidden state
    proj: torch.Tensor            # [2H, H] bf16
    layer: LayerWeights           # a dense decoder layer with its own latent cache


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor           # [V, H] bf16
    layers: list
    norm: torch.Tensor            # [H] bf16
    lm_head: torch.Tensor         # [H, V] bf16
    mtp: list = field(default_factory=list)
    int8: bool = False            # dense / shared FFNs and wo run W8A8

    @property
    def cache_layers(self) -> int:
        """Latent caches a sequence needs: one per decoder layer plus one per MTP layer."""
        return len(self.layers) + len(self.mtp)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K, N] float -> (int8 [..., K, N], fp32 scale [..., N]): ``quant.int8``'s symmetric round-to-nearest
    per output channel (scale = max|column| / 127, [-127, 127]) on the kernels' [K, N] layout."""
    from quant.int8 import channel_scales, quantize_weight_rtn
    if w.dim() > 2:
        qs = [quantize_per_channel(x) for x in w]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])
    wt = w.t()
    s = channel_scales(wt)
    return quantize_weight_rtn(wt, s).t().contiguous(), s


def init_weights(config: ModelConfig, seed: int = 0, *, int8: bool = False) -> ModelWeights:
    """Seeded random weights, N(0, 1/fan_in) so activations stay O(1); norms ~ 1. Deterministic in ``seed``.
    ``int8``: also quantise the dense / shared SwiGLU blocks and ``wo`` to W8A8 (``quantize_int8``)."""
    c = config
    g = torch.Generator().manual_seed(seed)

    def lin(k, n, *lead, std=None):
        return (torch.randn(*lead, k, n, generator=g) * (std or k ** -0.5)).to(BF16)

    def gamma(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(BF16)

    h, n, d, dr, dv = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    hcq, hckv, f = c.q_lora_rank, c.kv_lora_rank, c.moe_intermediate_size

    def attn():
        return AttnWeights(norm=gamma(h), weight_dq=lin(h, hcq), gamma_cq=gamma(hcq),
                           weight_uq_qr=lin(hcq, n * (d + dr)), weight_uk=lin(d, hckv, n, std=hckv ** -0.5),
                           weight_dkv_kr=lin(h, hckv + dr), gamma_ckv=gamma(hckv),
                           weight_uv=lin(hckv, dv, n), wo=lin(n * dv, h))

    def ffn(width):
        return FfnWeights(w13=lin(h, 2 * width), w2=lin(width, h))

    layers = []
    for i in range(c.num_hidden_layers):
        a, fn = attn(), gamma(h)
        if c.is_moe(i):
            e = c.n_routed_experts
            w13, s13 = quantize_per_channel(lin(h, 2 * f, e).float())
            w2, s2 = quantize_per_channel(lin(f, h, e).float())
            moe = MoeWeights(router=lin(h, e), bias=(0.05 * torch.randn(e, generator=g)).float(), w13=w13, s13=s13,
                             w2=w2, s2=s2, shared=ffn(c.n_shared_experts * f))
            layers.append(LayerWeights(a, fn, moe=moe))
        else:
            layers.append(LayerWeights(a, fn, dense=ffn(c.intermediate_size)))
    mtp = [MtpWeights(enorm=gamma(h), hnorm=gamma(h), proj=lin(2 * h, h),
                      layer=LayerWeights(attn(), gamma(h), dense=ffn(c.intermediate_size)))
           for _ in range(c.num_nextn_predict_layers)]
    w = ModelWeights(c, embed=torch.randn(c.vocab_size, h, generator=g).to(BF16), layers=layers, norm=gamma(h),
                     lm_head=lin(h, c.vocab_size), mtp=mtp)
    return quantize_int8(w) if int8 else w


def quantize_int8(w: ModelWeights) -> ModelWeights:
    """Add W8A8 copies (symmetric per output channel, round to nearest) of every dense / shared SwiGLU block and of
    ``wo``; the runner and the reference then use them. Routed experts are always W8A8; MLA projections stay bf16;
    lm_head and the router stay bf16. In place; returns ``w``."""
    for lw in list(w.layers) + [m.layer for m in w.mtp]:
        lw.attn.wo_int8 = Int8Linear.of(lw.attn.wo)
        for f in (lw.dense, lw.moe.shared if lw.moe is not None else None):
            if f is not None:
                f.w13_int8, f.w2_int8 = Int8Linear.of(f.w13), Int8Linear.of(f.w2)
    w.int8 = True
    return w


def load_deepseek_state_dict(config: ModelConfig, sd: dict) -> ModelWeights:
    """Loader hook for real checkpoints: DeepSeek-V3 HF names (``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.q_a_proj.weight`` ..., ``nn.Linear`` weights [out, in]) -> ``ModelWeights``.
    Routed experts are quantised per output channel here (an fp8 checkpoint must be dequantised first); the
    rope columns are permuted to the library's order. MTP layers (``model.layers.{num_hidden_layers + j}``) load
    when present."""
    from kernels.rope import deinterleave_rope_columns
    c = config
    n, d, dr, dv, hckv = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                          c.kv_lora_rank)

    def get(name):
        try:
            return sd[name].to(BF16)
        except KeyError:
            raise ArgumentError(f"checkpoint has no tensor {name!r}") from None

    def t(name):
        return get(name).t().contiguous()

    def attn(p):
        wkv_b = get(f"{p}.self_attn.kv_b_proj.weight").reshape(n, d + dv, hckv)
        return AttnWeights(
            norm=get(f"{p}.input_layernorm.weight"), weight_dq=t(f"{p}.self_attn.q_a_proj.weight"),
            gamma_cq=get(f"{p}.self_attn.q_a_layernorm.weight"),
            weight_uq_qr=deinterleave_rope_columns(t(f"{p}.self_attn.q_b_proj.weight"), d + dr, dr).contiguous(),
            weight_uk=wkv_b[:, :d].contiguous(),
            weight_dkv_kr=deinterleave_rope_columns(t(f"{p}.self_attn.kv_a_proj_with_mqa.weight"), hckv + dr,
                                                    dr).contiguous(),
            gamma_ckv=get(f"{p}.self_attn.kv_a_layernorm.weight"),
            weight_uv=wkv_b[:, d:].transpose(1, 2).contiguous(), wo=t(f"{p}.self_attn.o_proj.weight"))

    def ffn(p):
        return FfnWeights(w13=torch.cat([t(f"{p}.gate_proj.weight"), t(f"{p}.up_proj.weight")], 1),
                          w2=t(f"{p}.down_proj.weight"))

    def layer(i):
        p = f"model.layers.{i}"
        a, fn = attn(p), get(f"{p}.post_attention_layernorm.weight")
        if not c.is_moe(i) or i >= c.num_hidden_layers:
            return LayerWeights(a, fn, dense=ffn(f"{p}.mlp"))
        e = c.n_routed_experts
        w13 = torch.stack([torch.cat([t(f"{p}.mlp.experts.{j}.gate_proj.weight"),
                                      t(f"{p}.mlp.experts.{j}.up_proj.weight")], 1) for j in range(e)])
        w2 = torch.stack([t(f"{p}.mlp.experts.{j}.down_proj.weight") for j in range(e)])
        q13, s13 = quantize_per_channel(w13.float())
        q2, s2 = quantize_per_channel(w2.float())
        return LayerWeights(a, fn, moe=MoeWeights(
            router=t(f"{p}.mlp.gate.weight"), bias=sd[f"{p}.mlp.gate.e_score_correction_bias"].float(),
            w13=q13, s13=s13, w2=q2, s2=s2, shared=ffn(f"{p}.mlp.shared_experts")))

    mtp = []
    for j in range(c.num_nextn_predict_layers):
        i = c.num_hidden_layers + j
        p = f"model.layers.{i}"
        mtp.append(MtpWeights(enorm=get(f"{p}.enorm.weight"), hnorm=get(f"{p}.hnorm.weight"),
                              proj=t(f"{p}.eh_proj.weight"), layer=layer(i)))
    return ModelWeights(c, embed=get("model.embed_tokens.weight"),
                        layers=[layer(i) for i in range(c.num_hidden_layers)], norm=get("model.norm.weight"),
                        lm_head=t("lm_head.weight"), mtp=mtp)


def to_deepseek_state_dict(w: ModelWeights) -> dict:
    """Inverse of ``load_deepseek_state_dict`` (routed experts dequantised): for tests and for exporting."""
    c = w.config
    n, d, dr, dv, hckv = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                          c.kv_lora_rank)
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head.t()}

    def put_ffn(p, f: FfnWeights):
        width = f.w2.shape[0]
        sd[f"{p}.gate_proj.weight"] = f.w13[:, :width].t()
        sd[f"{p}.up_proj.weight"] = f.w13[:, width:].t()
        sd[f"{p}.down_proj.weight"] = f.w2.t()

    def put_layer(p, lw: LayerWeights):
        a = lw.attn
        sd[f"{p}.input_layernorm.weight"] = a.norm
        sd[f"{p}.self_attn.q_a_proj.weight"] = a.weight_dq.t()
        sd[f"{p}.self_attn.q_a_layernorm.weight"] = a.gamma_cq
        sd[f"{p}.self_attn.q_b_proj.weight"] = interleave_rope_columns(a.weight_uq_qr, d + dr, dr).t()
        sd[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = interleave_rope_columns(a.weight_dkv_kr, hckv + dr, dr).t()
        sd[f"{p}.self_attn.kv_a_layernorm.weight"] = a.gamma_ckv
        sd[f"{p}.self_attn.kv_b_proj.weight"] = torch.cat([a.weight_uk, a.weight_uv.transpose(1, 2)],
                                                          1).reshape(n * (d + dv), hckv)
        sd[f"{p}.self_attn.o_proj.weight"] = a.wo.t()
        sd[f"{p}.post_attention_layernorm.weight"] = lw.ffn_norm
        if lw.dense is not None:
            put_ffn(f"{p}.mlp", lw.dense)
        else:
            m = lw.moe
            sd[f"{p}.mlp.gate.weight"] = m.router.t()
            sd[f"{p}.mlp.gate.e_score_correction_bias"] = m.bias
            w13 = m.w13.float() * m.s13[:, None, :]
            w2 = m.w2.float() * m.s2[:, None, :]
            for j in range(m.w13.shape[0]):
                put_ffn(f"{p}.mlp.experts.{j}", FfnWeights(w13[j], w2[j]))
            put_ffn(f"{p}.mlp.shared_experts", m.shared)

    for i, lw in enumerate(w.layers):
        put_layer(f"model.layers.{i}", lw)
    for j, m in enumerate(w.mtp):
        p = f"model.layers.{c.num_hidden_layers + j}"
        sd[f"{p}.enorm.weight"], sd[f"{p}.hnorm.weight"], sd[f"{p}.eh_proj.weight"] = m.enorm, m.hnorm, m.proj.t()
        put_layer(p, m.layer)
    return sd


def interleave_rope_columns(w: torch.Tensor, group: int, rope_dim: int) -> torch.Tensor:
    """Inverse of ``kernels.rope.deinterleave_rope_columns``: back to DeepSeek's interleaved-pair columns."""
    from kernels.rope import interleave
    k, n = w.shape
    g = w.reshape(k, n // group, group)
    return torch.cat([g[..., :group - rope_dim], interleave(g[..., group - rope_dim:])], -1).reshape(k, n)


# ============================================================================================== shared math
def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] bf16 -> bf16: fp32 x * rsqrt(mean(x^2) + eps) * gamma, one rounding."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(BF16)


def rope_tables(positions, rope_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_sin, rope_cos [T, Dr] bf16 for integer positions (the prolog's inputs)."""
    return rope_sin_cos(rope_angles(positions, rope_dim, base))


def gemm(x: torch.Tensor, w: torch.Tensor, out_dtype=BF16, *, swiglu: bool = False) -> torch.Tensor:
    """x [T, K] bf16 @ w [K, N] bf16 the way the cube does it: fp32 partial products of K steps of 64 summed in
    order (``kernels.grouped_matmul``'s bf16 K step), optional SwiGLU on the [gate | up] halves in fp32, one
    rounding to ``out_dtype``."""
    from kernels.grouped_matmul import BASE_K
    ks = BASE_K["bf16"]
    acc = None
    for k0 in range(0, x.shape[1], ks):
        part = x[:, k0:k0 + ks].float() @ w[k0:k0 + ks].float()
        acc = part if acc is None else acc + part
    if acc is None:
        acc = torch.zeros(x.shape[0], w.shape[1])
    if swiglu:
        n = acc.shape[1] // 2
        acc = torch.nn.functional.silu(acc[:, :n]) * acc[:, n:]
    return acc.to(out_dtype)


def w8a8(x: torch.Tensor, lin: Int8Linear, *, swiglu: bool = False) -> torch.Tensor:
    """x [T, K] bf16 -> per-token dynamic INT8 -> exact int32 GEMM -> * token scale * channel scale (-> SwiGLU)
    -> bf16 (``kernels.dynamic_quant`` + ``kernels.grouped_matmul``'s int8 epilogue)."""
    xq, xs = dynamic_quant_reference(x)
    return grouped_matmul_reference(xq, lin.weight[None], group_list=[x.shape[0]], scale=lin.scale[None],
                                    per_token_scale=xs, swiglu=swiglu)[0]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[T, V] fp32 -> [T] int64, ties to the lowest id."""
    return torch.sort(logits, dim=-1, descending=True, stable=True)[1][:, 0]


def mtp_input(w: MtpWeights, h_last: torch.Tensor, next_emb: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] bf16 main hidden (before the final norm) and next-token embeddings -> the MTP layer's input bf16."""
    cat = torch.cat([rms_norm(next_emb, w.enorm, eps), rms_norm(h_last, w.hnorm, eps)], 1)
    return gemm(cat, w.proj)


# ============================================================================================== reference
class ReferenceModel:
    """Plain-torch forward of one sequence at a time, with a contiguous latent cache per layer (no paging, no
    batching, no kernels: each op is the fp32/int torch formula the kernel's own reference states).

    ``generate(prompt, max_tokens)`` -> greedy tokens. ``mtp_drafts`` (when the config has an MTP head) gives what
    the MTP head proposes after each accepted token, for checking the runner's drafts."""

    def __init__(self, weights: ModelWeights):
        self.w = weights
        self.c = weights.config

    # ---------------------------------------------------------------------------------------- one layer
    def attention(self, a: AttnWeights, x: torch.Tensor, pos: torch.Tensor, cache: dict) -> torch.Tensor:
        """x [T, H] bf16 at positions ``pos`` (appended to ``cache`` {"kv": [L, Hckv], "kr": [L, Dr]} bf16) ->
        attention output after wo [T, H] bf16."""
        c = self.c
        t = x.shape[0]
        h = rms_norm(x, a.norm, c.rms_norm_eps)
        sin, cos = rope_tables(pos, c.qk_rope_head_dim, c.rope_theta)
        r = mla_prolog_reference(h, a.weight_dq, a.weight_uq_qr, a.weight_uk, a.weight_dkv_kr, a.gamma_cq,
                                 a.gamma_ckv, sin, cos, rmsnorm_epsilon_cq=c.rms_norm_eps,
                                 rmsnorm_epsilon_ckv=c.rms_norm_eps)
        start = int(pos[0])
        cache["kv"] = torch.cat([cache["kv"][:start], r["kv"].to(BF16)])
        cache["kr"] = torch.cat([cache["kr"][:start], r["kr"].to(BF16)])
        L = cache["kv"].shape[0]
        pages = -(-L // 16) + 1                      # 16-row pages, one spare: the kernel reads kv steps
        kv = torch.zeros(pages * 16, c.kv_lora_rank, dtype=BF16)   # rounded up to 16 rows (masked)
        kr = torch.zeros(pages * 16, c.qk_rope_head_dim, dtype=BF16)
        kv[:L], kr[:L] = cache["kv"], cache["kr"]
        o = attention_flash_reference(r["query"].to(BF16)[None], r["query_rope"].to(BF16)[None],
                                      kv.reshape(pages, 16, 1, -1), kr.reshape(pages, 16, 1, -1),
                                      torch.arange(pages)[None], [L], c.softmax_scale)[0]
        return self.out_proj(a, o.reshape(t, c.num_attention_heads, -1))

    def out_proj(self, a: AttnWeights, o: torch.Tensor) -> torch.Tensor:
        """o [T, N, Hckv] bf16 -> W_uv per head -> [T, N*Dv] -> wo -> [T, H] bf16."""
        t, n, _ = o.shape
        v = torch.stack([gemm(o[:, i], a.weight_uv[i]) for i in range(n)], 1).reshape(t, -1)
        return w8a8(v, a.wo_int8) if a.wo_int8 is not None else gemm(v, a.wo)

    def ffn(self, f: FfnWeights, h: torch.Tensor) -> torch.Tensor:
        if f.w13_int8 is not None:
            return w8a8(w8a8(h, f.w13_int8, swiglu=True), f.w2_int8)
        return gemm(gemm(h, f.w13, swiglu=True), f.w2)

    def route(self, m: MoeWeights, h: torch.Tensor):
        """h [T, H] bf16 -> (weights fp32 [T, k], logical expert ids int32 [T, k])."""
        c = self.c
        logits = gemm(h, m.router, torch.float32)
        y, idx, _ = moe_gating_top_k_reference(logits, c.num_experts_per_tok, bias=m.bias, k_group=c.topk_group,
                                               group_count=c.n_group, group_select_mode=1,
                                               routed_scaling_factor=c.routed_scaling_factor)
        return y, idx

    def expert(self, m: MoeWeights, e: int, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """One routed expert on int8 rows ``xq`` [n, H] with per-token scales ``xs`` [n] -> bf16 [n, H]."""
        n = xq.shape[0]
        g = grouped_matmul_reference(xq, m.w13[e:e + 1], group_list=[n], scale=m.s13[e:e + 1], per_token_scale=xs,
                                     swiglu=True)[0]
        gq, gs = dynamic_quant_reference(g)
        return grouped_matmul_reference(gq, m.w2[e:e + 1], group_list=[n], scale=m.s2[e:e + 1],
                                        per_token_scale=gs)[0]

    def moe(self, m: MoeWeights, h: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(m, h)
        xq, xs = dynamic_quant_reference(h)
        acc = self.ffn(m.shared, h).float()
        for t in range(h.shape[0]):
            for k in range(idx.shape[1]):
                y = self.expert(m, int(idx[t, k]), xq[t:t + 1], xs[t:t + 1])[0]
                acc[t] += w[t, k] * y.float()
        return acc.to(BF16)

    def layer(self, lw: LayerWeights, x, pos, cache):
        x = x + self.attention(lw.attn, x, pos, cache)
        h = rms_norm(x, lw.ffn_norm, self.c.rms_norm_eps)
        return x + (self.ffn(lw.dense, h) if lw.dense is not None else self.moe(lw.moe, h))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.w.norm, self.c.rms_norm_eps)
        return gemm(h, self.w.lm_head, torch.float32)

    # ---------------------------------------------------------------------------------------- sequences
    def new_caches(self) -> list:
        c = self.c
        return [{"kv": torch.zeros(0, c.kv_lora_rank, dtype=BF16), "kr": torch.zeros(0, c.qk_rope_head_dim,
                                                                                       dtype=BF16)}
                for _ in range(self.w.cache_layers)]

    def forward(self, tokens, start: int, caches: list) -> torch.Tensor:
        """Run ``tokens`` at positions start.. through the decoder; returns the last hidden states [T, H] bf16
        (before the final norm)."""
        x = self.w.embed[torch.as_tensor(tokens, dtype=torch.long)]
        pos = torch.arange(start, start + len(tokens))
        for lw, cache in zip(self.w.layers, caches):
            x = self.layer(lw, x, pos, cache)
        return x

    def mtp_forward(self, h_last: torch.Tensor, next_tokens, start: int, cache: dict, depth: int = 0):
        """The MTP layer on main hidden states ``h_last`` [T, H] (positions start..) and the tokens that follow
        each of them -> draft logits [T, V] fp32."""
        m = self.w.mtp[depth]
        e = self.w.embed[torch.as_tensor(next_tokens, dtype=torch.long)]
        x = mtp_input(m, h_last, e, self.c.rms_norm_eps)
        x = self.layer(m.layer, x, torch.arange(start, start + x.shape[0]), cache)
        return self.logits(x)

    def generate(self, prompt, max_tokens: int) -> list:
        """Greedy continuation of ``prompt`` (token ids): ``max_tokens`` new ids."""
        if not len(prompt):
            raise ShapeError("prompt is empty: need at least one token")
        if max_tokens < 1:
            raise ArgumentError(f"max_tokens={max_tokens} must be >= 1")
        caches = self.new_caches()
        out = []
        tokens, start = list(prompt), 0
        for _ in range(max_tokens):
            x = self.forward(tokens, start, caches)
            nxt = int(greedy(self.logits(x[-1:]))[0])
            out.append(nxt)
            start += len(tokens)
            tokens = [nxt]
        return out
