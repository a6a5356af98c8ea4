"""Explore the interleavings of a protocol: run it once per jitter seed, sanitized, and compare what it returns.

    report = ascend_emu.explore(scenario, seeds=range(20), sanitize=True)
    assert report.ok, report.summary()

``scenario(pod)`` builds its inputs on the fresh ``pod`` it is given (``Pod(profile, jitter_seed=seed, jitter=...,
sanitize="collect")``), runs, and returns its outputs: an array, a torch tensor, a GM tensor, a number, or a dict /
list / tuple of them (None entries are skipped). Pods the scenario makes itself (a library call that makes its own)
get the same seed and sanitizer. First comes a baseline run on the profile's own latencies (seed None); a
protocol's results must not depend on timing, so every seed must return the baseline's bits. The report lists the
seeds whose outputs differ, the races the sanitizer found under each seed, and the seeds whose run raised an
emulator error (a deadlock, a protocol check).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ArgumentError, EmulatorError


@dataclass
class SeedRun:
    """One seed's run (seed None: the baseline): the races found, the error it raised (None: it finished), the
    modeled time its pod ended at."""
    seed: int | None
    races: list
    error: EmulatorError | None
    end_us: float


@dataclass
class Difference:
    """An output that differs from the first seed's: which seed and output, how many elements differ, the largest
    absolute difference (floats; None for other dtypes or a changed shape)."""
    seed: int | None
    output: str
    elements: int
    max_abs: float | None

    def __str__(self) -> str:
        size = "" if self.max_abs is None else f", max |diff| {self.max_abs:.3g}"
        return f"seed {self.seed}: output {self.output} differs in {self.elements} element(s){size}"


@dataclass
class ExploreReport:
    """What ``explore`` found: per seed its run, and every output difference against the first seed."""
    seeds: list
    runs: list
    differences: list = field(default_factory=list)

    @property
    def races(self) -> list:
        """Every race, of every seed (the same race found under several seeds appears once per seed)."""
        return [r for run in self.runs for r in run.races]

    @property
    def errors(self) -> list:
        """(seed, error) of the seeds whose run raised."""
        return [(run.seed, run.error) for run in self.runs if run.error is not None]

    @property
    def ok(self) -> bool:
        """No race, no error and the same outputs under every seed."""
        return not (self.races or self.errors or self.differences)

    def summary(self) -> str:
        lines = [f"{len(self.seeds)} seeds: {len(self.races)} race report(s), {len(self.errors)} error(s), "
                 f"{len(self.differences)} output difference(s)"]
        shown = set()
        for run in self.runs:
            for r in run.races:
                if r.signature not in shown:
                    shown.add(r.signature)
                    lines.append(f"  seed {run.seed}: {r}")
        lines += [f"  seed {s}: {type(e).__name__}: {e}" for s, e in self.errors]
        lines += [f"  {d}" for d in self.differences]
        return "\n".join(lines)

    __str__ = summary


def explore(scenario, seeds=range(20), *, sanitize: bool = True, jitter: float = 0.3, profile=None,
            baseline: bool = True, **pod_options) -> ExploreReport:
    """Run ``scenario(pod)`` on a fresh pod per seed of ``seeds`` (latencies perturbed by up to ``jitter``; the
    sanitizer collecting races when ``sanitize``), after a ``baseline`` run without jitter, and compare the outputs
    bit for bit with the first run's.

    ``profile``: the pods' HardwareProfile (default cloudmatrix384); ``pod_options``: other ``Pod`` arguments
    (``trace`` defaults to False here). Emulator errors a seed raises are reported, not raised."""
    from .jitter import Jitter
    from .pod import Pod, pod_defaults
    if not callable(scenario):
        raise ArgumentError(f"scenario={scenario!r}: a function of a Pod returning the outputs to compare")
    seeds = list(seeds)
    if not seeds:
        raise ArgumentError("seeds: give at least one seed")
    for seed in seeds:
        Jitter(seed, jitter)              # every seed and the fraction checked before anything runs
    pod_options.setdefault("trace", False)
    report = ExploreReport(seeds, [])
    reference = None
    for seed in ([None] if baseline else []) + seeds:
        error, outputs = None, None
        mode = "collect" if sanitize else False
        with pod_defaults(sanitize=mode, jitter_seed=seed, jitter=jitter) as sanitizers:
            pod = Pod(profile, **pod_options)
            try:
                outputs = _flatten(scenario(pod))
            except EmulatorError as e:
                error = e
        races = [r for s in sanitizers for r in s.races]
        report.runs.append(SeedRun(seed, races, error, pod.now_us))
        if outputs is None:
            continue
        if reference is None:
            reference = outputs
            continue
        for name in sorted(set(reference) | set(outputs)):
            diff = _compare(reference.get(name), outputs.get(name))
            if diff is not None:
                report.differences.append(Difference(seed, name, *diff))
    return report


def _flatten(out, name: str = "out") -> dict:
    """{"out[key][i]": numpy array} of a scenario's outputs."""
    if out is None:
        return {}
    if isinstance(out, dict):
        flat = {}
        for k, v in out.items():
            flat.update(_flatten(v, f"{name}[{k!r}]"))
        return flat
    if isinstance(out, (list, tuple)):
        flat = {}
        for i, v in enumerate(out):
            flat.update(_flatten(v, f"{name}[{i}]"))
        return flat
    return {name: _array(out, name)}


def _array(v, name: str) -> np.ndarray:
    if hasattr(v, "numpy") and hasattr(v, "store"):            # a GM tensor
        return v.numpy()
    if type(v).__module__.startswith("torch"):
        import torch
        v = v.detach().cpu()
        return v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
    a = np.asarray(v)
    if a.dtype == object:
        raise ArgumentError(f"scenario output {name} is a {type(v).__name__}: return arrays, tensors, numbers or "
                            f"dicts / lists of them")
    return a


def _compare(a, b):
    """None when ``a`` and ``b`` hold the same bits, else (elements that differ, max abs difference or None)."""
    if a is None or b is None:
        return (0, None) if a is not b else None
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size), None
    if a.tobytes() == b.tobytes():
        return None
    ab, bb = a.reshape(-1), b.reshape(-1)
    if a.dtype.kind in "f" or a.dtype.name == "bfloat16":
        x, y = ab.astype(np.float64), bb.astype(np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):
            return int(np.count_nonzero(~same)), float(np.nanmax(np.abs(x - y)[~same]))
    return int(np.count_nonzero(ab != bb)), None
