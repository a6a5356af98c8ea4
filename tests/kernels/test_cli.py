"""The kernels layer's commands: calibrate and the model ops run on the --profile given."""
import json

from ascend_emu.cli import main


def _json(capsys, argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_calibrate_runs_on_the_profile(capsys):
    """EP 8 fits an Ascend 910B server (8 dies, one per chip: every rank pair crosses the fabric, at 1.8 GHz); the
    modeled dispatch differs from the CloudMatrix384 one. EP 16 does not fit it."""
    cm = _json(capsys, ["calibrate", "--ep", "8", "--gemm", "0"])["points"][0]
    b = _json(capsys, ["calibrate", "--ep", "8", "--gemm", "0", "--profile", "ascend910b"])["points"][0]
    assert b["published_dispatch_us"] == cm["published_dispatch_us"] and b["dispatch_us"] != cm["dispatch_us"]
    assert main(["calibrate", "--ep", "8", "16", "--profile", "ascend910b", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["option"] == "--ep" and "EP 16" in error["message"]


def test_grouped_gemm_peak_follows_the_profile(tmp_path, capsys):
    """Half the AICs per die: the op's reported peak halves with the profile, and --aic is capped by it."""
    half = tmp_path / "half.toml"
    half.write_text("aic_per_die = 12\n")
    args = ["model", "grouped-gemm", "--groups", "2", "--m", "256", "--n", "512", "--k", "512", "--aic", "12"]
    full = _json(capsys, args)["extras"]
    small = _json(capsys, args + ["--profile", str(half)])["extras"]
    assert small["peak_tops"] == full["peak_tops"] / 2
    assert main(["model", "grouped-gemm", "--profile", str(half), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["option"] == "--aic"
