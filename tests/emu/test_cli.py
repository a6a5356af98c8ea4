"""The command line: demo checks its numbers, model ops print the documented JSON fields."""
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_emu.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_demo_json(tmp_path, capsys):
    rc = main(["demo", "--json", "--out", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["max_abs_err"] == 0.0
    assert out["modeled_us"] > 0
    assert out["gemm"]["int32_exact"] is True and out["quantize"]["q_mismatches"] == 0
    assert os.path.getsize(out["trace_path"]) > 1000
    assert open(out["png_path"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    trace = json.load(open(out["trace_path"]))
    assert list(trace)[0] == "profilingType" and trace["profilingType"] == "op"
    # the serving layer's end-to-end part (serving.ops): tokens checked against the reference, modeled metrics
    assert out["tokens_match"] is True
    assert out["ttft_ms"] > out["tpot_ms"] > 0 and out["tokens_per_s"] > 0
    sv = out["serving"]
    assert set(sv["decode_step_per_layer_us"]) == {"layer0", "layer1", "layer2"}
    assert sv["decode_step_per_layer_us"]["layer1"]["dispatch"] > 0
    assert sv["decode_step_us"] == pytest.approx(sum(sv["decode_step_breakdown_us"].values()), rel=1e-6)
    assert open(sv["png_path"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(sv["trace_path"]))["profilingType"] == "op"


@pytest.mark.parametrize("op, args", [
    ("quantize", ["--tokens", "384", "--hidden", "7168"]),
    ("gemm-int8", ["--m", "256", "--n", "256", "--k", "512", "--aic", "4"]),
    ("copy", ["--bytes", "4194304", "--dst-die", "1"]),
])
def test_model_json_fields(op, args, capsys):
    rc = main(["model", op, *args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["op"] == op
    assert out["modeled_us"] > 0 and out["bytes_moved"] > 0
    assert 0.0 < out["utilization"] <= 1.0


def test_model_bad_option_is_a_clear_error(capsys):
    rc = main(["model", "quantize", "--tokens", "192", "--hidden", "100000", "--json"])
    assert rc == 2
    assert "CapacityError" in capsys.readouterr().err


def test_model_unknown_op(capsys):
    assert main(["model", "no-such-op"]) == 2
    assert "quantize" in capsys.readouterr().err


def test_console_script_installed():
    exe = Path(sys.executable).parent / "ascend-emu"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ascend_emu.cli"]
    p = subprocess.run(cmd + ["model", "--list"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "gemm-int8" in p.stdout


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_run(path):
    runpy.run_path(str(path), run_name="__main__")
