"""ascend-emu calibrate: the fitted profile against the published CloudMatrix384 table (DESIGN.md 9)."""
import json

import pytest

from ascend_emu.cli import main
from kernels.calibrate import PUBLISHED, compare, measure


def test_small_ep_points_within_the_goal_and_deterministic():
    pts = [measure(8), measure(16)]
    res = compare(pts)
    for p in res["points"]:
        assert p["dispatch_err_pct"] <= 20 and p["combine_err_pct"] <= 20
    assert measure(8)["dispatch_us"] == pts[0]["dispatch_us"]


def test_calibrate_command_json(capsys):
    assert main(["calibrate", "--ep", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["points"][0]
    assert p["ep"] == 8 and p["published_dispatch_us"] == PUBLISHED[8][0]
    assert out["mean_abs_pct_err"] == pytest.approx((p["dispatch_err_pct"] + p["combine_err_pct"]) / 2)


@pytest.mark.slow
def test_full_sweep_meets_the_goal():
    res = compare([measure(ep) for ep in PUBLISHED])
    assert res["mean_abs_pct_err"] <= 10 and res["max_abs_pct_err"] <= 20
