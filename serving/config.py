"""Model configurations: a mini DeepSeek-V3-shaped decoder for numeric runs and the real V3 shapes for timing runs.

Field names follow DeepSeek-V3's ``config.json`` where one exists. Sizes are elements; the kernels need the MLA
widths (hidden, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim) to be multiples of 16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ascend_emu.errors import ArgumentError


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-style decoder: MLA with q-LoRA, ``first_k_dense_replace`` dense SwiGLU layers, then MoE layers
    (sigmoid group-limited routing with a selection bias, routed + shared SwiGLU experts), RMSNorm, tied nothing,
    optional MTP head (``num_nextn_predict_layers``)."""
    name: str = "mini"
    vocab_size: int = 512
    hidden_size: int = 256
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    intermediate_size: int = 512            # dense layers' SwiGLU width
    moe_intermediate_size: int = 128        # each expert's SwiGLU width
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_nextn_predict_layers: int = 0       # MTP depth (0 = no MTP head)
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for name in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            v = getattr(self, name)
            if v <= 0 or v % 16:
                raise ArgumentError(f"{name}={v} must be a positive multiple of 16 (MLA kernel tiles)")
        if self.n_routed_experts % self.n_group:
            raise ArgumentError(f"n_routed_experts={self.n_routed_experts} must be a multiple of "
                                f"n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ArgumentError(f"topk_group={self.topk_group} out of range 1..n_group={self.n_group}")
        if not 1 <= self.num_experts_per_tok <= min(8, self.n_routed_experts):
            raise ArgumentError(f"num_experts_per_tok={self.num_experts_per_tok} out of range "
                                f"1..{min(8, self.n_routed_experts)}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ArgumentError(f"first_k_dense_replace={self.first_k_dense_replace} out of range "
                                f"0..num_hidden_layers={self.num_hidden_layers}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim) (the mini model has no YaRN extension)."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def replace(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


MINI = ModelConfig()

# DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3); the YaRN softmax scale of the real model (mscale^2 / sqrt(192)
# with factor 40, mscale_all_dim 1.0) is 0.1352; V3 runs are timing-only, so the scale does not change any number.
V3 = ModelConfig(name="v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3,
                 intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                 num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, num_attention_heads=128,
                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 num_nextn_predict_layers=1, max_position_embeddings=163840)

CONFIGS = {"mini": MINI, "v3": V3}


def get_config(name: str) -> ModelConfig:
    """``"mini"`` or ``"v3"``."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise ArgumentError(f"config={name!r}: use one of {sorted(CONFIGS)}") from None
