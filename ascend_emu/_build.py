"""Compiled or source: which build of the scheduler's hot modules this process runs.

``cache``, ``timing``, ``views``, ``isa``, ``tracker``, ``origin``, ``staging``, ``polls``, ``engine``, ``kernel`` and
``messages`` (a partitioned run's codec) are plain Python. ``pip install`` also compiles them with Cython (setup.py), using the type declarations in the ``.pxd`` file
beside each; the compiled build runs the same code about twice as fast and gives the same numbers and the same modeled
times. setup.py records a digest of the sources it compiled (``_compiled.json``); the package imports the compiled
modules only when all of them are built from the sources that are there now. Otherwise, or when the environment sets
``ASCEND_EMU_PURE=1``, it runs the sources (and warns when a build is out of date: rebuild it with
``pip install -e .``). ``ascend_emu.ENGINE_BUILD`` says which one runs.

Stdlib only: setup.py loads this file on its own, before the package's dependencies are installed.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

# in import order: each imports only earlier ones among them (the source fallback loads them in this order)
COMPILED = ("cache", "timing", "views", "isa", "tracker", "origin", "staging", "polls", "engine", "kernel",
            "messages")
RECORD = "_compiled.json"


def source_digest(here: Path) -> str:
    """sha256 of every compiled module's .py and .pxd: the modules share C types, so they are one unit."""
    h = hashlib.sha256()
    for m in COMPILED:
        for name in (f"{m}.py", f"{m}.pxd"):
            p = here / name
            h.update(name.encode() + b"\0" + (p.read_bytes() if p.exists() else b"") + b"\0")
    return h.hexdigest()


def _extension(here: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"{name}{suffix}"
        if p.exists():
            return p
    return None


def _stale(here: Path) -> list[str]:
    """Why the compiled build in ``here`` cannot run (empty: it can)."""
    missing = [m for m in COMPILED if _extension(here, m) is None]
    if missing:
        return [f"not built: {', '.join(missing)}"]
    try:
        built = json.loads((here / RECORD).read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return [f"no record of the sources it was built from ({RECORD})"]
    if built != source_digest(here):
        return ["the sources changed after the build"]
    return []


def select(package: str) -> str:
    """Import the compiled modules or the sources of ``package``; return "compiled" or "python"."""
    here = Path(__file__).parent
    if os.environ.get("ASCEND_EMU_PURE", "") not in ("", "0"):
        _load_sources(package, here)
        return "python"
    stale = _stale(here)
    if not stale:
        return "compiled"
    if any(_extension(here, m) is not None for m in COMPILED):    # a build is there but cannot run: say so
        warnings.warn(f"ascend_emu: the compiled engine is out of date ({'; '.join(stale)}); running the Python "
                      f"sources, about half as fast. Rebuild with: pip install -e .", RuntimeWarning, stacklevel=3)
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
