"""Calibration: forward hooks that collect, per linear-layer input, the per-channel activation absmax, the GPTQ
Hessian and a small sample of rows, without storing all activations; MoE expert coverage with top-up.

Linear layers fed the *same tensor object* in a forward (q/k/v after one RMSNorm, gate/up) form one ``InputStats``
group and share statistics. If that tensor is the output of a norm module (RMSNorm/LayerNorm), the group records it:
a SmoothQuant scale can be folded into that norm's weight. Groups are discovered the first time each layer runs.
Assumption (true for Llama/Mistral/DeepSeek-style blocks): a norm whose output reaches a linear layer feeds only the
linear layers of that group.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from .errors import CalibrationError

# torch loads where it is used: ``ascend-emu`` imports ``quant`` for its command, and the package imports this module
# eagerly (its attribute ``calibrate`` must be this module's function, not the module)
EXPERT_RE = re.compile(r"^(.*\.experts\.\d+)\.")


def norm_types() -> tuple:
    """The torch norm classes (LayerNorm, RMSNorm) SmoothQuant folds into."""
    from torch import nn
    return nn.LayerNorm, nn.RMSNorm


def __getattr__(name):
    if name == "NORM_TYPES":          # the old constant, kept
        return norm_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_norm(m: nn.Module) -> bool:
    """LayerNorm / torch RMSNorm, or any module whose class name ends in 'RMSNorm' / 'LayerNorm' with a weight [K]."""
    import torch
    name = type(m).__name__
    return isinstance(m, norm_types()) or ((name.endswith("RMSNorm") or name.endswith("LayerNorm"))
                                         and isinstance(getattr(m, "weight", None), torch.Tensor))


@dataclass
class InputStats:
    """Statistics of one input tensor shared by the linear layers in ``layers`` (K input channels).

    absmax: [K] fp32 max |x_j| over every calibration token. hessian_sum: [K, K] fp64 sum of x^T x.
    sample: [S, K] fp32 rows kept by seeded reservoir sampling (S <= sample_rows). num_tokens: rows seen.
    norm: name of the norm module whose output this is (SmoothQuant can fold into it), or None."""
    layers: list[str]
    absmax: torch.Tensor
    hessian_sum: torch.Tensor
    sample: torch.Tensor
    num_tokens: int = 0
    norm: str | None = None
    _gen: torch.Generator | None = field(default=None, repr=False)
    _capacity: int = 0

    @classmethod
    def empty(cls, layers: list[str], k: int, sample_rows: int = 512, seed: int = 0, norm: str | None = None
              ) -> "InputStats":
        """No tokens yet: K input channels, a reservoir of ``sample_rows`` rows seeded with ``seed``."""
        import torch
        return cls(list(layers), torch.zeros(k), torch.zeros(k, k, dtype=torch.float64), torch.zeros(0, k), 0, norm,
                   torch.Generator().manual_seed(seed), int(sample_rows))

    @property
    def in_features(self) -> int:
        return int(self.absmax.numel())

    def hessian(self) -> torch.Tensor:
        """GPTQ Hessian H = 2/n X^T X, [K, K] fp64 (zeros if no token was seen)."""
        return self.hessian_sum * (2.0 / max(self.num_tokens, 1))

    def add(self, x: torch.Tensor) -> None:
        """Accumulate rows x [T, K]."""
        import torch
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))
        self.hessian_sum += (x.t() @ x).double()          # one batch's sum in fp32, the running sum in fp64
        self._reservoir(x)
        self.num_tokens += x.shape[0]

    def _reservoir(self, x: torch.Tensor) -> None:
        """Algorithm R with a seeded generator: every row seen so far is kept with equal probability."""
        import torch
        n0, cap = self.num_tokens, self._capacity
        take = max(0, min(cap - n0, x.shape[0]))
        if take:
            self.sample = torch.cat([self.sample, x[:take]])
        if take == x.shape[0]:
            return
        idx = torch.arange(n0 + take, n0 + x.shape[0], dtype=torch.float64) + 1
        slot = (torch.rand(idx.numel(), generator=self._gen, dtype=torch.float64) * idx).long()
        for r in torch.nonzero(slot < cap).reshape(-1).tolist():
            self.sample[int(slot[r])] = x[take + r]


@dataclass
class Calibration:
    """Result of ``calibrate``: per-group stats, the group of each layer, tokens per expert, batches consumed."""
    groups: list[InputStats]
    group_of: dict[str, int]
    expert_tokens: dict[str, int]
    num_batches: int
    num_tokens: int

    def stats(self, layer: str) -> InputStats:
        return self.groups[self.group_of[layer]]


class Calibrator:
    """Forward hooks on ``layers`` (name -> nn.Linear) and on every norm of ``model``. Use as a context manager."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Linear], sample_rows: int = 512, seed: int = 0):
        if sample_rows < 1:
            raise CalibrationError(f"sample_rows={sample_rows}: need at least 1")
        self.model, self.layers = model, layers
        self.sample_rows, self.seed = int(sample_rows), int(seed)
        self.groups: list[InputStats] = []
        self.group_of: dict[str, int] = {}
        self._live: dict[int, tuple[torch.Tensor, int]] = {}      # id -> (tensor kept alive, group) this forward
        self._norm_out: dict[int, tuple[torch.Tensor, str]] = {}
        self._handles = []

    def __enter__(self):
        self._handles.append(self.model.register_forward_pre_hook(self._reset))
        self._handles.append(self.model.register_forward_hook(self._reset_post))
        for name, mod in self.model.named_modules():
            if is_norm(mod):
                self._handles.append(mod.register_forward_hook(self._norm_hook(name)))
        for name, lin in self.layers.items():
            self._handles.append(lin.register_forward_pre_hook(self._linear_hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._reset()
        return False

    def _reset(self, *args):
        self._live.clear()
        self._norm_out.clear()

    def _reset_post(self, *args):
        self._reset()

    def _norm_hook(self, name):
        import torch

        def hook(mod, inp, out):
            if torch.is_tensor(out):
                self._norm_out[id(out)] = (out, name)
        return hook

    def _linear_hook(self, name):
        def hook(mod, inp):
            x = inp[0]
            g = self.group_of.get(name)
            if g is None:
                hit = self._live.get(id(x))
                if hit is not None and hit[0] is x:
                    g = hit[1]
                    self.groups[g].layers.append(name)
                else:
                    g = len(self.groups)
                    k = x.shape[-1]
                    norm = self._norm_out.get(id(x))
                    self.groups.append(InputStats.empty([name], k, self.sample_rows, self.seed * 1_000_003 + g,
                                                        norm[1] if norm and norm[0] is x else None))
                self.group_of[name] = g
                self._live[id(x)] = (x, g)
                if self.groups[g].layers[0] != name:
                    return
            elif self.groups[g].layers[0] != name:
                return
            self._live[id(x)] = (x, g)
            self.groups[g].add(x)
        return hook


def expert_map(layers: Iterable[str]) -> dict[str, list[str]]:
    """Default MoE experts: layer names containing '.experts.<i>.' grouped by that prefix."""
    out: dict[str, list[str]] = {}
    for name in layers:
        m = EXPERT_RE.match(name)
        if m:
            out.setdefault(m.group(1), []).append(name)
    return out


def calibrate(model: nn.Module, batches: Iterable, layers: dict[str, nn.Linear], *, num_batches: int | None = None,
              min_expert_tokens: int = 0, experts: dict[str, list[str]] | None = None, sample_rows: int = 512,
              seed: int = 0, strict: bool = True) -> Calibration:
    """Run ``model(ids)`` for each input-id tensor ([1, T] or [B, T] int64) of ``batches`` under no_grad.

    num_batches: base calibration set (None = all of ``batches``). With min_expert_tokens > 0, batches beyond the base
    set are a top-up pool: they are consumed one by one while some expert (``experts``: expert -> its layer names;
    default '.experts.<i>.' prefixes) has seen fewer than min_expert_tokens tokens. If the pool runs out first,
    ``strict`` raises CalibrationError naming the experts and counts; otherwise the counts are only reported (an expert
    with no tokens is then quantised round-to-nearest: its GPTQ columns are all dead)."""
    if num_batches is not None and num_batches < 1:
        raise CalibrationError(f"num_batches={num_batches}: need at least 1")
    if min_expert_tokens < 0:
        raise CalibrationError(f"min_expert_tokens={min_expert_tokens}: must be >= 0")
    experts = expert_map(layers) if experts is None else experts
    cal = Calibrator(model, layers, sample_rows, seed)

    def expert_tokens() -> dict[str, int]:
        out = {}
        for e, names in experts.items():
            g = cal.group_of.get(names[0])
            out[e] = cal.groups[g].num_tokens if g is not None else 0
        return out

    def short() -> dict[str, int]:
        return {e: n for e, n in expert_tokens().items() if n < min_expert_tokens}

    import torch
    used = tokens = 0
    it = iter(batches)
    with cal, torch.no_grad():
        for ids in it:
            model(ids)
            used += 1
            tokens += int(ids.numel())
            if num_batches is not None and used >= num_batches and not (min_expert_tokens and short()):
                break
    if used == 0:
        raise CalibrationError("calib_batches is empty: need at least one input-id tensor")
    missing = short() if min_expert_tokens else {}
    if missing and strict:
        raise CalibrationError(f"min_expert_tokens={min_expert_tokens}: calibration data ran out after {used} batches "
                               f"with {len(missing)} expert(s) below it: {dict(sorted(missing.items()))}")
    return Calibration(cal.groups, cal.group_of, expert_tokens(), used, tokens)
