"""Tests for ascend_emu.trace (times in ps; Chrome ts/dur in us)."""
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_emu.trace import PLOT_DPI, TRACK_COLORS, TRACK_ORDER, Trace, plot_height_in

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def small_trace() -> Trace:
    t = Trace(clock_ghz=1.65, title="tiny")
    # deliberately added out of order
    t.add_slice(1, "aiv0", "VECTOR", "exp", 2_000, 2_500)
    t.add_slice(0, "aiv3", "MTE2", "copy_in", 1_000, 5_000, {"bytes": 4096})
    t.add_slice(0, "aiv3", "VECTOR", "add", 5_000, 9_000)
    t.add_slice(0, "aiv3", "MTE2", "copy_in2", 5_000, 6_500)
    t.add_slice(0, "aic0", "CUBE", "mm", 0, 20_000)
    t.add_slice(0, "aic0", "FIXP", "fixpipe", 20_000, 21_234)
    t.add_slice(0, "aiv3", "WAIT", "wait_flag", 9_000, 21_000)
    t.add_slice(1, "aic1", "MTE1", "l1_to_l0", 123_456_789, 123_460_000)
    t.add_slice(0, "aiv3", "MYPIPE", "custom", 0, 10)
    # src at the edge of "fixpipe", dst at the edge of "wait_flag": both bound, no anchors
    t.add_flow(42, (0, "aic0", "FIXP", 21_234 - 234), (0, "aiv3", "WAIT", 21_000), "flag")
    return t


def layout(obj):
    """({pid: process_name}, {(pid, tid): thread_name}) from metadata events."""
    procs, threads = {}, {}
    for e in obj["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


def test_round_trip(tmp_path):
    t = small_trace()
    path = t.save(tmp_path / "sub" / "trace.json")
    assert isinstance(path, str)
    text = open(path).read()
    assert text.index('"profilingType"') < text.index('"traceEvents"') < text.index('"otherData"')
    obj = json.loads(text)
    assert list(obj) == ["profilingType", "displayTimeUnit", "traceEvents", "otherData"]
    assert obj["profilingType"] == "op" and obj["displayTimeUnit"] == "ns"
    assert obj["otherData"] == {"clock_ghz": 1.65, "title": "tiny", "time_unit": "us"}
    assert obj == json.loads(json.dumps(t.to_chrome()))

    procs, threads = layout(obj)
    assert sorted(procs.values()) == ["die 0 / aic 0", "die 0 / aiv 3", "die 1 / aic 1", "die 1 / aiv 0"]
    pid = {name: p for p, name in procs.items()}
    # aic before aiv within a die, die 0 before die 1, pids unique and non-zero
    assert 0 < pid["die 0 / aic 0"] < pid["die 0 / aiv 3"] < pid["die 1 / aic 1"] < pid["die 1 / aiv 0"]
    assert pid["die 1 / aic 1"] // 1000 == 1 and pid["die 0 / aiv 3"] // 1000 == 0
    # tids follow the fixed order, unknown tracks after it; same track -> same tid everywhere
    tid = {}
    for (p, ti), name in threads.items():
        assert tid.setdefault(name, ti) == ti
    assert [tid[k] for k in ("WAIT", "MTE2", "MTE1", "CUBE", "FIXP", "VECTOR")] == [2, 3, 4, 5, 6, 7]
    assert tid["MYPIPE"] > tid["VECTOR"] and tid["MYPIPE"] > len(TRACK_ORDER)
    sort_idx = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in obj["traceEvents"]
                if e["name"] == "thread_sort_index"}
    assert all(sort_idx[k] == k[1] for k in threads)
    psort = {e["pid"]: e["args"]["sort_index"] for e in obj["traceEvents"] if e["name"] == "process_sort_index"}
    assert set(psort) == set(procs)

    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(t) == 9  # both flow endpoints are bound: no anchor slices
    by_name = {e["name"]: e for e in xs}
    for d, u, track, name, s, e_, args in t.slices:
        ev = by_name[name]
        assert ev["ts"] == s / 1e6 and ev["dur"] == (e_ - s) / 1e6
        assert ev["cat"] == track
        assert procs[ev["pid"]] == f"die {d} / {u[:3]} {u[3:]}"
        assert threads[(ev["pid"], ev["tid"])] == track
        assert ev.get("args") == args
    assert by_name["l1_to_l0"]["ts"] == 123.456789 and by_name["fixpipe"]["dur"] == pytest.approx(0.001234)

    flows = [e for e in obj["traceEvents"] if e["ph"] in "sf"]
    assert [e["ph"] for e in flows] == ["s", "f"]
    s_ev, f_ev = flows
    assert s_ev["id"] == f_ev["id"] == 42 and s_ev["cat"] == f_ev["cat"] == "flag"
    assert (s_ev["pid"], s_ev["tid"]) == (pid["die 0 / aic 0"], tid["FIXP"]) and s_ev["ts"] == 0.021
    assert (f_ev["pid"], f_ev["tid"]) == (pid["die 0 / aiv 3"], tid["WAIT"]) and f_ev["ts"] == 0.021
    assert f_ev["bp"] == "e" and "bp" not in s_ev

    # events sorted by (pid, tid, ts), metadata first in each thread
    keys = [(e["pid"], e["tid"], e.get("ts", -1.0)) for e in obj["traceEvents"]]
    assert keys == sorted(keys)
    assert [e["name"] for e in obj["traceEvents"] if e["ph"] == "X" and e["pid"] == pid["die 0 / aiv 3"]
            and e["tid"] == tid["MTE2"]] == ["copy_in", "copy_in2"]


def test_process_order_and_pids():
    t = Trace()
    units = ["zz1", "host", "aiv10", "dma0", "aiv9", "aic23", "aic2", "dma1", "aic10", "bar"]
    for i, u in enumerate(units):
        t.add_slice(3, u, "SCALAR", "s", i, i + 1)
        t.add_slice(0, u, "SCALAR", "s", i, i + 1)
    procs, _ = layout(t.to_chrome())
    names = [procs[p] for p in sorted(procs)]
    want = ["aic 2", "aic 10", "aic 23", "aiv 9", "aiv 10", "dma 0", "dma 1", "host", "bar", "zz 1"]
    assert names == [f"die 0 / {u}" for u in want] + [f"die 3 / {u}" for u in want]
    assert sorted(procs)[:3] == [1, 2, 3] and sorted(procs)[10:13] == [3001, 3002, 3003]
    assert layout(t.to_chrome())[0] == procs  # stable


def test_save_gzip_and_deterministic_output(tmp_path):
    import gzip
    t = small_trace()
    a = open(t.save(tmp_path / "a.json")).read()
    rev = Trace(list(reversed(t.slices)), list(t.flows), clock_ghz=1.65, title="tiny")
    assert open(rev.save(tmp_path / "b.json")).read() == a
    with gzip.open(t.save(tmp_path / "c.json.gz"), "rt") as fh:
        assert fh.read() == a


def test_flow_anchor_slices():
    t = Trace()
    t.add_slice(0, "aiv0", "SCALAR", "set_flag", 0, 100)
    t.add_slice(0, "aiv1", "WAIT", "busy", 5_000, 8_000)
    t.add_slice(0, "aiv1", "MTE2", "blocker", 1_500, 9_000)
    # src: free spot after a slice -> 1 ns anchor; dst: 500 ps before a slice -> anchor would overlap
    t.add_flow(1, (0, "aiv0", "SCALAR", 2_000), (0, "aiv1", "WAIT", 4_500))
    # endpoint in an empty track: anchor added; a second flow at the same spot reuses it
    t.add_flow(2, (0, "aiv0", "SCALAR", 50), (0, "aiv1", "MTE3", 700), "f2")
    t.add_flow(3, (0, "aiv0", "SCALAR", 60), (0, "aiv1", "MTE3", 1_200), "f3")
    # endpoint inside an existing slice -> no anchor
    t.add_flow(4, (0, "aiv0", "SCALAR", 100), (0, "aiv1", "MTE2", 1_500), "f4")
    evs = t.to_chrome()["traceEvents"]
    procs, threads = layout({"traceEvents": evs})
    anchors = sorted((procs[e["pid"]], threads[(e["pid"], e["tid"])], e["ts"], e["dur"], e["name"])
                     for e in evs if e["ph"] == "X" and "flow_id" in e.get("args", {}))
    assert anchors == [("die 0 / aiv 0", "SCALAR", 0.002, 0.001, "flag"),
                       ("die 0 / aiv 1", "MTE3", 0.0007, 0.001, "f2")]
    assert sum(e["ph"] == "s" for e in evs) == sum(e["ph"] == "f" for e in evs) == 4
    keys = [(e["pid"], e["tid"], e.get("ts", -1.0)) for e in evs]
    assert keys == sorted(keys)
    scalar = [(e["ph"], e["ts"]) for e in evs if e["ph"] != "M" and threads[(e["pid"], e["tid"])] == "SCALAR"]
    assert scalar == [("X", 0.0), ("s", 5e-05), ("s", 6e-05), ("s", 0.0001), ("X", 0.002), ("s", 0.002)]
    # the anchors never create overlaps: feed the X events back and check
    back = Trace()
    for e in evs:
        if e["ph"] == "X":
            back.add_slice(e["pid"], "u", str(e["tid"]), e["name"], round(e["ts"] * 1e6),
                           round((e["ts"] + e["dur"]) * 1e6))
    back.check()


def test_check_overlap_and_touching():
    t = Trace()
    t.add_slice(0, "aiv0", "MTE2", "a", 0, 100)
    t.add_slice(0, "aiv0", "MTE2", "b", 100, 200)  # touching: fine
    t.add_slice(0, "aiv0", "MTE3", "c", 50, 150)  # other track: fine
    t.add_slice(0, "aiv0", "MTE2", "z", 200, 200)  # zero length at the edge: fine
    t.check()
    t.add_slice(0, "aiv0", "MTE2", "d", 150, 160)  # inside "b"
    with pytest.raises(ValueError, match="MTE2") as ei:
        t.check()
    assert "'b'" in str(ei.value) and "'d'" in str(ei.value)

    t2 = Trace()
    t2.add_slice(0, "aic0", "CUBE", "long", 0, 1000)
    t2.add_slice(0, "aic0", "CUBE", "late", 500, 600)
    with pytest.raises(ValueError, match="CUBE.*'long'.*'late'"):
        t2.check()

    t3 = Trace()
    t3.add_slice(1, "host", "DMA", "neg", 10, 5)
    with pytest.raises(ValueError, match="DMA"):
        t3.check()


def test_digest():
    t = small_trace()
    d = t.digest()
    assert len(d) == 64 and int(d, 16) >= 0
    shuffled = list(t.slices)
    random.Random(3).shuffle(shuffled)
    t2 = Trace(shuffled, list(t.flows), title="other title")
    assert t2.digest() == d
    # args dict key order does not matter; numpy ints equal python ints
    t3 = Trace([s if s[3] != "copy_in" else s[:6] + ({"bytes": 4096},) for s in t.slices], list(t.flows))
    assert t3.digest() == d
    t4 = Trace([s[:4] + (np.int64(s[4]), np.int64(s[5]), s[6]) for s in t.slices], list(t.flows))
    assert t4.digest() == d
    moved = [s if s[3] != "add" else s[:5] + (s[5] + 1, s[6]) for s in t.slices]
    assert Trace(moved, list(t.flows)).digest() != d
    assert Trace(list(t.slices), []).digest() != d
    assert Trace([s if s[3] != "copy_in" else s[:6] + ({"bytes": 4097},) for s in t.slices],
                 list(t.flows)).digest() != d


def test_busy_ps():
    t = Trace()
    for s, e in [(0, 10), (5, 20), (20, 30), (40, 50), (45, 46), (60, 60), (100, 150)]:
        t.add_slice(0, "aiv0", "MTE2", "x", s, e)  # overlapping + adjacent + nested + empty
    for s, e in [(300, 400), (0, 100)]:
        t.add_slice(0, "aiv0", "WAIT", "w", s, e)
    t.add_slice(1, "aiv0", "MTE2", "z", 7, 7)
    assert t.busy_ps() == {(0, "aiv0", "MTE2"): 30 + 10 + 50, (0, "aiv0", "WAIT"): 200, (1, "aiv0", "MTE2"): 0}


def mpimg_read(path):
    import matplotlib.image as mpimg
    return mpimg.imread(path)


def _png_shape(path):
    import matplotlib.image as mpimg
    with open(path, "rb") as fh:
        assert fh.read(8) == PNG_MAGIC
    return mpimg.imread(path).shape


def test_plot(tmp_path):
    t = small_trace()
    p = t.plot(tmp_path / "t.png")
    assert isinstance(p, str)
    rows = len({s[:3] for s in t.slices})
    h, w, _ = _png_shape(p)
    assert (h, w) == (round(plot_height_in(rows) * PLOT_DPI), round(14.0 * PLOT_DPI))

    many = Trace()
    rnd = random.Random(1)
    for u in range(30):
        for track in ("MTE2", "VECTOR"):
            at = 0
            for _ in range(20):
                d = rnd.randrange(1, 1000) * (u + 1)
                many.add_slice(0, f"aiv{u}", track, "op", at, at + d)
                at += d + rnd.randrange(0, 500)
    p = many.plot(tmp_path / "many.png", max_units=5, width_in=8.0)
    h, w, _ = _png_shape(p)
    assert (h, w) == (round(plot_height_in(5 * 2) * PLOT_DPI), round(8.0 * PLOT_DPI))
    # the bars are drawn in the track colours (the legend swatch alone is < 200 px)
    import matplotlib.colors as mcolors
    img = mpimg_read(p)[..., :3]
    for track in ("MTE2", "VECTOR"):
        rgb = np.array(mcolors.to_rgb(TRACK_COLORS[track]))
        assert (np.abs(img - rgb).max(axis=-1) < 0.02).sum() > 5000

    h, w, _ = _png_shape(Trace().plot(tmp_path / "empty.png", width_in=5.0))
    assert w == round(5.0 * PLOT_DPI) and h > 0


@st.composite
def track_slices(draw):
    """Random non-overlapping (possibly touching / zero-length) slices on a few tracks."""
    tracks = draw(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["aic0", "aiv1", "aiv12", "host", "dma0"]),
                                     st.sampled_from(list(TRACK_ORDER) + ["ZZZ", "AAA"])),
                           min_size=1, max_size=6, unique=True))
    out = []
    for d, u, tr in tracks:
        at = draw(st.integers(0, 10**9))
        for gap, dur in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**7)), max_size=8)):
            at += gap
            out.append((d, u, tr, f"op{len(out)}", at, at + dur, {"i": len(out)} if len(out) % 2 else None))
            at += dur
    order = draw(st.permutations(range(len(out))))
    return [out[i] for i in order]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(track_slices())
def test_random_traces_round_trip(slices):
    t = Trace(list(slices))
    t.check()
    obj = json.loads(json.dumps(t.to_chrome()))
    procs, threads = layout(obj)
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    got = sorted((procs[e["pid"]], threads[(e["pid"], e["tid"])], e["name"], e["ts"], e["dur"],
                  json.dumps(e.get("args"))) for e in xs)

    def label(d, u):
        return f"die {d} / {u}" if u == "host" else f"die {d} / {u[:3]} {u[3:]}"

    want = sorted((label(d, u), tr, n, s / 1e6, (e - s) / 1e6, json.dumps(a)) for d, u, tr, n, s, e, a in slices)
    assert got == want
    start = {s[3]: s[4] for s in slices}
    assert all(round(e["ts"] * 1e6) == start[e["name"]] for e in xs)
    keys = [(e["pid"], e["tid"], e.get("ts", -1.0)) for e in obj["traceEvents"]]
    assert keys == sorted(keys)
    busy = t.busy_ps()
    for k, v in busy.items():
        assert v == sum(e - s for d, u, tr, n, s, e, a in slices if (d, u, tr) == k)  # disjoint -> plain sum


def test_track_colors_are_distinct():
    """Known pipes keep their colours; every other track gets one no other track of the plot has."""
    from ascend_emu.trace import track_colors
    names = [f"op{i:02d}" for i in range(40)]
    for tracks in (names, list(TRACK_ORDER) + names, ["MYPIPE", "CUBE"], list(TRACK_ORDER)):
        colors = track_colors(tracks)
        assert set(colors) == set(tracks)
        assert len(set(colors.values())) == len(tracks)
        assert all(colors[t] == TRACK_COLORS[t] for t in tracks if t in TRACK_COLORS)
        assert track_colors(list(reversed(tracks))) == colors          # by name, not by order of appearance
    assert track_colors(["MYPIPE", "CUBE"])["MYPIPE"] == "#e377c2"


def legend_and_title(fig):
    """(legend, title, axes) extents in display pixels of a figure made by Trace.figure."""
    ax = fig.axes[0]
    r = fig.canvas.get_renderer()
    return ax.get_legend().get_window_extent(r), ax.title.get_window_extent(r), ax.get_window_extent(r)


@pytest.mark.parametrize("n_tracks, n_units", [(1, 1), (9, 2), (13, 3), (40, 2)])
def test_plot_legend_is_clear_of_the_title_and_the_bars(n_tracks, n_units):
    import matplotlib.pyplot as plt
    t = Trace(title="a long title that runs far to the right of the axes, where the legend used to sit " * 2)
    for i in range(n_tracks):
        t.add_slice(0, f"aiv{i % n_units}", f"op{i}", "x", i * 1000, i * 1000 + 700)
    fig = t.figure(width_in=10.0)
    try:
        legend, title, axes = legend_and_title(fig)
        width, height = fig.bbox.width, fig.bbox.height
        assert not legend.overlaps(title) and not legend.overlaps(axes)
        assert 0 <= legend.x0 and legend.x1 <= width and 0 <= legend.y0 and legend.y1 <= height
        assert len(fig.axes[0].get_legend().get_texts()) == n_tracks
    finally:
        plt.close(fig)
