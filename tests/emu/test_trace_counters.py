"""Bandwidth counters and source lines in traces, and the Chrome trace event format of what we write.

The kernels here move data inside a die, across dies through UB (fabric ports) and with a DMA engine, and hand
over with a flag, so a trace has every kind of event: pipe slices, flag flows, metadata and bandwidth counters.
"""
import json
import linecache

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.trace import BANDWIDTH_UNIT, COUNTER_KEY, Trace, counter_steps

ROWS, COLS = 64, 256          # per sending core: 64 KiB of int32

# The Chrome trace event format (the "JSON Object Format" of Google's Trace Event Format document) for the
# event types the emulator writes: complete slices (X), counters (C), metadata (M), flow start / end (s / f).
_NUM = {"type": "number"}
_ID = {"type": "integer"}
CHROME_TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["name", "ph", "pid"],
            "properties": {"name": {"type": "string"}, "ph": {"enum": ["X", "C", "M", "s", "f"]},
                           "pid": _ID, "tid": _ID, "ts": _NUM, "cat": {"type": "string"},
                           "args": {"type": "object"}},
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}},
                 "then": {"required": ["ts", "dur", "tid"], "properties": {"dur": {"type": "number", "minimum": 0}}}},
                {"if": {"properties": {"ph": {"const": "C"}}},
                 "then": {"required": ["ts", "args"],
                          "properties": {"args": {"type": "object", "minProperties": 1,
                                                  "additionalProperties": {"type": "number", "minimum": 0}}}}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"required": ["args", "tid"],
                          "properties": {"name": {"enum": ["process_name", "process_sort_index", "thread_name",
                                                           "thread_sort_index"]}}}},
                {"if": {"properties": {"ph": {"enum": ["s", "f"]}}},
                 "then": {"required": ["ts", "id", "tid", "cat"]}},
                {"if": {"properties": {"ph": {"const": "f"}}}, "then": {"required": ["bp"]}},
            ],
        },
    },
}


def _stage(ctx, tile, dst, src):
    """A helper the kernel delegates to with ``yield from``: GM -> UB -> GM."""
    yield ctx.copy_gm_to_ub(tile, src)
    yield ctx.copy_ub_to_gm(dst, tile)


def exchange(ctx, x, y, z, out, flag):
    """Die 0's cores send their rows to die 1: through UB (fabric ports) into ``y`` and with the DMA engine into
    ``z``, then count themselves in on die 1's ``flag``; die 1's cores wait for both and copy ``y`` into ``out``."""
    tile = ctx.ub.alloc((ROWS, COLS), "int32", name="tile")
    rows = slice(ctx.block_idx * ROWS, (ctx.block_idx + 1) * ROWS)     # blocks count per die
    if ctx.die == 0:
        yield from _stage(ctx, tile, y[rows], x[rows])
        yield ctx.dma_copy(z[rows], x[rows])
        yield ctx.atomic_add(flag, 1, after="all")
    else:
        yield ctx.wait_gm(flag, "eq", 2)
        yield ctx.copy_gm_to_ub(tile, y[rows])
        yield ctx.copy_ub_to_gm(out[rows], tile)


def run_exchange(trace: bool, dst: int = 2):
    """Die 0 -> die ``dst``: 2 is on another chip (UB fabric ports), 1 on the same chip (die-to-die link)."""
    pod = Pod(cloudmatrix384(dies=4), trace=trace)
    x, y, z, out, flag = args = _exchange_args(pod, dst)
    run = pod.launch(exchange, dies=[0, dst], aiv=2, args=args)
    np.testing.assert_array_equal(out.numpy(), x.numpy())
    np.testing.assert_array_equal(z.numpy(), x.numpy())
    return run


def _exchange_args(pod, dst: int) -> tuple:
    x = pod.to_gm(0, np.arange(2 * ROWS * COLS, dtype=np.int32).reshape(2 * ROWS, COLS), name="x")
    y, z, out = (pod.alloc(dst, (2 * ROWS, COLS), "int32", name=n) for n in ("y", "z", "out"))
    return x, y, z, out, pod.alloc(dst, (1,), "int32", name="flag")


@pytest.fixture(scope="module")
def traced():
    return run_exchange(True)


def integral_bytes(steps) -> float:
    """Bytes under a piecewise-constant bytes/s curve ``[(time_ps, rate), ...]``."""
    return sum(r * (t1 - t0) for (t0, r), (t1, _) in zip(steps, steps[1:])) / 1e12


def test_trace_json_is_chrome_trace_format(traced, tmp_path):
    obj = json.loads(open(traced.trace.save(tmp_path / "exchange.json")).read())
    jsonschema.validate(obj, CHROME_TRACE_SCHEMA)
    phases = {e["ph"] for e in obj["traceEvents"]}
    assert phases == {"X", "C", "M", "s", "f"}
    # a counter's process is named; Perfetto ties counter events to it by pid
    names = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e.get("name") == "process_name"}
    assert {names[e["pid"]] for e in obj["traceEvents"] if e["ph"] == "C"} == {"die 0 / bandwidth",
                                                                                 "die 2 / bandwidth"}


def counter_tracks(run) -> set:
    obj = run.trace.to_chrome()
    names = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e.get("name") == "process_name"}
    return {(names[e["pid"]], e["name"]) for e in obj["traceEvents"] if e["ph"] == "C"}


@pytest.mark.parametrize("dst", [1, 2])
def test_counter_tracks_per_die_for_every_server(traced, dst):
    """HBM, L2, the fabric ports (UB across chips, die-to-die within one) and the DMA engine, each on its die.
    The destination's HBM moves nothing: the writes stay in its L2 (write-back) and the reads hit there."""
    run = traced if dst == 2 else run_exchange(True, dst)
    port = "ub" if dst == 2 else "d2d"
    expected = {("die 0 / bandwidth", n) for n in ("hbm0", "l2.0", f"{port}.tx0", "dma0.0")}
    expected |= {(f"die {dst} / bandwidth", n) for n in (f"l2.{dst}", f"{port}.rx{dst}")}
    assert counter_tracks(run) == expected
    assert set(run.servers) == {name for _, name in expected}


def test_counters_integrate_to_the_bytes_the_run_reports(traced):
    steps = traced.trace.counter_steps()
    for (die, name), st_ in steps.items():
        assert integral_bytes(st_) == pytest.approx(traced.servers[name]["bytes"], rel=1e-9), name
        assert st_[-1][1] == 0.0 and all(r >= 0 for _, r in st_)
    hbm = sum(integral_bytes(st_) for (_, name), st_ in steps.items() if name.startswith("hbm"))
    assert hbm == pytest.approx(traced.hbm_bytes(), rel=1e-9) and traced.hbm_bytes() > 0
    # FIFO servers: busy at their bandwidth, so no counter exceeds it (bytes/s = GB/s * 1e9)
    prof = cloudmatrix384(dies=4)
    peak = {"hbm": prof.hbm_gbps, "l2.": prof.l2_gbps, "ub.": prof.fabric_gbps, "dma": prof.dma_gbps}
    for (_, name), st_ in steps.items():
        assert max(r for _, r in st_) <= peak[name[:3]] * 1e9 * (1 + 1e-9) + 1e12, name   # +1e12: a 1 ps sliver


def test_slices_name_the_kernel_function_and_source_line(traced):
    xs = [s for s in traced.trace.slices if s[2] not in ("SYNC",)]
    assert xs
    sources = set()
    for die, unit, track, name, start, end, args in xs:
        assert args["kernel"] == "exchange"
        path, line = args["source"].rsplit(":", 1)
        text = linecache.getline(path, int(line))
        assert "yield" in text, (name, args)
        if args["function"] == "_stage":      # issued inside the helper: the kernel's own line is named too
            assert "copy" in text
            kpath, kline = args["kernel_source"].rsplit(":", 1)
            assert "yield from _stage" in linecache.getline(kpath, int(kline))
        else:
            assert args["function"] == "exchange" and "kernel_source" not in args
        sources.add((args["function"], text.strip()))
    assert ("exchange", "yield ctx.dma_copy(z[rows], x[rows])") in sources
    assert ("_stage", "yield ctx.copy_gm_to_ub(tile, src)") in sources
    assert ("exchange", 'yield ctx.wait_gm(flag, "eq", 2)') in sources   # the WAIT slice says which wait
    dma = [a for *_, a in xs if _[2] == "DMA"]
    assert dma and all(a["bytes"] == ROWS * COLS * 4 and a["by"].startswith("aiv") for a in dma)


def test_tracing_changes_no_modeled_number():
    on, off = run_exchange(True), run_exchange(False)
    assert (on.modeled_us, on.kernel_us, on.pipe_busy, on.servers, on.l2, on.bytes_moved, on.instructions) == \
        (off.modeled_us, off.kernel_us, off.pipe_busy, off.servers, off.l2, off.bytes_moved, off.instructions)
    assert off.trace is None


def test_untraced_servers_log_nothing():
    pod = Pod(cloudmatrix384(dies=2), trace=False)
    run = pod.launch(exchange, dies=[0, 1], aiv=2, args=_exchange_args(pod, 1))
    assert run.servers and all(s.log is None for s in pod.engine.paths.servers.values())
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    x = pod.alloc(0, (ROWS, COLS), "int32")
    pod.launch(_copy_in, aiv=1, args=(x,))
    # each run's trace holds its own intervals: the logs start empty again
    assert all(s.log == [] for s in pod.engine.paths.servers.values())


def _copy_in(ctx, x):
    tile = ctx.ub.alloc((ROWS, COLS), "int32")
    yield ctx.copy_gm_to_ub(tile, x)


def test_counters_are_deterministic(traced):
    again = run_exchange(True)
    assert again.trace.digest() == traced.trace.digest()
    assert again.trace.counters == traced.trace.counters
    no_counters = Trace(list(traced.trace.slices), list(traced.trace.flows))
    assert no_counters.digest() != traced.trace.digest()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3_000), st.integers(0, 1 << 20)), max_size=30))
def test_counter_steps_integrate_to_the_bytes(raw):
    intervals = [(a, a + d, n) for a, d, n in raw]
    steps = counter_steps(intervals)
    total = sum(n for _, _, n in intervals)
    assert integral_bytes(steps) == pytest.approx(total, rel=1e-9, abs=1e-6)
    if steps:
        assert steps[-1][1] == 0.0
        assert all(t0 < t1 for (t0, _), (t1, _) in zip(steps, steps[1:]))
        assert all(r0 != r1 for (_, r0), (_, r1) in zip(steps, steps[1:]))   # no repeated values
        assert all(r > -1e-3 for _, r in steps)
    # one transfer at a time (a FIFO server): the curve is its rate while it runs, 0 in between
    fifo, t = [], 0
    for a, d, n in raw:
        t += a
        fifo.append((t, t + d, n))
        t += d
    for t_ps, rate in counter_steps(fifo):
        live = [(a, b, n) for a, b, n in fifo if n and a <= t_ps < max(b, a + 1)]
        assert rate == pytest.approx(sum(n * 1e12 / max(b - a, 1) for a, b, n in live), rel=1e-9)


def test_followed_by_shifts_slices_flows_and_counters(traced):
    a = traced.trace
    dt = int(traced.end_us * 1e6)
    both = a.followed_by(a, dt, title="twice")
    assert both.title == "twice" and len(both.slices) == 2 * len(a.slices)
    assert both.slices[len(a.slices)][4] == a.slices[0][4] + dt
    ids = [f[0] for f in both.flows]
    assert len(ids) == 2 * len(a.flows) and len(set(ids)) == len(ids)     # flow ids stay unique
    for key, steps in both.counter_steps().items():
        assert integral_bytes(steps) == pytest.approx(2 * traced.servers[key[1]]["bytes"], rel=1e-9)
    both.check()


def test_cli_trace_file_has_the_counters(tmp_path, capsys):
    """``ascend-emu model copy --trace FILE``: a Chrome trace with the fabric ports' and memories' counters."""
    from ascend_emu.cli import main
    path = tmp_path / "copy.json"
    assert main(["model", "copy", "--bytes", "4194304", "--dst-die", "2", "--trace", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    obj = json.loads(path.read_text())
    jsonschema.validate(obj, CHROME_TRACE_SCHEMA)
    names = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e.get("name") == "process_name"}
    tracks = {(names[e["pid"]], e["name"]) for e in obj["traceEvents"] if e["ph"] == "C"}
    assert {("die 0 / bandwidth", "ub.tx0"), ("die 2 / bandwidth", "ub.rx2"), ("die 0 / bandwidth", "hbm0")} <= tracks
    assert out["trace_path"] == str(path.resolve())
    slices = [e for e in obj["traceEvents"] if e["ph"] == "X" and e["cat"] == "MTE3"]
    assert slices and all(e["args"]["function"] == "stream_copy" for e in slices)
