"""Tiny seeded Llama-style and MoE models for tests, benches and ``ascend-emu quantize --model toy``.

ToyLM: embedding -> L x [RMSNorm -> q/k/v -> causal attention -> o_proj; RMSNorm -> gate/up -> SiLU -> down] ->
RMSNorm -> lm_head. ``outliers`` multiplies a few channels of each norm weight (activation outliers, as in real LLMs).
ToyMoE: the MLP is a top-1 router over ``num_experts`` experts (``mlp.experts.<i>.{gate,up,down}_proj``) whose router
is skewed so that the last experts see few tokens.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        sh = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(sh(self.q_proj(x)), sh(self.k_proj(x)), sh(self.v_proj(x)), is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-1 routing; router bias falls off linearly so expert e gets roughly exp(-skew * e)-weighted traffic."""

    def __init__(self, d: int, f: int, num_experts: int, skew: float):
        super().__init__()
        self.router = nn.Linear(d, num_experts, bias=True)
        with torch.no_grad():
            self.router.bias.copy_(-skew * torch.arange(num_experts, dtype=torch.float32))
        self.experts = nn.ModuleList(MLP(d, f) for _ in range(num_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        pick = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e, ex in enumerate(self.experts):
            rows = torch.nonzero(pick == e).reshape(-1)
            if rows.numel():
                out[rows] = ex(flat[rows])
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, d, f, heads, num_experts, skew):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.self_attn = Attention(d, heads)
        self.mlp = MLP(d, f) if num_experts == 0 else MoE(d, f, num_experts, skew)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Output:
    def __init__(self, logits):
        self.logits = logits


class ToyLM(nn.Module):
    """model(ids [B, T] int64).logits -> [B, T, vocab] fp32."""

    def __init__(self, vocab: int = 256, d: int = 128, f: int = 256, layers: int = 2, heads: int = 4,
                 num_experts: int = 0, skew: float = 0.0, outliers: float = 20.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, heads, num_experts, skew) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("router.bias"):
                    continue
                if p.ndim == 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                elif name.endswith("layernorm.weight"):
                    w = 1 + 0.1 * torch.randn(p.shape, generator=g)
                    hot = torch.randperm(p.numel(), generator=g)[:max(1, p.numel() // 32)]
                    w[hot] *= outliers
                    p.copy_(w)
            self.embed_tokens.weight.mul_(d ** 0.5 / 4)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for blk in self.layers:
            x = blk(x)
        return Output(self.lm_head(self.norm(x)))


def random_batches(num: int, seq_len: int = 64, vocab: int = 256, batch: int = 1, seed: int = 0) -> list:
    """``num`` int64 id tensors [batch, seq_len] drawn with a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq_len), generator=g) for _ in range(num)]
