"""Fused compute kernels on the emulator, each with a torch reference (DESIGN.md section 5).

Names and arguments mirror torch_npu; one host drives many dies, so most take per-rank inputs (``Ranks([...])``, or a
leading rank dimension) and return per-rank outputs plus the run's timing (``.run``). ``kernels.npu`` is torch_npu's
own API (one rank's view, torch_npu's lists and output tuples) for scripts run through ``ascend_emu.spmd``.
"""
from .attention import (AttentionResult, attention_flash_reference, attention_reference, attention_reference_naive,
                        mla_decode_attention,
                        mla_decode_attention_timing)
from .dispatch_layout import (DispatchLayout, WindowTensor, combine_buffer_size_hint, dispatch_buffer_size_hint,
                              get_dispatch_layout, moe_buffer_layout)
from .dynamic_quant import DynamicQuantResult, dynamic_quant, dynamic_quant_reference
from .fused_moe import (DispatchResult, MoeGroup, combine_reference, dispatch_reference, moe_distribute_combine,
                        moe_distribute_dispatch)
from .gating import (GatingResult, GatingSoftmaxResult, gating_select_reference, moe_gating_top_k,
                     moe_gating_top_k_reference, moe_gating_top_k_softmax, moe_gating_top_k_softmax_reference)
from .grouped_matmul import GroupedMatmulResult, grouped_matmul, grouped_matmul_reference
from .ranks import Ranks
from .mla import (MlaPrologResult, deepseek_mla_reference, mla_prolog, mla_prolog_reference, mla_prolog_timing,
                  prolog_weights_from_deepseek)

__all__ = [
    "Ranks", "rope", "dynamic_quant", "dynamic_quant_reference", "DynamicQuantResult",
    "moe_gating_top_k", "moe_gating_top_k_reference", "moe_gating_top_k_softmax",
    "moe_gating_top_k_softmax_reference", "gating_select_reference", "GatingResult", "GatingSoftmaxResult",
    "grouped_matmul", "grouped_matmul_reference", "GroupedMatmulResult",
    "MoeGroup", "moe_distribute_dispatch", "moe_distribute_combine", "DispatchResult", "dispatch_reference",
    "combine_reference", "get_dispatch_layout", "DispatchLayout", "moe_buffer_layout", "WindowTensor",
    "dispatch_buffer_size_hint", "combine_buffer_size_hint",
    "mla_prolog", "mla_prolog_timing", "mla_prolog_reference", "deepseek_mla_reference",
    "prolog_weights_from_deepseek", "MlaPrologResult",
    "mla_decode_attention", "mla_decode_attention_timing", "attention_reference", "attention_reference_naive",
    "attention_flash_reference",
    "AttentionResult",
]


def __getattr__(name):
    """``kernels.rope`` on first use: it imports torch (about 2 s of CPU), which timing-only runs never need."""
    if name == "rope":
        import importlib
        return importlib.import_module(".rope", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
