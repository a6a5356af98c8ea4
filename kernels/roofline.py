"""Per-op roofline: how far an op's modeled time is from the best its cores could do.

    r = kernels.roofline.gemm_roofline(res.run, prof, m=48, k=7168, n=256, dtype="bf16", aic=24)
    r.kernel_us, r.roofline_us, r.bound, r.ratio, r.to_dict()

The bounds, each for the op on the cores it was given (``aic`` AICs, ``aiv`` AIVs) of one die:
- compute: the op's cube FLOPs at the AICs' peak (``cube_m x cube_n x cube_k`` MACs per cycle per AIC) plus its
  vector FLOPs at the AIVs' peak (``vector_flops``: 256-byte repeats of fp32, one per cycle per AIV; an estimate
  of the op's elementwise work, not of its instruction count);
- hbm: the compulsory bytes (every operand read once, every result written once) at the die's ``hbm_gbps``;
- movers: the compulsory bytes read at the cores' own rate from HBM (``hbm_read_bytes_per_cycle`` per core of the
  kind that moves them: a core keeps a bounded number of bytes in flight, so few cores cannot reach the HBM's rate);
- fabric: bytes that cross the die's Unified-Bus port (``fabric_gbps``, per direction).
The roofline is the largest; ``bound`` names it. ``ratio`` = kernel time / roofline (1.0: at the bound). The
kernel time is the run's ``kernel_us`` (first kernel start to last end), without the host's launch overhead, which
``modeled_us`` includes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ascend_emu.errors import ArgumentError

BOUNDS = ("compute", "hbm", "movers", "fabric")


@dataclass(frozen=True)
class Roofline:
    """One op's modeled time next to its bounds (us) and bytes. ``hbm_bytes``: what the run's HBM moved (misses and
    write-backs; None if not measured); ``compulsory_bytes``: operands once, results once."""
    op: str
    modeled_us: float
    kernel_us: float
    hbm_bytes: int | None
    compulsory_bytes: int
    compute_us: float
    hbm_us: float
    movers_us: float
    fabric_us: float

    @property
    def roofline_us(self) -> float:
        return max(self.compute_us, self.hbm_us, self.movers_us, self.fabric_us)

    @property
    def bound(self) -> str:
        values = (self.compute_us, self.hbm_us, self.movers_us, self.fabric_us)
        return BOUNDS[values.index(max(values))]

    @property
    def ratio(self) -> float:
        return self.kernel_us / self.roofline_us if self.roofline_us > 0 else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(roofline_us=self.roofline_us, bound=self.bound, ratio=self.ratio)
        return d


def roofline(op: str, prof, *, modeled_us: float, kernel_us: float, cube_flops: float = 0.0,
             cube_dtype: str = "bf16", vector_flops: float = 0.0, read_bytes: int = 0, write_bytes: int = 0,
             fabric_bytes: int = 0, aic: int = 0, aiv: int = 0, hbm_bytes: int | None = None) -> Roofline:
    """The bounds of an op that does ``cube_flops`` on ``aic`` AICs and ``vector_flops`` on ``aiv`` AIVs, reads
    ``read_bytes`` and writes ``write_bytes`` compulsory bytes of its die's HBM and sends ``fabric_bytes`` over its
    port. ``read_bytes`` are moved by the AICs when the op has cube work, else by the AIVs."""
    if aic < 0 or aiv < 0 or (aic == 0 and aiv == 0):
        raise ArgumentError(f"roofline {op!r}: give the cores the op ran on (aic={aic}, aiv={aiv})")
    if cube_flops and not aic:
        raise ArgumentError(f"roofline {op!r}: cube_flops={cube_flops} need aic > 0")
    ghz = prof.clock_ghz
    k = {"bf16": prof.cube_k_fp16, "fp16": prof.cube_k_fp16, "int8": prof.cube_k_int8,
         "fp32": prof.cube_k_fp32}[cube_dtype]
    cube_us = cube_flops / (2.0 * prof.cube_m * prof.cube_n * k * aic * ghz * 1e3) if cube_flops else 0.0
    vector_us = vector_flops / (64.0 * aiv * ghz * 1e3) if vector_flops and aiv else 0.0
    movers = aic if cube_flops else (aiv or aic)
    compulsory = int(read_bytes + write_bytes)
    return Roofline(op=op, modeled_us=float(modeled_us), kernel_us=float(kernel_us), hbm_bytes=hbm_bytes,
                    compulsory_bytes=compulsory, compute_us=cube_us + vector_us,
                    hbm_us=compulsory / (prof.hbm_gbps * 1e3),
                    movers_us=read_bytes / (movers * prof.hbm_read_bytes_per_cycle * ghz * 1e3),
                    fabric_us=fabric_bytes / (prof.fabric_gbps * 1e3))


def run_roofline(op: str, run, prof, *, die: int | None = None, **bounds) -> Roofline:
    """``roofline`` with the modeled, kernel time and HBM bytes taken from a ``RunResult``."""
    return roofline(op, prof, modeled_us=run.modeled_us, kernel_us=run.kernel_us, hbm_bytes=run.hbm_bytes(die),
                    **bounds)


def gemm_roofline(run, prof, *, m: int, k: int, n: int, dtype: str, aic: int, groups: int = 1,
                  out_itemsize: int = 2, swiglu: bool = False, per_token_scale: bool = False,
                  channel_scale: bool = False, op: str = "gemm") -> Roofline:
    """A (grouped) GEMM's roofline: x [m, k] @ w [groups, k, n] -> y [m, n] (SwiGLU: n / 2), ``dtype`` of x and
    w; scales counted when given (fp32 per token, per channel)."""
    isz = 1 if dtype == "int8" else 2
    reads = m * k * isz + groups * k * n * isz + (4 * m if per_token_scale else 0) + \
        (4 * groups * n if channel_scale else 0)
    writes = m * (n // 2 if swiglu else n) * out_itemsize
    return run_roofline(op, run, prof, cube_flops=2.0 * m * k * n, cube_dtype=dtype,
                        vector_flops=4.0 * m * n if (swiglu or per_token_scale) else 0.0, read_bytes=reads,
                        write_bytes=writes, aic=aic, aiv=2 * aic)


def attention_roofline(run, prof, *, seq_lens, s: int, n: int, hckv: int, dr: int, aic: int, kv_int8: bool = False,
                       op: str = "attention") -> Roofline:
    """Decode attention over the MLA latent cache: every sequence's cache read once (latent + rope; int8 latent
    when ``kv_int8``), the queries read and outputs written once; QK^T and PV on the cube, the softmax's exp / max
    / sum / rescale (about 8 fp32 operations per score) on the AIVs."""
    from .attention import attention_bytes, attention_flops
    lens = [int(x) for x in seq_lens]
    rows = len(lens) * s * n
    writes = rows * hckv * 2
    reads = attention_bytes(lens, s, n, hckv, dr, 1 if kv_int8 else 2) - writes
    return run_roofline(op, run, prof, cube_flops=attention_flops(lens, s, n, hckv, dr), cube_dtype="bf16",
                        vector_flops=8.0 * s * n * sum(lens), read_bytes=reads, write_bytes=writes, aic=aic,
                        aiv=2 * aic)
