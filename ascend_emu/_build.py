"""Compiled or source: which build of the scheduler's hot modules this process runs.

``timing``, ``views``, ``isa``, ``engine`` and ``kernel`` are plain Python. ``pip install`` also compiles them with
Cython (setup.py), using the type declarations in the ``.pxd`` file beside each; the compiled build runs the same
code about 1.8x faster and gives the same numbers and the same modeled times. The package imports the compiled
modules when all of them are built and none is older than its ``.py`` or ``.pxd``; otherwise, or when the
environment sets ``ASCEND_EMU_PURE=1``, it runs the sources (and warns when a build is stale: rebuild it with the
README's install command). ``ascend_emu.ENGINE_BUILD`` says which one runs.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

# in import order: each imports only earlier ones among them (the source fallback loads them in this order)
COMPILED = ("timing", "views", "isa", "engine", "kernel")


def _extension(here: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"{name}{suffix}"
        if p.exists():
            return p
    return None


def _stale(here: Path) -> list[str]:
    """The modules whose compiled build is missing or older than its sources."""
    out = []
    for m in COMPILED:
        ext = _extension(here, m)
        if ext is None:
            out.append(f"{m} (not built)")
            continue
        built = ext.stat().st_mtime
        for src in (here / f"{m}.py", here / f"{m}.pxd"):
            if src.exists() and src.stat().st_mtime > built:
                out.append(f"{m} ({src.name} changed after the build)")
                break
    return out


def select(package: str) -> str:
    """Import the compiled modules or the sources of ``package``; return "compiled" or "python"."""
    here = Path(__file__).parent
    if os.environ.get("ASCEND_EMU_PURE", "") not in ("", "0"):
        _load_sources(package, here)
        return "python"
    stale = _stale(here)
    if not stale:
        return "compiled"
    if len(stale) < len(COMPILED) or any("changed" in s for s in stale):
        warnings.warn(f"ascend_emu: the compiled engine is out of date ({', '.join(stale)}); running the Python "
                      f"sources, about 1.8x slower. Rebuild with: pip install -e .", RuntimeWarning, stacklevel=3)
    _load_sources(package, here)
    return "python"


def _load_sources(package: str, here: Path) -> None:
    # a compiled module would shadow its .py on the normal import path: load every source explicitly, in order,
    # before anything imports them (a compiled module cannot mix with the others' sources: they share C types)
    parent = sys.modules[package]
    for m in COMPILED:
        name = f"{package}.{m}"
        path = str(here / f"{m}.py")
        loader = importlib.machinery.SourceFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        loader.exec_module(mod)
        setattr(parent, m, mod)
