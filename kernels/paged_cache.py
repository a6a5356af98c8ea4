"""The paged MLA caches shared by ``mla_prolog`` (which writes them) and decode attention (which reads them).

Layouts (``cache_mode``), per block of ``block_size`` token slots:
- ``"PA_BSND"``: kv_cache [blocks, block_size, 1, Hckv], kr_cache [blocks, block_size, 1, Dr];
- ``"PA_NZ"``: kv_cache [blocks, 1, Hckv/N0, block_size, N0], kr_cache [blocks, 1, Dr/16, block_size, 16], with
  N0 = 32 bytes / element size (16 for bf16, 32 for an int8 kv_cache).
kr_cache is bf16; kv_cache is bf16, or int8 for a quantised latent.
"""
from __future__ import annotations

from ascend_emu.errors import ArgumentError, DTypeError, ShapeError

CACHE_MODES = ("PA_BSND", "PA_NZ")


def check_cache_mode(cache_mode) -> str:
    if cache_mode not in CACHE_MODES:
        raise ArgumentError(f"cache_mode={cache_mode!r}: use one of {CACHE_MODES}")
    return cache_mode


def cache_shapes(blocks: int, block_size: int, hckv: int, dr: int, cache_mode: str, kv_int8: bool) -> tuple:
    """(kv_cache shape, kr_cache shape) of ``blocks`` blocks in ``cache_mode``."""
    n0 = 32 if kv_int8 else 16
    if check_cache_mode(cache_mode) == "PA_BSND":
        return (blocks, block_size, 1, hckv), (blocks, block_size, 1, dr)
    return (blocks, 1, hckv // n0, block_size, n0), (blocks, 1, dr // 16, block_size, 16)


def check_caches(kv_cache, kr_cache, hckv: int, dr: int, cache_mode: str, kv_int8: bool) -> int:
    """Check both caches' dtypes and shapes against ``cache_mode`` (before any GM is touched); returns the block
    size. Raises naming the cache, its shape and the shape the layout needs."""
    import torch
    check_cache_mode(cache_mode)
    want_kv = torch.int8 if kv_int8 else torch.bfloat16
    for name, c, want in (("kv_cache", kv_cache, want_kv), ("kr_cache", kr_cache, torch.bfloat16)):
        if c.dtype != want:
            raise DTypeError(f"{name} is {c.dtype}: expected {want} here")
    nd = 4 if cache_mode == "PA_BSND" else 5
    if kv_cache.dim() != nd:
        raise ShapeError(f"kv_cache has shape {tuple(kv_cache.shape)}; cache_mode={cache_mode} needs {nd} dims "
                         f"({_layout(cache_mode)})")
    block_size = int(kv_cache.shape[1] if cache_mode == "PA_BSND" else kv_cache.shape[3])
    want_shapes = cache_shapes(int(kv_cache.shape[0]), block_size, hckv, dr, cache_mode, kv_int8)
    for name, c, h, want in (("kv_cache", kv_cache, hckv, want_shapes[0]), ("kr_cache", kr_cache, dr, want_shapes[1])):
        n0 = want[-1] if cache_mode == "PA_NZ" else 16
        if tuple(c.shape) != want or h % n0:
            raise ShapeError(f"{name} has shape {tuple(c.shape)}; cache_mode={cache_mode} needs {want} "
                             f"({_layout(cache_mode)}, H = {h}, N0 = {n0})")
    return block_size


def _layout(cache_mode: str) -> str:
    return "[blocks, block_size, 1, H]" if cache_mode == "PA_BSND" else "[blocks, 1, H/N0, block_size, N0]"
