"""Where a ``kernels.npu`` operator runs and what it accepts: the calling rank's die (inside ``ascend_emu.spmd``), the
runs kept per pod, and the argument checks every torch_npu-style operator shares.
"""
from __future__ import annotations

import weakref

from ascend_emu.errors import ArgumentError, DTypeError, ShapeError
from ascend_emu.spmd import current, in_spmd

_RUNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()      # pod -> [(operator, RunResult)]


def placement():
    """(pod, dies) for the calling rank inside ``ascend_emu.spmd``, else (None, None): a fresh one-die pod."""
    if in_spmd():
        ctx = current()
        return ctx.pod, [ctx.die]
    return None, None


def record(pod, name: str, run) -> None:
    """Keep an operator's run for ``runs(pod)`` (runs on a fresh pod outside spmd are not kept)."""
    if pod is not None:
        _RUNS.setdefault(pod, []).append((name, run))


def runs(pod) -> list:
    """[(operator name, RunResult)] of every ``kernels.npu`` operator run on ``pod``, in order."""
    return list(_RUNS.get(pod, []))


def tensor(value, name: str, *, dtypes=None, ndim=None):
    """A torch tensor (torch_npu takes one tensor here: a list is never read as ranks), checked."""
    import torch
    if not isinstance(value, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor (one rank's data), got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise DTypeError(f"{name} dtype {value.dtype} not supported: use {', '.join(str(d) for d in dtypes)}")
    if ndim is not None and value.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ShapeError(f"{name} must have {ndim} dims, got shape {tuple(value.shape)}")
    return value


def unmodeled(**values) -> None:
    """Arguments this emulator does not model must keep torch_npu's default (None, 0, "" ...)."""
    for name, (value, default) in values.items():
        if (value is not None) if default is None else (value is not default and value != default):
            raise ArgumentError(f"{name}={value!r} is not modeled: pass the default {default!r} (see the README's "
                                f"torch_npu parity table)")
