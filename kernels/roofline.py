"""Per-op roofline: how far an op's modeled time is from the best its cores could do.

    r = kernels.roofline.gemm_roofline(res.run, prof, m=48, k=7168, n=256, dtype="bf16", aic=24)
    r.kernel_us, r.roofline_us, r.bound, r.ratio, r.to_dict()

An op's ``Work``: cube FLOPs (of one dtype), vector FLOPs, compulsory bytes read and written (every operand read
once, every result written once) and bytes sent over the die's port. Its bounds, for the cores it was given (``aic``
AICs, ``aiv`` AIVs) of one die:
- compute: the cube FLOPs at the AICs' peak (``cube_m x cube_n x cube_k`` MACs per cycle per AIC) plus the vector
  FLOPs at the AIVs' peak (one 256-byte fp32 repeat per cycle per AIV; an estimate of the op's elementwise work,
  not of its instruction count);
- hbm: the compulsory bytes at the die's ``hbm_gbps``;
- movers: the compulsory bytes read, at the cores' own rate from HBM (``hbm_read_bytes_per_cycle`` per core of the
  kind that moves them, the AICs when the op has cube work: a core keeps a bounded number of bytes in flight, so
  few cores cannot reach the HBM's rate);
- fabric: the bytes sent over the die's Unified-Bus port (``fabric_gbps``, per direction).
The roofline is the largest; ``bound`` names it. Several works run one after the other on the same cores (an op
made of several launches) add bound by bound (``combine``). ``ratio`` = kernel time / roofline (1.0: at the bound);
the kernel time is the first kernel start to the last end, without the host's launch overhead.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ascend_emu.errors import ArgumentError

BOUNDS = ("compute", "hbm", "movers", "fabric")


@dataclass(frozen=True)
class Work:
    """What an op must do at least: FLOPs and compulsory bytes (see the module docstring)."""
    cube_flops: float = 0.0
    cube_dtype: str = "bf16"
    vector_flops: float = 0.0
    read_bytes: int = 0
    write_bytes: int = 0
    fabric_bytes: int = 0


@dataclass(frozen=True)
class Roofline:
    """One op's modeled time next to its bounds (us) and bytes. ``hbm_bytes``: what the op's launches made the HBMs
    move (misses and write-backs; ``LaunchInfo.hbm_bytes``, or the run's when it ran alone; None: not measured);
    ``compulsory_bytes``: operands once, results once."""
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


def _bounds(prof, work: Work, aic: int, aiv: int) -> tuple[float, float, float, float]:
    """(compute, hbm, movers, fabric) us of ``work`` on ``aic`` AICs and ``aiv`` AIVs."""
    if aic < 0 or aiv < 0 or (aic == 0 and aiv == 0):
        raise ArgumentError(f"roofline: give the cores the op ran on (aic={aic}, aiv={aiv})")
    if work.cube_flops and not aic:
        raise ArgumentError(f"roofline: cube_flops={work.cube_flops} need aic > 0")
    ghz = prof.clock_ghz
    k = {"bf16": prof.cube_k_fp16, "fp16": prof.cube_k_fp16, "int8": prof.cube_k_int8,
         "fp32": prof.cube_k_fp32}[work.cube_dtype]
    cube = work.cube_flops / (2.0 * prof.cube_m * prof.cube_n * k * aic * ghz * 1e3) if work.cube_flops else 0.0
    vector = work.vector_flops / (64.0 * aiv * ghz * 1e3) if work.vector_flops and aiv else 0.0
    movers = aic if work.cube_flops else (aiv or aic)
    return (cube + vector, (work.read_bytes + work.write_bytes) / (prof.hbm_gbps * 1e3),
            work.read_bytes / (movers * prof.hbm_read_bytes_per_cycle * ghz * 1e3),
            work.fabric_bytes / (prof.fabric_gbps * 1e3))


def combine(op: str, prof, works, *, modeled_us: float, kernel_us: float, aic: int, aiv: int,
            hbm_bytes: int | None = None) -> Roofline:
    """The roofline of ``works`` run one after the other on the same cores: each bound is the sum of theirs."""
    totals = [0.0] * 4
    compulsory = 0
    for work in works:
        for i, v in enumerate(_bounds(prof, work, aic, aiv)):
            totals[i] += v
        compulsory += int(work.read_bytes + work.write_bytes)
    return Roofline(op, float(modeled_us), float(kernel_us), hbm_bytes, compulsory, *totals)


def roofline(op: str, prof, *, modeled_us: float, kernel_us: float, aic: int = 0, aiv: int = 0,
             hbm_bytes: int | None = None, **work) -> Roofline:
    """The roofline of one ``Work(**work)`` (cube_flops, cube_dtype, vector_flops, read_bytes, write_bytes,
    fabric_bytes) on ``aic`` AICs and ``aiv`` AIVs."""
    return combine(op, prof, [Work(**work)], modeled_us=modeled_us, kernel_us=kernel_us, aic=aic, aiv=aiv,
                   hbm_bytes=hbm_bytes)


def gemm_work(*, m: int, k: int, n: int, dtype: str, groups: int = 1, out_itemsize: int = 2, swiglu: bool = False,
              per_token_scale: bool = False, channel_scale: bool = False) -> Work:
    """A (grouped) GEMM: x [m, k] @ w [groups, k, n] -> y [m, n] (SwiGLU: n / 2), ``dtype`` of x and w; scales
    counted when given (fp32 per token, per channel); the epilogue's dequant / SwiGLU as 4 FLOPs per output."""
    isz = 1 if dtype == "int8" else 2
    reads = m * k * isz + groups * k * n * isz + (4 * m if per_token_scale else 0) + \
        (4 * groups * n if channel_scale else 0)
    return Work(cube_flops=2.0 * m * k * n, cube_dtype=dtype,
                vector_flops=4.0 * m * n if (swiglu or per_token_scale) else 0.0, read_bytes=reads,
                write_bytes=m * (n // 2 if swiglu else n) * out_itemsize)


def attention_work(*, seq_lens, s: int, n: int, hckv: int, dr: int, kv_int8: bool = False) -> Work:
    """Decode attention over the MLA latent cache: every sequence's cache read once (``attention_bytes``), QK^T and
    PV on the cube (``attention_flops``), the softmax's exp / max / sum / rescale (about 8 fp32 operations per
    score) on the AIVs."""
    from .attention import attention_bytes, attention_flops
    lens = [int(x) for x in seq_lens]
    writes = len(lens) * s * n * hckv * 2
    return Work(cube_flops=attention_flops(lens, s, n, hckv, dr), cube_dtype="bf16",
                vector_flops=8.0 * s * n * sum(lens),
                read_bytes=attention_bytes(lens, s, n, hckv, dr, 1 if kv_int8 else 2) - writes, write_bytes=writes)


def gemm_roofline(run, prof, *, aic: int, op: str = "gemm", **shape) -> Roofline:
    """``gemm_work(**shape)``'s roofline on ``aic`` AICs (and their AIVs), times and HBM bytes from ``run``."""
    return combine(op, prof, [gemm_work(**shape)], modeled_us=run.modeled_us, kernel_us=run.kernel_us, aic=aic,
                   aiv=2 * aic, hbm_bytes=run.hbm_bytes())


def attention_roofline(run, prof, *, aic: int, op: str = "attention", **shape) -> Roofline:
    """``attention_work(**shape)``'s roofline on ``aic`` AICs and their AIVs, times and HBM bytes from ``run``."""
    return combine(op, prof, [attention_work(**shape)], modeled_us=run.modeled_us, kernel_us=run.kernel_us,
                   aic=aic, aiv=2 * aic, hbm_bytes=run.hbm_bytes())
