"""The registries behind the CLI: ``ascend-emu model OP`` ops (timing-only runs at any scale) and the top-level
commands other layers add (``ascend-emu eplb``, ``ascend-emu quantize``, ...).

An op is a function taking parsed options and returning a dict with at least ``op``, ``modeled_us``,
``bytes_moved`` and ``utilization`` (0-1, or None where no single figure means something). Layers above the
emulator (xccl, kernels) register theirs in their ``ops`` module; the CLI imports those modules on start.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Option:
    name: str                 # "--tokens"
    type: type
    default: object
    help: str
    choices: tuple | None = None


@dataclass(frozen=True)
class ModelOp:
    name: str
    fn: Callable[..., dict]
    help: str
    options: tuple = field(default_factory=tuple)


REGISTRY: dict[str, ModelOp] = {}


@dataclass(frozen=True)
class Command:
    """A top-level ``ascend-emu NAME`` sub-command contributed by a layer above the emulator."""
    name: str
    help: str
    add_arguments: Callable    # (argparse.ArgumentParser) -> None
    run: Callable              # (argparse.Namespace) -> int exit code


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable):
    """Decorator registering ``ascend-emu NAME``: ``@command("eplb", "...", add_args)`` on ``run(args) -> int``."""
    def wrap(fn):
        if name in COMMANDS or name in ("demo", "model"):
            raise ValueError(f"command {name!r} registered twice")
        COMMANDS[name] = Command(name, help, add_arguments, fn)
        return fn
    return wrap


@dataclass(frozen=True)
class DemoStage:
    """A part of ``ascend-emu demo`` contributed by a layer above the emulator (the serving loop's end-to-end run).
    ``run(out_dir, quiet) -> dict``: its JSON fields (merged into the demo's object), plus ``"ok"`` (bool) and
    ``"report"`` (a callable(console) printing the human summary); both are removed before printing JSON."""
    name: str
    run: Callable


DEMO_STAGES: dict[str, DemoStage] = {}


def demo_stage(name: str):
    """Decorator registering a demo stage: ``@demo_stage("serving")`` on ``run(out_dir, quiet) -> dict``."""
    def wrap(fn):
        if name in DEMO_STAGES:
            raise ValueError(f"demo stage {name!r} registered twice")
        DEMO_STAGES[name] = DemoStage(name, fn)
        return fn
    return wrap


def register(name: str, help: str, options: tuple = ()):
    """Decorator: ``@register("copy", "GM -> UB -> GM copy", (Option("--bytes", int, 1 << 20, "bytes"),))``."""
    def wrap(fn):
        if name in REGISTRY:
            raise ValueError(f"model op {name!r} registered twice")
        REGISTRY[name] = ModelOp(name, fn, help, tuple(options))
        return fn
    return wrap


# --------------------------------------------------------------------------------------- the emulator's own ops
@register("quantize", "per-row dynamic INT8 quantisation over a die's AIVs (double-buffered)", (
    Option("--tokens", int, 48 * 128, "rows (tokens)"),
    Option("--hidden", int, 7168, "row length (elements, bf16)"),
    Option("--cores", int, 48, "AIV cores"),
    Option("--tile-rows", int, 4, "rows per UB tile (2 slots of bf16 in + int8 out must fit the 192 KiB UB)"),
))
def _quantize(tokens, hidden, cores, tile_rows, trace=False):
    from .demo import run_quantize
    r = run_quantize(tokens, hidden, cores, tile_rows, numeric=False, trace=trace)
    run = r["run"]
    return {"op": "quantize", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": run.utilization.get("VECTOR", 0.0),
            "hbm_utilization": run.servers.get("hbm0", {}).get("utilization", 0.0),
            "instructions": run.instructions, "run": run}


@register("gemm-int8", "int8 GEMM on AIC tiles with an AIV dequant epilogue (MIX kernel)", (
    Option("--m", int, 1024, "rows of A"),
    Option("--n", int, 1024, "columns of B"),
    Option("--k", int, 1024, "reduction length"),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)"),
))
def _gemm(m, n, k, aic, trace=False):
    from .demo import run_gemm
    r = run_gemm(m, n, k, aic, numeric=False, trace=trace)
    run = r["run"]
    return {"op": "gemm-int8", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": r["cube_utilization"],
            "instructions": run.instructions, "run": run}


@register("copy", "bandwidth-bound GM -> UB -> GM copy by a die's AIVs, to the same or another die", (
    Option("--bytes", int, 64 << 20, "bytes to copy"),
    Option("--cores", int, 48, "AIV cores"),
    Option("--dst-die", int, 0, "destination die (0 = local; 1 = the other die of the chip; 16+ = another server)"),
))
def _copy(bytes, cores, dst_die, trace=False):
    from .demo import run_copy
    return run_copy(bytes, cores, dst_die, trace=trace)
