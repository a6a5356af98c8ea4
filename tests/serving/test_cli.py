"""The serving layer's commands: --profile reaches every simulation of a decode step, die counts are checked
against it, and the demo stage refuses a profile too small for it before doing any work."""
import json

import pytest

from ascend_emu.cli import OptionError, main
from serving.cli import run_demo

SMALL = ["--config", "mini", "--dies", "4", "--batch-per-die", "8", "--seq-len", "128", "--microbatches", "1",
         "--layers", "2"]


def test_serve_model_runs_on_the_profile(tmp_path, capsys):
    """A die at 1.5 GHz with 32 GiB of HBM: a slower step, and the footprint is judged against 32 GiB."""
    path = tmp_path / "slow.toml"
    path.write_text(f"clock_ghz = 1.5\nhbm_bytes = {32 << 30}\n")
    out = {}
    for name, extra in (("default", []), ("slow", ["--profile", str(path)])):
        assert main(["serve-model", *SMALL, "--json"] + extra) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["default"]["hbm_capacity_gib"] == 64.0 and out["slow"]["hbm_capacity_gib"] == 32.0
    assert out["slow"]["step_us"] > out["default"]["step_us"]
    assert out["slow"]["hbm_footprint_gib"] == out["default"]["hbm_footprint_gib"]


@pytest.mark.parametrize("argv", [
    ["serve-model", "--dies", "16", "--profile", "ascend910b"],
    ["model", "decode-layer", "--dies", "16", "--profile", "ascend910b"],
])
def test_dies_beyond_the_profile_name_dies(argv, capsys):
    assert main([*argv, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["option"] == "--dies" and "16 DP/EP ranks" in error["message"] and "1..8" in error["message"]


def test_the_demo_stage_checks_the_profile_first(tmp_path):
    one = tmp_path / "one.toml"
    one.write_text("dies = 1\n")
    with pytest.raises(OptionError, match=r"--profile: the serving demo \(2 DP groups\) needs a pod of 2 dies"):
        run_demo(str(tmp_path), profile=str(one))
    assert list(tmp_path.iterdir()) == [one]


def test_piped_summary_keeps_its_lines_and_columns(monkeypatch, capsys):
    """Piped (capsys is not a terminal) and no COLUMNS: nothing is wrapped or cut at 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["serve-model", *SMALL, "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    per_layer = [line for line in lines if line.startswith("per layer: ")]
    assert len(per_layer) == 1 and per_layer[0].rstrip().endswith("s") and len(per_layer[0]) > 80
    assert "HBM footprint" in per_layer[0] and "wall" in per_layer[0]
    header = next(line for line in lines if "┃ op " in line)
    assert "dense" in header and "moe" in header
