"""``ascend-emu model`` ops of XCCL: the profile decides the links, server kills name servers."""
import json

import pytest

from ascend_emu.cli import main


def _model(capsys, *argv) -> dict:
    assert main(["model", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_send_recv_takes_the_profiles_topology(capsys):
    """Dies 0 -> 1: the two dies of one CloudMatrix384 chip (the 224 GB/s die-to-die link) vs two chips of an
    Ascend 910B server (one die per chip: the 196 GB/s fabric port, at 1.8 GHz): the 910B transfer is slower."""
    args = ["send-recv", "--bytes", str(4 << 20), "--cores", "8", "--src-die", "0", "--dst-die", "1"]
    cm = _model(capsys, *args)
    b = _model(capsys, *args, "--profile", "ascend910b")
    assert b["achieved_gbps"] < cm["achieved_gbps"] <= 224.0
    assert b["modeled_us"] > cm["modeled_us"]


@pytest.mark.parametrize("server", [0, 2])
def test_kill_server_kills_that_server(server, capsys):
    """--kill-server is an index into the servers (dies clients .. clients + servers - 1)."""
    out = _model(capsys, "expert-service", "--clients", "2", "--servers", "3", "--experts", "6", "--topk", "2",
                 "--hidden", "256", "--requests", "2", "--kill-server", str(server), "--kill-at-us", "1")
    assert list(out["dead_detected_us"]) == [str(2 + server)]
    assert out["completed"] == 2 * 2


def test_a2e_dies_must_fit_the_profile(capsys):
    assert main(["model", "a2e", "--attn-dies", "4", "--expert-dies", "8", "--profile", "ascend910b", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["option"] == "--attn-dies" and "12 dies" in error["message"] and "1..8" in error["message"]


@pytest.mark.parametrize("op, args", [
    ("a2e", ["--attn-dies", "2", "--expert-dies", "2", "--batch-per-die", "4", "--hidden", "256"]),
    ("dispatch", ["--ep", "2", "--experts", "2", "--tokens-per-rank", "4", "--hidden", "256"]),
])
def test_topk_may_equal_the_experts(op, args, capsys):
    """--topk up to the number of experts is allowed, and at it every token goes to every expert (it raised numpy's
    'kth out of bounds' before)."""
    out = _model(capsys, op, *args, "--topk", "2")
    assert out["modeled_us"] > 0 and out["options"]["topk"] == 2
