"""Offline INT8 post-training quantisation: SmoothQuant, GPTQ, scale search, clipping, KV-cache INT8, QuantLinear.

Stands alone on numpy/torch (DESIGN.md section 6); QuantLinear's emulator backend imports ``kernels`` lazily.

    report = quant.quantize_model(model, calib_batches, scheme="w8a8")      # in place: nn.Linear -> QuantLinear
    g = quant.gptq_quantize(w, H)                                           # int8 [N, K], fp32 scale [N]
"""
from .calibrate import Calibration, InputStats, calibrate
from .errors import CalibrationError, CholeskyError, ModelNotAvailable, QuantError
from .gptq import (GPTQResult, HessianFactor, factor_hessian, gptq_quantize, inverse_hessian_cholesky, output_energy,
                   output_error)
from .int8 import channel_scales, dequantize_weight, int8_gemm, quantize_per_token, quantize_weight_rtn, w8a8_matmul
from .kvcache import KVQuant, channel_quant_scale, quantize_kv, quantize_latent
from .model import LayerReport, QuantReport, linear_layers, quantize_model, set_backend
from .qlinear import QuantLinear
from .search import DEFAULT_ALPHAS, ScaleSearch, search_clip, search_smooth_scale, w8a8_error
from .smoothquant import fold_into_norm, smooth_hessian, smooth_scales

__all__ = [
    "Calibration", "InputStats", "calibrate", "CalibrationError", "CholeskyError", "ModelNotAvailable", "QuantError",
    "GPTQResult", "HessianFactor", "factor_hessian", "gptq_quantize", "inverse_hessian_cholesky", "output_energy",
    "output_error", "channel_scales", "dequantize_weight",
    "int8_gemm", "quantize_per_token", "quantize_weight_rtn", "w8a8_matmul", "KVQuant", "channel_quant_scale",
    "quantize_kv", "quantize_latent", "LayerReport", "QuantReport", "linear_layers", "quantize_model", "set_backend",
    "QuantLinear", "DEFAULT_ALPHAS", "ScaleSearch", "search_clip", "search_smooth_scale", "w8a8_error",
    "fold_into_norm", "smooth_hessian", "smooth_scales",
]
