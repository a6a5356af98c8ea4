"""``--workers N`` on the command line (ascend_emu.cli.add_workers): ``model`` ops, ``calibrate`` and ``serve-model``
print what --workers 1 prints (with --sanitize too), plus a ``workers`` block in --json; a run that cannot be
partitioned is one line naming --workers, not a traceback."""
from __future__ import annotations

import json

import pytest

from ascend_emu.cli import main

# what may differ between worker counts: wall-clock figures, and the block that reports the workers
_RUN_DEPENDENT = ("wall_s", "peak_rss_mb", "workers")


def _figures(x):
    if isinstance(x, dict):
        return {k: _figures(v) for k, v in x.items() if k not in _RUN_DEPENDENT}
    if isinstance(x, list):
        return [_figures(v) for v in x]
    return x


def _json(capsys, argv: list) -> dict:
    assert main(argv + ["--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [
    ["model", "a2e", "--attn-dies", "4", "--expert-dies", "8", "--batch-per-die", "8", "--hidden", "256"],
    ["model", "fused-dispatch", "--ep", "4", "--tokens-per-rank", "8", "--hidden", "256", "--experts", "8",
     "--topk", "2"],
    ["calibrate", "--ep", "8", "--gemm", "0"],
])
def test_two_workers_print_the_figures_of_one(capsys, argv):
    one = _json(capsys, argv + ["--workers", "1"])
    two = _json(capsys, argv + ["--workers", "2"])
    assert "workers" not in one
    assert _figures(two) == _figures(one)
    block = two["workers"]
    assert block["workers"] == 2 and block["runs"]
    for run in block["runs"]:
        assert len(run) == 2
        # [first, last, count] per worker: every die of the pod once over the workers (interleaved chips)
        assert run[0]["dies"][0] == 0 and sum(w["dies"][2] for w in run) == max(w["dies"][1] for w in run) + 1
        assert all(w["windows"] >= 1 and w["messages"] > 0 and 0 <= w["wait_share"] <= 1 for w in run)


def test_serve_model_on_two_workers_prints_the_figures_of_one(capsys):
    argv = ["serve-model", "--config", "mini", "--dies", "4", "--batch-per-die", "4", "--seq-len", "128",
            "--layers", "2"]
    one = _json(capsys, argv)
    two = _json(capsys, argv + ["--workers", "2"])
    assert _figures(two) == _figures(one)
    assert len(two["workers"]["runs"]) >= 1


def test_a_pod_of_one_chip_runs_in_this_process(capsys):
    argv = ["model", "quantize", "--tokens", "192", "--hidden", "1024"]
    one = _json(capsys, argv)
    two = _json(capsys, argv + ["--workers", "2"])
    assert _figures(two) == _figures(one)
    assert two["workers"] == {"workers": 2, "runs": []}          # one die: no partitioned run


def test_a_sanitized_run_on_two_workers_prints_the_races_and_figures_of_one(capsys):
    """--sanitize --workers 2: the race sanitizer runs partitioned (before: refused, exit 2)."""
    argv = ["model", "a2e", "--attn-dies", "4", "--expert-dies", "8", "--batch-per-die", "8", "--hidden", "256",
            "--sanitize"]
    one = _json(capsys, argv + ["--workers", "1"])
    two = _json(capsys, argv + ["--workers", "2"])
    assert "races" in one and _figures(two) == _figures(one)
    assert two["workers"]["runs"]


def test_a_run_that_cannot_be_partitioned_is_one_line_naming_workers(capsys, monkeypatch):
    import ascend_emu.workers as workers
    from ascend_emu.errors import NotPartitionableError

    def refuse(pod):
        raise NotPartitionableError("not yet partitionable: kernel 'k' sends 'fn' to die 3, which another worker "
                                    "runs, and no message codec is registered for it")
    monkeypatch.setattr(workers, "run_partitioned", refuse)
    import ascend_emu.pod as pod_module
    monkeypatch.setattr(pod_module, "run_partitioned", refuse)
    argv = ["model", "a2e", "--attn-dies", "4", "--expert-dies", "8", "--batch-per-die", "8", "--hidden", "256",
            "--workers", "2"]
    assert main(argv + ["--json"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ascend-emu model a2e: --workers 2: not yet partitionable")
    assert "no message codec" in err[0]
    error = json.loads(captured.out)["error"]
    assert error["option"] == "--workers" and error["type"] == "OptionError"


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_worker_count_names_the_option(capsys, value):
    assert main(["model", "quantize", "--workers", value, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["option"] == "--workers"
