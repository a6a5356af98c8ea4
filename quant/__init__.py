"""Offline INT8 post-training quantisation: SmoothQuant, GPTQ, scale search, clipping, KV-cache INT8, QuantLinear.

Stands alone on numpy/torch (DESIGN.md section 6); QuantLinear's emulator backend imports ``kernels`` lazily.

    report = quant.quantize_model(model, calib_batches, scheme="w8a8")      # in place: nn.Linear -> QuantLinear
    g = quant.gptq_quantize(w, H)                                           # int8 [N, K], fp32 scale [N]
"""
import lazy_loader

from .calibrate import Calibration, InputStats, calibrate
from .errors import CalibrationError, CholeskyError, ModelNotAvailable, QuantError

# the rest on first use: they import torch (about 2 s of CPU), which ``ascend-emu`` commands other than ``quantize``
# never need (the CLI imports ``quant.cli`` to register that command)
_EXPORTS = {name: module for module, names in {
    "gptq": ("GPTQResult", "HessianFactor", "factor_hessian", "gptq_quantize", "inverse_hessian_cholesky",
             "output_energy", "output_error"),
    "int8": ("channel_scales", "dequantize_weight", "int8_gemm", "quantize_per_token", "quantize_weight_rtn",
             "w8a8_matmul"),
    "kvcache": ("KVQuant", "channel_quant_scale", "quantize_kv", "quantize_latent"),
    "model": ("LayerReport", "QuantReport", "linear_layers", "quantize_model", "set_backend"),
    "qlinear": ("QuantLinear",),
    "search": ("DEFAULT_ALPHAS", "ScaleSearch", "search_clip", "search_smooth_scale", "w8a8_error"),
    "smoothquant": ("fold_into_norm", "smooth_hessian", "smooth_scales"),
}.items() for name in names}


# resolved on first use and then kept on the package (lazy_loader caches it)
__getattr__, _, _ = lazy_loader.attach(__name__, submod_attrs={
    module: [n for n, m in _EXPORTS.items() if m == module] for module in set(_EXPORTS.values())})


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "Calibration", "InputStats", "calibrate", "CalibrationError", "CholeskyError", "ModelNotAvailable", "QuantError",
    "GPTQResult", "HessianFactor", "factor_hessian", "gptq_quantize", "inverse_hessian_cholesky", "output_energy",
    "output_error", "channel_scales", "dequantize_weight",
    "int8_gemm", "quantize_per_token", "quantize_weight_rtn", "w8a8_matmul", "KVQuant", "channel_quant_scale",
    "quantize_kv", "quantize_latent", "LayerReport", "QuantReport", "linear_layers", "quantize_model", "set_backend",
    "QuantLinear", "DEFAULT_ALPHAS", "ScaleSearch", "search_clip", "search_smooth_scale", "w8a8_error",
    "fold_into_norm", "smooth_hessian", "smooth_scales",
]
