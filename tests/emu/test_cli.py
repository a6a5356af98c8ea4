"""The command line: demo checks its numbers, model ops print the documented JSON fields, every failure is one line
naming the option (and a JSON error object with --json), --profile changes the machine, Ctrl-C and a closed stdout
end the process cleanly, the layers register through entry points."""
import contextlib
import dataclasses
import importlib
import importlib.metadata
import io
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ascend_emu import cli
from ascend_emu.cli import COMMANDS, REGISTRY, main

from ..cli_process import COMMAND, TIMEOUT_S, run_on_terminal

cli.load_command_modules()          # the layers' ops and commands, for the parametrised tests below

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
    # the serving layer's end-to-end part (serving.cli): tokens checked against the reference, modeled metrics
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


# ------------------------------------------------------------------------------ failures: one line, the option
def _failure(argv, capsys):
    """Run in-process with --json: (exit code, the JSON error object, the stderr lines)."""
    rc = main([*argv, "--json"])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    return rc, json.loads(cap.out)["error"] if cap.out.strip() else None, lines


@pytest.mark.parametrize("argv, option, says", [
    (["model", "copy", "--bytes", "0"], "--bytes", "below the minimum 1"),
    (["model", "copy", "--cores", "0"], "--cores", "below the minimum 1"),
    (["model", "copy", "--cores", "49"], "--cores", "above the maximum 48 (aiv_per_die"),
    (["model", "copy", "--bytes", "lots"], "--bytes", "invalid int value: 'lots'"),
    (["model", "quantize", "--cores", "0"], "--cores", "below the minimum 1"),
    (["model", "grouped-gemm", "--groups", "0"], "--groups", "below the minimum 1"),
    (["model", "grouped-gemm", "--aic", "25"], "--aic", "above the maximum 24"),
    (["model", "copy", "--dst-die", "999"], "--dst-die", "1..768"),
    (["model", "send-recv", "--src-die", "768", "--dst-die", "1"], "--src-die", "1..768"),
    (["model", "expert-service", "--kill-server", "-1"], "--kill-server", "below the minimum 0"),
    (["model", "expert-service", "--kill-server", "8", "--kill-at-us", "5"], "--kill-server", "0 .. 7"),
    (["model", "expert-pipeline", "--attn-us", "nan"], "--attn-us", "not a finite number"),
    (["model", "gemm-int8", "--m", "100"], "--m", "m=100 must be a multiple of the 128 tile"),
    (["model", "quantize", "--tokens", "100"], "--tokens", "tokens=100"),
    (["model", "grouped-gemm", "--k", "5"], "--k", "K=5"),                              # the library's capital
    (["model", "fused-dispatch", "--ep", "4", "--experts", "6", "--topk", "2"], "--experts", "num_experts=6"),
    (["model", "dispatch", "--ep", "4", "--experts", "16", "--topk", "17"], "--topk", "above the --experts 16"),
    (["model", "e2a", "--attn-dies", "2", "--expert-dies", "3", "--topk", "5"], "--topk", "above the 3 routed"),
    (["model", "copy", "--no-such-option", "1"], "--no-such-option", "unrecognized arguments"),
    (["model", "copy", "--profile", "tpu-v5"], "--profile", "not a preset"),
    (["model", "fused-dispatch", "--ep", "16", "--profile", "ascend910b"], "--ep", "1..8 dies"),
    (["serve-model", "--dies", "3"], "--dies", "dies=3"),
    (["serve-model", "--dies", "0"], "--dies", "below the minimum 1"),
    (["calibrate", "--ep", "7"], "--ep", "published"),
    (["eplb", "--load", "{missing}", "--slots", "1", "--dies", "40"], "--load", "No such file"),
    (["eplb", "--load", "{load}", "--slots", "1", "--dies", "0"], "--dies", "below the minimum 1"),
    (["eplb", "--load", "{load}", "--slots", "1", "--dies", "40", "--nodes", "3"], "--dies", "num_gpus=40"),
    (["eplb", "--load", "{load}", "--slots", "1", "--dies", "16"], "--slots", "below the 32 logical experts"),
    (["quantize", "--alpha", "1.5"], "--alpha", "above the maximum 1.0"),
])
def test_a_failure_is_one_line_naming_the_option_and_a_json_error(argv, option, says, tmp_path, capsys):
    np.save(tmp_path / "load.npy", np.ones((2, 32)))
    argv = [a.format(load=tmp_path / "load.npy", missing=tmp_path / "missing.npy") for a in argv]
    rc, error, lines = _failure(argv, capsys)
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("ascend-emu") and option in lines[0] and says in lines[0]
    assert error["option"] == option and says in error["message"] and error["type"]
    assert "Traceback" not in lines[0]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_bounded_model_option_rejects_values_below_its_minimum(data):
    """Every op option with a minimum: a value under it fails before anything runs, naming that option."""
    bounded = [(op, o) for op in sorted(REGISTRY) for o in REGISTRY[op].options if o.min is not None]
    op, o = data.draw(st.sampled_from(bounded))
    value = data.draw(st.integers(-10 ** 9, int(o.min) - 1))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["model", op, o.name, str(value), "--json"])
    assert rc == 2
    assert json.loads(out.getvalue())["error"]["option"] == o.name
    assert err.getvalue().count("\n") == 1
    assert f"{o.name}: {o.type(value)} is below the minimum {o.min}" in err.getvalue()


def test_profile_limits_follow_the_profile(tmp_path, capsys):
    """--cores / --aic maxima come from the profile in use (its aiv_per_die / aic_per_die)."""
    small = tmp_path / "small.toml"
    small.write_text("aiv_per_die = 16\naic_per_die = 8\n")
    rc, error, _ = _failure(["model", "copy", "--cores", "17", "--profile", str(small)], capsys)
    assert rc == 2 and error["option"] == "--cores" and "maximum 16" in error["message"]
    rc, error, _ = _failure(["model", "gemm-int8", "--aic", "9", "--profile", str(small)], capsys)
    assert rc == 2 and error["option"] == "--aic" and "maximum 8" in error["message"]


def test_an_internal_error_is_one_line_too(monkeypatch, capsys):
    def broken(**kw):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setitem(REGISTRY, "copy", dataclasses.replace(REGISTRY["copy"], fn=broken))
    rc, error, lines = _failure(["model", "copy"], capsys)
    assert rc == 1 and len(lines) == 1 and "ZeroDivisionError" in lines[0] and "ASCEND_EMU_TRACEBACK" in lines[0]
    assert error["type"] == "ZeroDivisionError"


# ------------------------------------------------------------------------------------------ help and options
@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_model_op_help_shows_every_option(op, capsys):
    rc = main(["model", op, "--help"])
    text = capsys.readouterr().out
    assert rc == 0
    for name in [o.name for o in REGISTRY[op].options] + ["--json", "--quiet", "--trace", "--profile"]:
        assert re.search(rf"(^|\s){re.escape(name)}\b", text), (op, name)


@pytest.mark.parametrize("name", sorted(COMMANDS) + ["demo"])
def test_command_help_shows_the_common_options(name, capsys):
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    assert "--json" in text and "--quiet" in text
    assert ("--profile" in text) == (name == "demo" or COMMANDS[name].profile)


def test_common_options_before_or_after_the_op(capsys):
    args = ["--bytes", "1048576", "--cores", "8"]
    assert main(["model", "copy", *args, "--json", "--quiet"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert main(["model", "--json", "--quiet", "copy", *args]) == 0
    before = json.loads(capsys.readouterr().out)
    assert after["modeled_us"] == before["modeled_us"] > 0 and after["options"] == before["options"]


# ---------------------------------------------------------------------------------------------------- profiles
def test_profile_changes_the_modeled_time(tmp_path, capsys):
    """gemm-int8 on one die: cloudmatrix384 runs at 1.85 GHz, ascend910b (and a file saying so) at 1.8 GHz; the
    cycle-bound part of the kernel stretches by 1.85 / 1.8, the bandwidth-bound part does not."""
    args = ["model", "gemm-int8", "--m", "256", "--n", "256", "--k", "512", "--aic", "4", "--json"]
    slow = tmp_path / "slow.toml"
    slow.write_text('preset = "cloudmatrix384"\nclock_ghz = 1.8\n')
    us = {}
    for name, extra in (("default", []), ("ascend910b", ["--profile", "ascend910b"]),
                        ("file", ["--profile", str(slow)]), ("preset", ["--profile", "cloudmatrix384"])):
        assert main(args + extra) == 0
        us[name] = json.loads(capsys.readouterr().out)["modeled_us"]
    assert us["preset"] == us["default"]
    assert us["file"] == us["ascend910b"]
    assert us["default"] < us["ascend910b"] <= us["default"] * 1.85 / 1.8 * (1 + 1e-9)


def test_a_bad_profile_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("hbm_gbs = 1.0\n")
    for spec, says in ((str(bad), "unknown key 'hbm_gbs'"), (str(tmp_path / "none.toml"), "does not exist"),
                       ("tpu", "not a preset")):
        rc, error, lines = _failure(["model", "copy", "--profile", spec], capsys)
        assert rc == 2 and len(lines) == 1 and error["option"] == "--profile" and says in error["message"]


def test_an_op_without_a_profile_parameter_refuses_another_profile(monkeypatch, capsys):
    def default_only(bytes, cores, dst_die, trace=False):
        return {"op": "copy", "modeled_us": 1.0, "bytes_moved": 1, "utilization": None}
    monkeypatch.setitem(REGISTRY, "copy", dataclasses.replace(REGISTRY["copy"], fn=default_only))
    rc, error, _ = _failure(["model", "copy", "--profile", "ascend910b"], capsys)
    assert rc == 2 and error["option"] == "--profile"
    assert main(["model", "copy", "--json"]) == 0 and json.loads(capsys.readouterr().out)["modeled_us"] == 1.0


# -------------------------------------------------------------------------------------------- output, signals
def test_piped_tables_keep_every_column(monkeypatch, capsys):
    from rich.table import Table
    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table(title="wide")
    names = [f"column number {i:02d}" for i in range(12)]
    for name in names:
        table.add_column(name)
    table.add_row(*[f"value {i:02d}" for i in range(12)])
    cli.console().print(table)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "column number 00" in line)
    assert all(name in header for name in names) and len(header) > 200


@pytest.mark.parametrize("args, code, err", [
    (["model", "--help"], 0, ""),                                   # argparse drops what it cannot write
    (["model", "--list"], 141, ""),
    (["model", "copy", "--bytes", "1048576", "--quiet"], 141, ""),   # a rich table
    (["model", "copy", "--bytes", "1048576", "--json"], 141, ""),
    (["model", "copy", "--bytes", "0", "--json"], 141,              # the error line still reaches stderr
     "ascend-emu model copy: --bytes: 0 is below the minimum 1\n"),
])
def test_a_closed_stdout_ends_quietly(args, code, err):
    """``ascend-emu ... | head`` with head gone: no traceback, exit 141 (128 + SIGPIPE) when output was lost."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run(COMMAND + args, stdout=write, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (code, err)


def test_ctrl_c_stops_a_run_with_one_line():
    """A pod-scale A2E (192 + 288 dies): Ctrl-C once the progress bar shows modeled time; the process clears the
    bar, says where the run was and exits 130, without a traceback (unwinding such a run took tens of seconds)."""
    rc, out, err, seen = run_on_terminal(["model", "a2e", "--attn-dies", "192", "--batch-per-die", "16",
                                          "--hidden", "1024"], r"us modeled, [\d,]+ instructions", interrupt=True)
    assert seen and rc == 130 and out == ""
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"ascend-emu model a2e: interrupted \(Ctrl-C\) at [\d,.]+ us modeled", last), last
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_ctrl_c_with_json_prints_the_error_object(monkeypatch, capsys):
    """The handler itself (in-process; it would end the test process): the bar goes, the JSON error is printed."""
    class Exit(Exception):
        pass

    def fake_exit(code):
        raise Exit(code)
    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(cli, "_modeled_us", 12.5)
    handler = cli._on_interrupt({"prog": "ascend-emu model copy", "json": True})
    with pytest.raises(Exit) as e:
        handler(signal.SIGINT, None)
    assert e.value.args == (130,)
    cap = capsys.readouterr()
    assert json.loads(cap.out) == {"error": {"type": "KeyboardInterrupt", "option": None,
                                             "message": "interrupted (Ctrl-C) at 12.5 us modeled"}}
    assert cap.err == "ascend-emu model copy: interrupted (Ctrl-C) at 12.5 us modeled\n"


# ------------------------------------------------------------------------------------ command modules (plugins)
def _pyproject_entries() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.ENTRY_POINT_GROUP]


def test_the_layers_register_through_the_entry_point_group():
    entries = _pyproject_entries()
    assert entries == {"xccl": "xccl.cli", "kernels": "kernels.cli", "quant": "quant.cli", "eplb": "eplb.cli",
                       "serving": "serving.cli"}
    assert cli.command_modules() == entries
    # ascend_emu names no layer above it
    for path in (ROOT / "ascend_emu").glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+(xccl|kernels|quant|eplb|serving)\b", path.read_text(), re.M), path


def test_the_installed_metadata_carries_the_entry_points():
    """An install of this tree (pip install -e .) publishes the group; older metadata means a stale install."""
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=cli.ENTRY_POINT_GROUP)}
    if not installed:
        pytest.skip("the installed ascend-emu metadata predates the entry points (reinstall: pip install -e .)")
    assert installed == _pyproject_entries()


def test_without_entry_points_the_core_still_works():
    """A copy of ascend_emu with no installed entry points and no pyproject.toml beside it: the core's commands
    run, the layers' are absent, and none of the layers is imported."""
    code = textwrap.dedent("""
        import importlib.metadata, json, sys
        from pathlib import Path
        importlib.metadata.entry_points = lambda **kw: []
        import ascend_emu.cli as cli
        cli.SOURCE_TREE = Path("/nonexistent")
        rc = cli.main(["model", "copy", "--bytes", "1048576", "--json"])
        print(json.dumps({"rc": rc, "ops": sorted(cli.REGISTRY), "commands": sorted(cli.COMMANDS),
                          "layers": [m for m in ("eplb", "kernels", "quant", "serving", "xccl") if m in sys.modules]}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    got = json.loads(lines[-1])
    assert json.loads(lines[-2])["op"] == "copy"
    assert got == {"rc": 0, "ops": ["copy", "gemm-int8", "quantize"], "commands": [], "layers": []}


def test_a_layer_that_fails_to_import_costs_only_its_commands(monkeypatch, capsys):
    monkeypatch.setattr(cli, "command_modules", lambda: {"broken": "no_such_package.cli"})
    monkeypatch.setattr(cli, "_loaded", set())
    assert main(["model", "copy", "--bytes", "1048576", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["op"] == "copy"
    assert cap.err.count("\n") == 1 and "'broken' (no_such_package.cli) are unavailable" in cap.err


def test_a_layer_hidden_by_another_distributions_package_is_named(monkeypatch, capsys):
    """Hugging Face's ``kernels`` (required by transformers >= 5.25) ships a top-level ``kernels`` package too: the
    failure line names the distribution that hides ours."""
    monkeypatch.setattr(cli, "command_modules", lambda: {"kernels": "kernels.cli"})
    monkeypatch.setattr(cli, "_loaded", set())
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda m: (_ for _ in ()).throw(ModuleNotFoundError(f"No module named '{m}'")))
    monkeypatch.setattr(cli.importlib.metadata, "packages_distributions",
                        lambda: {"kernels": ["kernels", "ascend-emu"], "numpy": ["numpy"]})
    assert main(["model", "copy", "--bytes", "1048576", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No module named 'kernels.cli'" in err
    assert "distribution kernels also ships a top-level 'kernels' package" in err
    monkeypatch.setattr(cli.importlib.metadata, "packages_distributions", lambda: {"kernels": ["ascend-emu"]})
    assert cli._shadowed("kernels.cli") == ""


def test_the_old_registry_module_still_works_with_a_warning():
    sys.modules.pop("ascend_emu.ops", None)
    with pytest.warns(DeprecationWarning, match="ascend_emu.cli"):
        ops = importlib.import_module("ascend_emu.ops")
    assert ops.REGISTRY is REGISTRY and ops.register is cli.register


def test_the_ascend_emu_process_freezes_what_is_left_for_its_exit_but_a_caller_keeps_its_collector():
    """As the process (no argv) the objects alive at the end leave the collector's exit pass; a Python caller's
    garbage collector is left as it was."""
    code = textwrap.dedent("""
        import gc, sys
        from ascend_emu import cli
        assert cli.main(["model", "--list"]) == 0 and gc.get_freeze_count() == 0
        sys.argv = ["ascend-emu", "model", "--list"]
        rc = cli.main()
        print(rc, gc.get_freeze_count() > 0, gc.isenabled())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(cli.__file__).resolve().parent.parent)))
    assert out.stdout.split()[-3:] == ["0", "True", "True"]
