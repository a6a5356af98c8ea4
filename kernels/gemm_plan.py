"""How a grouped GEMM is cut into work for the AICs: the tiling (``GemmTiling``), the launch plan (``GemmPlan``), the
output tiles (``plan_tiles``), the split-K work units (``plan_units``) and the rule that picks a tiling per shape
(``choose_tiling``). Only this module and ``kernels.tiles`` know the cube's tile sizes.

The rule (``choose_tiling``, used when the caller passes no tiling): output tiles are dealt round-robin over the
launch's AICs, so a shape whose tile count is not a multiple of the AIC count leaves cores idle in its last wave
(o_proj 48 x 16384 x 7168 at 128 x 256: 28 tiles on 24 AICs), and one with fewer tiles than AICs leaves most of them
idle (the router, [T x 7168] x [7168 x 256]: one tile). The rule therefore tries every tile width n (whole 32-byte
fractal column blocks, at most the default 256) and every K split s (at most one part per L1 step of K, cut at L0 K
steps, at most ``MAX_WAVES`` units per AIC), deals the (tile, part) units round-robin, and estimates each AIC's time
as the sum of its units' costs (``unit_cycles``: the larger of the cube time and the operand-load time, at the
platform file's per-core rates, plus the fixpipe of the tile and, split, its share of the reduction). It keeps the
candidate with the least busiest-AIC time; candidates within ``PREFER_DEFAULT`` of the best are tied and the default
shape (no split, then the widest tile) wins the tie, since the estimate ignores contention and L2 hits. It is an
estimate by named mechanisms, not a fit: no constant in it comes from a measured figure.

A split-K GEMM (s > 1) writes each part's raw accumulator (int32 / fp32) to a GM workspace and bumps the tile's
counter; the AIVs of the tile's AICs each reduce a slice of its rows, adding the parts in split order (a fixed,
deterministic order: bf16 results depend on s, int8 ones are exact), then run the epilogue (dequant, SwiGLU, cast).
"""
from __future__ import annotations

from dataclasses import dataclass

from ascend_emu.errors import ArgumentError, CapacityError

BASE_M, BASE_N = 128, 256
BASE_K = {"int8": 128, "bf16": 64, "fp16": 64}     # the L0 K step: fp32 accumulation order of the bf16 path
EPI_ROWS = 32          # most rows per epilogue chunk; fewer when the chunk's tiles would not fit the UB (epi_rows)
MAX_WAVES = 4          # a K split may deal at most this many units per AIC
PREFER_DEFAULT = 0.05  # a candidate must beat the default shape's estimate by this fraction to replace it


@dataclass(frozen=True)
class GemmTiling:
    """Block and tile shape of the cube loop (CATLASS's grouped per-token-dequant GEMM: L1 tile 128 x 256 x 512,
    L0 tile 128 x 256 x 128 for int8, K halved for 2-byte types; 2 L1 stages, 2 L0 stages, 1 L0C stage).
    ``k_l1``/``k_l0`` None: the dtype's default. ``k_splits``: parts K is cut into, each
    reduced by the AIVs in order (1: no split; at most the L1 steps of K, each part cut at L0 K steps)."""
    m: int = BASE_M
    n: int = BASE_N
    k_l1: int | None = None
    k_l0: int | None = None
    l1_stages: int = 2
    k_splits: int = 1

    def resolve(self, dtype: str) -> "GemmTiling":
        """The tiling with its K steps filled in for ``dtype`` ("int8", "bf16", "fp16")."""
        k0 = self.k_l0 or BASE_K[dtype]
        k1 = self.k_l1 or k0 * 4
        return GemmTiling(self.m, self.n, k1, k0, self.l1_stages, self.k_splits)

    def check(self, prof, dtype: str, swiglu: bool, k_dim: int | None = None) -> None:
        """Raise ArgumentError unless the tiles fit the AIC's buffers (checked when the plan is built)."""
        isz = 1 if dtype == "int8" else 2
        acc = 4
        need = {
            "L1": (self.l1_stages * (self.m + self.n) * self.k_l1 * isz + self.n * 4, prof.l1_bytes),
            "L0A": (2 * self.m * self.k_l0 * isz, prof.l0a_bytes),
            "L0B": (2 * self.k_l0 * self.n * isz, prof.l0b_bytes),
            "L0C": (self.m * self.n * acc, prof.l0c_bytes),
        }
        for buf, (got, cap) in need.items():
            if got > cap:
                raise ArgumentError(f"tiling {self}: {buf} needs {got} bytes, the AIC has {cap}")
        if self.k_l1 % self.k_l0 or self.m % 16 or self.n % 8 or (swiglu and self.n % 32):
            raise ArgumentError(f"tiling {self}: k_l1 must be a multiple of k_l0, m a multiple of 16, n of 8 "
                                f"(of 32 with swiglu; the cube pads n to whole 16-column fractals)")
        if not isinstance(self.k_splits, int) or self.k_splits < 1:
            raise ArgumentError(f"tiling {self}: k_splits must be an integer >= 1")
        if k_dim is not None and self.k_splits > max(1, -(-k_dim // self.k_l1)):
            raise ArgumentError(f"tiling {self}: k_splits={self.k_splits} exceeds the {-(-k_dim // self.k_l1)} "
                                f"L1 steps of K={k_dim} (each part needs at least one)")


@dataclass(frozen=True)
class GemmPlan:
    """One rank's launch plan, checked when built: the resolved tiling, the weight's columns ``n`` (``n_out`` =
    n / 2 with SwiGLU), the weight layout, the epilogue choices, and ``epi_rows`` (rows per AIV chunk)."""
    tiling: GemmTiling
    n: int
    nz: bool = False
    swiglu: bool = False
    epilogue: bool = False          # AIC -> workspace -> AIV epilogue (per-token scale or SwiGLU), no split
    fixpipe_scale: bool = False     # the fixpipe applies the per-channel scale (no AIV epilogue)
    group_list_type: int = 0
    int8: bool = False
    epi_rows: int = 0

    @property
    def n_out(self) -> int:
        return self.n // 2 if self.swiglu else self.n

    @property
    def splits(self) -> int:
        return self.tiling.k_splits

    @property
    def aiv_work(self) -> bool:
        """Whether the AIVs take part (an epilogue, or the reduction of split-K parts)."""
        return self.epilogue or self.splits > 1


def group_ends(values, group_list_type: int) -> list:
    """Cumulative row ends from a group list (type 0: cumulative, type 1: counts)."""
    vals = [int(v) for v in values]
    if group_list_type == 0:
        return vals
    out, total = [], 0
    for v in vals:
        total += v
        out.append(total)
    return out


def plan_tiles(ends: list, n_out: int, tile_n: int, tile_m: int = BASE_M) -> list:
    """Every output tile, group by group: (group, m0, rows, n0, cols). Tile i runs on AIC i % num_aic."""
    tiles, start = [], 0
    for g, end in enumerate(ends):
        for m0 in range(start, end, tile_m):
            rows = min(tile_m, end - m0)
            for n0 in range(0, n_out, tile_n):
                tiles.append((g, m0, rows, n0, min(tile_n, n_out - n0)))
        start = max(start, end)
    return tiles


def k_ranges(k_dim: int, splits: int, k_step: int) -> list[tuple[int, int]]:
    """[k0, k1) of each K part: the L0 K steps (``k_step``) of K shared as evenly as possible, in order."""
    steps = -(-k_dim // k_step)
    return [(min(k_dim, steps * i // splits * k_step), min(k_dim, steps * (i + 1) // splits * k_step))
            for i in range(splits)]


def plan_units(num_tiles: int, splits: int, num_aic: int, aic: int) -> list[tuple[int, int]]:
    """(tile index, part) of AIC ``aic``'s units: unit u = tile * splits + part runs on AIC u % num_aic (without a
    split: tile i on AIC i % num_aic, as before)."""
    return [divmod(u, splits) for u in range(aic, num_tiles * splits, num_aic)]


def reduce_rows(rows: int, splits: int, part: int, sub_block: int) -> tuple[int, int]:
    """[r0, r1) of a split tile's ``rows`` that the AIV ``sub_block`` of the AIC holding ``part`` reduces: the rows
    shared evenly over the tile's 2 x splits AIVs."""
    slot = 2 * part + sub_block
    n = 2 * splits
    return rows * slot // n, rows * (slot + 1) // n


def epilogue_rows(ub_bytes: int, tile_n: int, int8: bool, out_itemsize: int, swiglu: bool, splits: int = 1) -> int:
    """Rows per AIV epilogue chunk: at most EPI_ROWS, a multiple of 8 (the [slots, rows] fp32 token-scale slots stay
    32-byte aligned), and few enough that the chunk's tiles fit the UB for this output dtype: per row, the raw
    tiles (int32 / fp32; two ping-pong slots, or with a K split one per part, loaded back to back and added in
    order), the dequantised fp32 tile (int8), the output tile and the token scale (two slots each, one when split),
    the SwiGLU scratch; the channel scales once."""
    raw_slots, slots = (2, 2) if splits == 1 else (splits, 1)
    per_row = tile_n * (4 * raw_slots + slots * ((4 if int8 else 0) + out_itemsize)) + \
        (tile_n // 2 * 4 if swiglu else 0) + slots * 4
    fixed = tile_n * 4 + 6 * 32                         # channel scales, one 32-byte alignment per tile
    rows = min(EPI_ROWS, 8 * ((ub_bytes - fixed) // (8 * per_row)))
    if rows < 8:
        raise CapacityError(f"grouped_matmul epilogue: 8 rows of {per_row} bytes do not fit the {ub_bytes}-byte UB"
                            + (f" ({splits} K parts)" if splits > 1 else ""))
    return rows


# ============================================================================================ the tiling rule
def unit_cycles(prof, rows: int, cols: int, k_part: int, itemsize: int, splits: int) -> float:
    """Estimated AIC cycles of one (tile, K part) unit: the larger of the cube's fractal blocks and the operand
    loads (B from HBM at ``hbm_read_bytes_per_cycle``: weights are read once; A from the L2 at
    ``l2_read_bytes_per_cycle``: every tile of a row block re-reads it), plus the fixpipe of the accumulator
    (``l2_write_bytes_per_cycle``) and, split, this part's share of the AIVs' reduction reads."""
    k_block = prof.cube_k_int8 if itemsize == 1 else prof.cube_k_fp16
    cube = -(-rows // prof.cube_m) * -(-cols // prof.cube_n) * -(-k_part // k_block)
    load = k_part * cols * itemsize / prof.hbm_read_bytes_per_cycle + \
        k_part * rows * itemsize / prof.l2_read_bytes_per_cycle
    out = rows * cols * 4 / prof.l2_write_bytes_per_cycle
    reduce = rows * cols * 4 / (2 * prof.l2_read_bytes_per_cycle) if splits > 1 else 0.0
    return max(cube, load) + out + reduce


def estimate_cycles(prof, ends: list, n_out: int, k_dim: int, tiling: GemmTiling, itemsize: int, swiglu: bool,
                    num_aic: int) -> float:
    """The busiest AIC's estimated cycles for ``tiling`` (``unit_cycles`` summed over its round-robin units)."""
    tile_n = tiling.n // 2 if swiglu else tiling.n
    tiles = plan_tiles(ends, n_out, tile_n, tiling.m)
    parts = k_ranges(k_dim, tiling.k_splits, tiling.k_l0)
    load = [0.0] * num_aic
    for u in range(len(tiles) * tiling.k_splits):
        t, part = divmod(u, tiling.k_splits)
        _, _, rows, _, cols = tiles[t]
        k0, k1 = parts[part]
        load[u % num_aic] += unit_cycles(prof, rows, cols * (2 if swiglu else 1), k1 - k0, itemsize,
                                         tiling.k_splits)
    return max(load)


def choose_tiling(prof, ends: list, n_out: int, k_dim: int, dtype: str, swiglu: bool, out_itemsize: int,
                  num_aic: int) -> GemmTiling:
    """The tiling for this shape on ``num_aic`` AICs by the rule in the module docstring (only split candidates
    whose reduction chunk fits the UB are tried)."""
    default = GemmTiling().resolve(dtype)
    itemsize = 1 if dtype == "int8" else 2
    block = 32 // itemsize                       # one 32-byte fractal column block (N0), the NZ tile unit
    step = 2 * block if swiglu else block        # SwiGLU tiles hold n/2 gate + n/2 up columns
    widths = [w for w in range(default.n, 0, -step) if w % 16 == 0]
    max_splits = min(num_aic, max(1, k_dim // default.k_l1))
    best = estimate_cycles(prof, ends, n_out, k_dim, default, itemsize, swiglu, num_aic)
    choice, choice_cycles = default, best
    for splits in range(1, max_splits + 1):
        for width in widths:
            num_tiles = len(plan_tiles(ends, n_out, width // 2 if swiglu else width, default.m))
            if splits > 1 and num_tiles * splits > MAX_WAVES * num_aic:
                continue                         # enough units to balance; more would only add reduction work
            if splits > 1 and not _reduction_fits(prof.ub_bytes, width, dtype == "int8", out_itemsize, swiglu,
                                                  splits):
                continue
            cand = GemmTiling(default.m, width, default.k_l1, default.k_l0, default.l1_stages, splits)
            cycles = estimate_cycles(prof, ends, n_out, k_dim, cand, itemsize, swiglu, num_aic)
            if cycles < choice_cycles:
                choice, choice_cycles = cand, cycles
    return choice if choice_cycles < best * (1 - PREFER_DEFAULT) else default


def _reduction_fits(ub_bytes: int, tile_n: int, int8: bool, out_itemsize: int, swiglu: bool, splits: int) -> bool:
    try:
        epilogue_rows(ub_bytes, tile_n, int8, out_itemsize, swiglu, splits)
    except CapacityError:
        return False
    return True
