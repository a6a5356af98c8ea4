"""The compiled (Cython) build of the hot modules and their Python sources: the same numbers, the same times."""
import importlib.machinery
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ascend_emu
from ascend_emu import _build

# runs a numeric quantise (48 AIVs), a MIX int8 GEMM (cross-core flags), a DMA and an mtu send/recv across servers
# (GM flags, polls) and a 4-die dispatch (atomics, ring buffers); prints what must not depend on the build
_PROBE = textwrap.dedent("""
    import hashlib, json
    import numpy as np
    import ascend_emu
    from ascend_emu.demo import run_gemm, run_quantize
    from xccl.cli import _dispatch, _send_recv

    out = {"build": ascend_emu.ENGINE_BUILD}
    q = run_quantize(tokens=48 * 16, hidden=256)
    g = run_gemm(128, 256, 256, aic=2)
    out["quantize"] = [q["run"].modeled_us, q["max_abs_err"], q["run"].trace.digest(), q["run"].instructions]
    out["gemm"] = [g["run"].modeled_us, g["max_abs_err"], g["run"].trace.digest()]
    for path in ("mtu", "dma"):
        f = _send_recv(bytes=1 << 20, cores=4, path=path, src_die=0, dst_die=16, zero_copy=0, trace=True)
        out["send-recv " + path] = [f["modeled_us"], f["run"].trace.digest()]
    f = _dispatch(ep=4, tokens_per_rank=16, hidden=512, topk=4, experts=16, cores=8, quant=1, trace=True)
    out["dispatch"] = [f["modeled_us"], f["run"].trace.digest(), f["bytes_moved"]]
    print(json.dumps(out))
""")


def _probe(pure: bool) -> dict:
    env = dict(os.environ)
    env.pop("ASCEND_EMU_PURE", None)
    if pure:
        env["ASCEND_EMU_PURE"] = "1"
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_installed_build_is_compiled():
    # the README's install compiles the hot modules; a stale or failed build would run ~1.8x slower unnoticed
    if os.environ.get("ASCEND_EMU_PURE", "") not in ("", "0"):
        assert ascend_emu.ENGINE_BUILD == "python"
        return
    assert ascend_emu.ENGINE_BUILD == "compiled", (
        f"the hot modules run from source: {_build._stale(Path(_build.__file__).parent)}; rebuild with pip install -e .")
    for m in _build.COMPILED:       # every hot module, the staged transfers' halves (staging) and polls among them
        assert sys.modules[f"ascend_emu.{m}"].__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), m
    assert "staging" in _build.COMPILED and "polls" in _build.COMPILED


def test_compiled_and_source_builds_give_the_same_results_and_times():
    pure, compiled = _probe(True), _probe(False)
    assert pure.pop("build") == "python"
    assert compiled.pop("build") == ("python" if _build._stale(Path(_build.__file__).parent) else "compiled")
    assert pure == compiled
    assert pure["quantize"][1] == 0.0 and pure["gemm"][1] == 0.0     # and both are right, not just equal


def test_a_build_from_other_sources_is_not_used(tmp_path):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for m in _build.COMPILED:
        (tmp_path / f"{m}.py").write_text(f"# {m}")
        (tmp_path / f"{m}.pxd").write_text(f"# {m} types")
        (tmp_path / f"{m}{suffix}").write_bytes(b"")
    assert _build._stale(tmp_path) == [f"no record of the sources it was built from ({_build.RECORD})"]
    (tmp_path / _build.RECORD).write_text(json.dumps({"digest": _build.source_digest(tmp_path)}))
    assert _build._stale(tmp_path) == []
    (tmp_path / "engine.pxd").write_text("# engine types, edited")          # a .pxd edit changes the C types too
    assert _build._stale(tmp_path) == ["the sources changed after the build"]
    (tmp_path / "engine.pxd").write_text("# engine types")
    assert _build._stale(tmp_path) == []
    (tmp_path / f"views{suffix}").unlink()
    assert _build._stale(tmp_path) == ["not built: views"]
