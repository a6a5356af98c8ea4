"""``ascend-emu eplb``: JSON fields, the plan file and the heatmap."""
import json

import numpy as np

import eplb
from ascend_emu.cli import main


def test_eplb_cli_json_plan_and_png(tmp_path, capsys):
    w = eplb.drifting_load(3, 4, 32, hot_ratio=10.0, drift=0.4, seed=2)
    np.save(tmp_path / "load.npy", w)
    rc = main(["eplb", "--load", str(tmp_path / "load.npy"), "--slots", "1", "--dies", "40",
               "--out", str(tmp_path / "plan.npz"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["num_replicas"] == 40 and out["redundant"] == 8 and out["slices"] == 3
    assert out["after"]["overall"] < out["before"]["overall"]
    plan = np.load(out["out_path"])
    ref = eplb.rebalance_experts(w, 40, 1, 1, 40)
    assert all((plan[k] == r).all() for k, r in zip(("phy2log", "log2phy", "logcnt"), ref))
    assert np.isclose(out["after"]["overall"], eplb.balance_report(w, ref[0], 40).overall)
    assert open(out["png_path"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_eplb_cli_errors(tmp_path, capsys):
    np.save(tmp_path / "load.npy", np.ones((2, 32)))
    rc = main(["eplb", "--load", str(tmp_path / "load.npy"), "--slots", "1", "--dies", "16", "--json"])
    assert rc == 2 and "below the 32 logical experts" in capsys.readouterr().err


def test_eplb_cli_bad_loads_name_load(tmp_path, capsys):
    """A file of the wrong shape, a pickled object, NaN loads: one line naming --load, the JSON error object."""
    cases = {"shape.npy": np.ones(5), "nan.npy": np.full((2, 8), np.nan), "pickle.npy": np.array([{"a": 1}])}
    for name, value in cases.items():
        np.save(tmp_path / name, value, allow_pickle=True)
        rc = main(["eplb", "--load", str(tmp_path / name), "--slots", "1", "--dies", "8", "--json", "--quiet"])
        cap = capsys.readouterr()
        assert rc == 2 and cap.err.count("\n") == 1, name
        assert json.loads(cap.out)["error"]["option"] == "--load", name


def test_eplb_cli_quiet_text_output(tmp_path, capsys):
    """Without --json: the table (every column, piped) and the paths; --quiet keeps stderr empty."""
    np.save(tmp_path / "load.npy", eplb.drifting_load(2, 2, 16, hot_ratio=5.0, drift=0.3, seed=1))
    assert main(["eplb", "--load", str(tmp_path / "load.npy"), "--slots", "1", "--dies", "20", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""
    header = next(line for line in cap.out.splitlines() if "max/mean overall" in line)
    assert all(c in header for c in ("layout", "max/mean overall", "worst layer", "per slice overall"))
