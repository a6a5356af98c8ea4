"""``ascend-emu quantize``: a progress bar on stderr while it runs, Ctrl-C stops it, options are checked."""
import json
import re

import pytest

from ascend_emu.cli import main

from ..cli_process import run_on_terminal


def test_quantize_toy_shows_progress_and_stops_on_ctrl_c():
    rc, out, err, seen = run_on_terminal(["quantize", "--model", "toy", "--seq-len", "16"],
                                         r"quantising 1/\d+: layers\.0\.", interrupt=True)
    assert seen, err[-2000:]
    assert "fp32 reference logits" in err and "calibrating" in err      # the stages before it showed too
    assert rc == 130 and out == ""
    assert re.search(r"ascend-emu quantize: interrupted \(Ctrl-C\)\s*$", err.replace("\r", "\n")), err[-500:]


@pytest.mark.parametrize("argv, option", [
    (["--seq-len", "1"], "--seq-len"),
    (["--alpha", "nan"], "--alpha"),
    (["--eval-tokens", "0"], "--eval-tokens"),
    (["--scheme", "w4a4"], "--scheme"),
])
def test_bad_options_name_the_option(argv, option, capsys):
    assert main(["quantize", "--model", "toy", *argv, "--json"]) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out)["error"]["option"] == option and cap.err.count("\n") == 1
