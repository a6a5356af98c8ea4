"""Timeline traces of the emulator: Chrome/Perfetto JSON export, checks, digests, PNG plots.

All record times are integer picoseconds (ps). Chrome events carry ``ts``/``dur`` in
microseconds (float, ``ps / 1e6``). Imports only the standard library and numpy;
matplotlib is imported lazily inside :meth:`Trace.plot` with the Agg backend.

Besides the pipes' slices, a trace holds per-die bandwidth counters: for every shared server (``hbm{die}``,
``l2.{die}``, fabric ports ``ub.tx/rx{die}``, ``d2d.tx/rx{die}``, chip-pair links, DMA engines ``dma{die}.{n}``)
the intervals it served bytes in, exported as piecewise-constant bytes/s counter ("C") events on a
``die N / bandwidth`` process.
"""
from __future__ import annotations

import colorsys
import gc
import gzip
import hashlib
import json
import os
import re
from bisect import bisect_right, insort
from operator import itemgetter

import numpy as np

from .origin import origin_of

__all__ = ["Trace", "TRACK_ORDER", "TRACK_COLORS", "PLOT_DPI", "plot_height_in", "unit_sort_key", "track_sort_key",
           "unit_label", "track_colors", "counter_steps"]

#: Fixed thread order of the known pipes; tid = index + 1. Unknown tracks follow, sorted by name.
TRACK_ORDER = ("SCALAR", "WAIT", "MTE2", "MTE1", "CUBE", "FIXP", "VECTOR", "MTE3", "DMA")
_TRACK_RANK = {t: i for i, t in enumerate(TRACK_ORDER)}
#: Fixed plot colour per known track; unknown tracks take the next free colour of _PALETTE (see track_colors).
TRACK_COLORS = {
    "SCALAR": "#7f7f7f", "WAIT": "#c7c7c7", "MTE2": "#1f77b4", "MTE1": "#17becf",
    "CUBE": "#d62728", "FIXP": "#9467bd", "VECTOR": "#2ca02c", "MTE3": "#ff7f0e", "DMA": "#8c564b",
}
_EXTRA_COLORS = ("#e377c2", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5")
# then the rest of matplotlib's tab20; beyond that, evenly spaced hues
_PALETTE = _EXTRA_COLORS + ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#c49c94", "#f7b6d2",
                            "#7f7f7f", "#c7c7c7", "#dbdb8d", "#17becf", "#9edae5")
_UNIT_RANK = {"aic": 0, "aiv": 1, "dma": 2, "host": 3}
_UNIT_RE = re.compile(r"^(.*?)(\d+)$")
_FLOW_STUB_PS = 1000  # 1 ns anchor slice added for unbound flow endpoints
PLOT_DPI = 110
_SLICE_KEY = itemgetter(4, 5, 3)  # (start_ps, end_ps, name)
BANDWIDTH_UNIT = "bandwidth"  # the pseudo-unit (Chrome process) of a die's bandwidth counters
COUNTER_KEY = "bytes/s"       # the counters' one series (Perfetto names the track "<server> bytes/s")
_PS_PER_S = 1e12


def _split_unit(unit: str):
    m = _UNIT_RE.match(unit)
    return (m.group(1), int(m.group(2))) if m else (unit, None)


def unit_sort_key(unit: str):
    """Order units aic*, aiv*, dma*, host, then others; by numeric suffix within a kind."""
    prefix, num = _split_unit(unit)
    rank = _UNIT_RANK.get(prefix, 4)
    return (rank, prefix if rank == 4 else "", -1 if num is None else num, unit)


def track_sort_key(track: str):
    """Order known tracks as TRACK_ORDER, unknown ones after them alphabetically."""
    return (_TRACK_RANK.get(track, len(TRACK_ORDER)), track)


def unit_label(unit: str) -> str:
    """'aiv3' -> 'aiv 3', 'host' -> 'host'."""
    prefix, num = _split_unit(unit)
    return unit if num is None or not prefix else f"{prefix} {num}"


def track_colors(tracks) -> dict:
    """{track: "#rrggbb"}, a different colour for each of ``tracks``: known pipes keep TRACK_COLORS, the others
    (e.g. the serving timeline's ops) take the palette's free colours in name order."""
    colors = {t: TRACK_COLORS[t] for t in tracks if t in TRACK_COLORS}
    taken = set(colors.values())
    unknown = sorted(t for t in set(tracks) if t not in TRACK_COLORS)
    palette = [c for c in _PALETTE if c not in taken]
    extra = len(unknown) - len(palette)
    for i in range(max(0, extra)):      # golden-ratio hue steps, two lightness levels: distinct, deterministic
        r, g, b = colorsys.hls_to_rgb((i * 0.618034) % 1.0, 0.45 if i % 2 else 0.65, 0.65)
        palette.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    colors.update(zip(unknown, palette))
    return colors


def plot_height_in(n_rows: int) -> float:
    """Figure height (inches) used by :meth:`Trace.plot` for ``n_rows`` timeline rows."""
    return float(min(120.0, max(3.0, 1.6 + 0.2 * n_rows)))


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    return repr(o)


def _canon_args(args) -> str:
    return "" if args is None else json.dumps(args, sort_keys=True, default=_json_default)


def counter_steps(intervals) -> list:
    """Piecewise-constant rate of ``(start_ps, end_ps, bytes)`` intervals: ``[(time_ps, bytes_per_s), ...]``, each
    value holding until the next time; the last is 0. Overlapping intervals add up. An interval shorter than 1 ps
    (a few bytes on a fast server) is drawn 1 ps long, so the integral over time always equals the bytes."""
    deltas: dict = {}
    for a, b, n in intervals:
        if n <= 0:
            continue
        a, b = int(a), int(b)
        if b <= a:
            b = a + 1
        rate = n * _PS_PER_S / (b - a)
        da = deltas.get(a)
        deltas[a] = (rate, 1) if da is None else (da[0] + rate, da[1] + 1)
        db = deltas.get(b)
        deltas[b] = (-rate, -1) if db is None else (db[0] - rate, db[1] - 1)
    steps: list = []
    level, active = 0.0, 0
    for t in sorted(deltas):
        d_rate, d_active = deltas[t]
        active += d_active
        level = level + d_rate if active else 0.0   # idle is exactly 0, whatever rounding left over
        if not steps or steps[-1][1] != level:
            steps.append((t, level))
    return steps


def _expand_args(record: tuple) -> dict:
    """The args of a compact transfer record (see ``Trace``): the dict the scheduler would have built for it."""
    if len(record) == 8:
        return dict(record[6], bytes=record[7])
    return dict(record[6], bytes=record[7], by=record[8])


class Trace:
    """Slices and flows recorded by the scheduler (times in integer ps).

    slice: ``(die, unit, track, name, start_ps, end_ps, args)``;
    flow:  ``(flow_id, (die, unit, track, time_ps), (die, unit, track, time_ps), name)``;
    counters: ``{(die, server name): [(start_ps, end_ps, bytes), ...]}``, the bytes a shared server moved.
    A slice's args name the ``kernel``, the ``function`` and the ``source`` ("file:line") that issued it.

    ``records`` is the list the scheduler appends to. A transfer's slice goes in compact, without its own args dict:
    ``(die, unit, track, name, start_ps, end_ps, origin, bytes)``, or ``(..., origin, bytes, by)`` for a DMA
    engine's, ``origin`` the issuing site's shared args. ``slices`` turns the compact ones into the slice form (args
    ``dict(origin, bytes=bytes[, by=by])``) in place the first time it is read after they were added, so every reader
    and export sees what the scheduler would have built per transfer, and a traced run does not pay a dict per
    transfer (nor hold one per transfer until the trace is read).
    """

    def __init__(self, slices: list | None = None, flows: list | None = None,
                 clock_ghz: float = 1.8, title: str = "ascend-emu", counters: dict | None = None):
        self.records = [] if slices is None else slices
        self._plain = 0             # records before this index are in the slice form
        self.flows = [] if flows is None else flows
        self.counters = {} if counters is None else counters
        self.clock_ghz = clock_ghz
        self.title = title
        self._origins: dict = {}

    # -- recording (hot path: plain appends) ------------------------------------------
    @property
    def slices(self) -> list:
        """Every slice as ``(die, unit, track, name, start_ps, end_ps, args)`` (compact records expanded in place)."""
        raw = self.records
        n = len(raw)
        if self._plain < n:
            for i in range(self._plain, n):
                s = raw[i]
                if len(s) != 7:
                    raw[i] = s[:6] + (_expand_args(s),)
            self._plain = n
        return raw

    @slices.setter
    def slices(self, slices: list) -> None:
        self.records = slices
        self._plain = 0

    def add_slice(self, die, unit, track, name, start_ps, end_ps, args=None) -> None:
        """Record a busy interval [start_ps, end_ps] on (die, unit, track)."""
        self.records.append((die, unit, track, name, start_ps, end_ps, args))

    def add_flow(self, flow_id, src, dst, name="flag") -> None:
        """Record an arrow from src=(die, unit, track, ps) to dst=(die, unit, track, ps)."""
        self.flows.append((flow_id, src, dst, name))

    def add_counter(self, die, name, intervals) -> None:
        """Record that server ``name`` of ``die`` moved ``bytes`` in each ``(start_ps, end_ps, bytes)`` interval."""
        self.counters.setdefault((die, name), []).extend(intervals)

    def origin(self, gen, kernel: str) -> dict:
        """Args naming where a kernel generator ``gen`` (suspended at a yield) issued its instruction
        (``origin.origin_of``): one shared dict per site, cheap enough to take for every instruction of a traced run."""
        return origin_of(self._origins, gen, kernel)

    def __len__(self) -> int:
        return len(self.records)

    def followed_by(self, other: Trace, offset_ps: int, title: str | None = None) -> Trace:
        """A new trace with this one's records and ``other``'s moved ``offset_ps`` later (runs of separate pods on
        one timeline). Flow ids of ``other`` are shifted past this trace's so they stay unique."""
        dt = int(offset_ps)
        fid = max((f[0] for f in self.flows), default=0)
        slices = self.slices + [(d, u, t, n, s + dt, e + dt, a) for d, u, t, n, s, e, a in other.slices]
        flows = self.flows + [(i + fid, (a[0], a[1], a[2], a[3] + dt), (b[0], b[1], b[2], b[3] + dt), n)
                              for i, a, b, n in other.flows]
        counters = {k: list(v) for k, v in self.counters.items()}
        for k, v in other.counters.items():
            counters.setdefault(k, []).extend((a + dt, b + dt, n) for a, b, n in v)
        return Trace(slices, flows, self.clock_ghz, self.title if title is None else title, counters)

    def __repr__(self) -> str:
        return (f"Trace({self.title!r}, {len(self.slices)} slices, {len(self.flows)} flows, "
                f"{len(self.counters)} counters)")

    def counter_steps(self) -> dict:
        """{(die, server name): [(time_ps, bytes_per_s), ...]}: each counter as its piecewise-constant rate."""
        return {k: counter_steps(v) for k, v in sorted(self.counters.items())}

    # -- layout ---------------------------------------------------------------------
    def _layout(self):
        """Return ({(die, unit): pid}, {track: tid}) for every process/thread referenced."""
        units, tracks = set(), set()
        for s in self.slices:
            units.add((s[0], s[1]))
            tracks.add(s[2])
        for die, _ in self.counters:
            units.add((die, BANDWIDTH_UNIT))
        for f in self.flows:
            for ep in (f[1], f[2]):
                units.add((ep[0], ep[1]))
                tracks.add(ep[2])
        ordered = sorted(units, key=lambda du: (du[0], unit_sort_key(du[1])))
        per_die: dict = {}
        for d, _ in ordered:
            per_die[d] = per_die.get(d, 0) + 1
        stride = 1000
        while per_die and max(per_die.values()) >= stride:
            stride *= 10
        pids, idx = {}, {}
        for d, u in ordered:
            idx[d] = idx.get(d, 0) + 1
            pids[(d, u)] = int(d) * stride + idx[d]  # +1 keeps pid 0 (swapper) unused
        unknown = sorted(t for t in tracks if t not in _TRACK_RANK)
        tids = {t: i + 1 for i, t in enumerate(TRACK_ORDER)}
        tids.update({t: len(TRACK_ORDER) + 1 + i for i, t in enumerate(unknown)})
        return pids, {t: tids[t] for t in tracks}

    def _by_track(self) -> dict:
        """{(die, unit, track): [slice, ...]} each list sorted by (start_ps, end_ps, name)."""
        groups: dict = {}
        for s in self.slices:
            k = (s[0], s[1], s[2])
            g = groups.get(k)
            if g is None:
                groups[k] = g = []
            g.append(s)
        for g in groups.values():
            g.sort(key=_SLICE_KEY)
        return groups

    # -- export -----------------------------------------------------------------------
    def to_chrome(self) -> dict:
        """Chrome trace-event object; ts/dur in microseconds, keys ordered for MindStudio.
        Events are sorted by (pid, tid, ts), metadata first."""
        gc_was_on = gc.isenabled()
        gc.disable()  # millions of small dicts: generational GC passes would dominate
        try:
            return self._to_chrome()
        finally:
            if gc_was_on:
                gc.enable()

    def _to_chrome(self) -> dict:
        pids, tids = self._layout()
        groups = self._by_track()
        extra = self._flow_events(pids, tids, groups) if self.flows else {}
        threads: dict = {}  # (die, unit) -> set of tracks
        for d, u, t in list(groups) + list(extra):
            threads.setdefault((d, u), set()).add(t)
        counters: dict = {}  # die -> [(server name, steps)]
        for (d, name), steps in self.counter_steps().items():
            counters.setdefault(d, []).append((name, steps))
        events = []
        append = events.append
        for (d, u), pid in sorted(pids.items(), key=itemgetter(1)):
            append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": f"die {d} / {unit_label(u)}"}})
            append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            if u == BANDWIDTH_UNIT:
                for name, steps in counters.get(d, ()):
                    for t_ps, rate in steps:
                        append({"name": name, "cat": BANDWIDTH_UNIT, "ph": "C", "ts": t_ps / 1e6, "pid": pid,
                                "args": {COUNTER_KEY: rate}})
            for t in sorted(threads.get((d, u), ()), key=tids.__getitem__):
                tid = tids[t]
                append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": t}})
                append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
                xs = []
                for _, _, _, name, st, en, args in groups.get((d, u, t), ()):
                    st, en = int(st), int(en)
                    ev = {"name": name, "cat": t, "ph": "X", "ts": st / 1e6, "dur": (en - st) / 1e6,
                          "pid": pid, "tid": tid}
                    if args is not None:
                        ev["args"] = args
                    xs.append(ev)
                more = extra.get((d, u, t))
                if more:  # merge the few flow events in by (ts, X < s < f, ...)
                    keyed = [((int(s_[4]), 1, int(s_[5]), str(s_[3])), ev) for s_, ev in
                             zip(groups.get((d, u, t), ()), xs)]
                    keyed.extend(more)
                    keyed.sort(key=itemgetter(0))
                    xs = [ev for _, ev in keyed]
                events.extend(xs)
        return {
            "profilingType": "op",
            "displayTimeUnit": "ns",
            "traceEvents": events,
            "otherData": {"clock_ghz": self.clock_ghz, "title": self.title, "time_unit": "us"},
        }

    def _flow_events(self, pids, tids, groups) -> dict:
        """{(die, unit, track): [(sort key, event)]}: s/f flow events, plus a 1 ns anchor X
        slice where no slice encloses an endpoint and the anchor overlaps nothing."""
        spans = {k: [(int(s[4]), int(s[5])) for s in g] for k, g in groups.items()}
        out: dict = {}
        for fid, src, dst, name in self.flows:
            for ep, ph, rank in ((src, "s", 2), (dst, "f", 3)):
                k = (ep[0], ep[1], ep[2])
                at, pid, tid, t = int(ep[3]), pids[(ep[0], ep[1])], tids[ep[2]], ep[2]
                iv = spans.setdefault(k, [])
                lst = out.setdefault(k, [])
                i = bisect_right(iv, (at, float("inf")))
                enclosed = i > 0 and iv[i - 1][1] >= at
                if not enclosed and not (i < len(iv) and iv[i][0] < at + _FLOW_STUB_PS):
                    insort(iv, (at, at + _FLOW_STUB_PS))
                    lst.append(((at, 1, at + _FLOW_STUB_PS, str(name)),
                                {"name": name, "cat": t, "ph": "X", "ts": at / 1e6, "dur": _FLOW_STUB_PS / 1e6,
                                 "pid": pid, "tid": tid, "args": {"flow_id": fid}}))
                ev = {"name": name, "cat": "flag", "ph": ph, "id": fid, "ts": at / 1e6, "pid": pid, "tid": tid}
                if ph == "f":
                    ev["bp"] = "e"
                lst.append(((at, rank, fid, str(name)), ev))
        return out

    def save(self, path) -> str:
        """Write the Chrome JSON (gzip if path ends in .gz); returns str(path)."""
        path = str(path)
        obj = self.to_chrome()
        events = obj["traceEvents"]
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        opener = gzip.open if path.endswith(".gz") else open
        dumps = json.dumps
        with opener(path, "wt", encoding="utf-8") as fh:
            fh.write('{"profilingType": %s, "displayTimeUnit": %s, "traceEvents": ['
                     % (dumps(obj["profilingType"]), dumps(obj["displayTimeUnit"])))
            chunk = 20000
            for i in range(0, len(events), chunk):  # C encoder on chunks, not json.dump's Python one
                if i:
                    fh.write(",\n")
                fh.write(dumps(events[i:i + chunk], separators=(",", ":"), default=_json_default)[1:-1])
            fh.write('],\n"otherData": %s}\n' % dumps(obj["otherData"], default=_json_default))
        return path

    # -- analysis -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise ValueError if a slice ends before it starts or two slices overlap on a track.
        Touching slices (end_ps == next start_ps) are fine."""
        for s in self.slices:
            if s[5] < s[4]:
                raise ValueError(f"slice ends before it starts on track {s[:3]}: {s}")
        for k, g in self._by_track().items():
            last = g[0]
            for s in g[1:]:
                if s[4] < last[5]:
                    raise ValueError(f"overlapping slices on track die={k[0]} unit={k[1]} track={k[2]}: "
                                     f"{last} and {s}")
                if s[5] > last[5]:
                    last = s

    def digest(self) -> str:
        """sha256 hex of the sorted canonical records (independent of insertion order;
        title and clock are not included)."""
        sl = sorted(repr((int(d), str(u), str(t), str(n), int(s), int(e), _canon_args(a)))
                    for d, u, t, n, s, e, a in self.slices)
        fl = sorted(repr((int(i), (int(a[0]), str(a[1]), str(a[2]), int(a[3])),
                          (int(b[0]), str(b[1]), str(b[2]), int(b[3])), str(n)))
                    for i, a, b, n in self.flows)
        h = hashlib.sha256()
        h.update(b"slices\n")
        h.update("\n".join(sl).encode())
        h.update(b"\nflows\n")
        h.update("\n".join(fl).encode())
        if self.counters:       # only when present: a trace without counters keeps its digest
            h.update(b"\ncounters\n")
            for (d, name), iv in sorted(self.counters.items()):
                h.update(repr((int(d), str(name), sorted((int(a), int(b), int(n)) for a, b, n in iv))).encode())
        return h.hexdigest()

    def busy_ps(self) -> dict:
        """{(die, unit, track): ps covered by the union of its slices} for every track,
        WAIT included (callers filter)."""
        out = {}
        for k, g in self._by_track().items():
            total, cs, ce = 0, int(g[0][4]), int(g[0][5])
            for s in g[1:]:
                a, b = int(s[4]), int(s[5])
                if a <= ce:
                    if b > ce:
                        ce = b
                else:
                    total += ce - cs
                    cs, ce = a, b
            out[k] = total + ce - cs
        return out

    # -- plot -----------------------------------------------------------------------
    def plot(self, path, max_units: int = 24, width_in: float = 14.0) -> str:
        """PNG timeline (x in us), one row per (die, unit, track) of the ``max_units``
        busiest units (non-WAIT busy ps), a colour per track (track_colors), the legend right of
        the axes. Figure is width_in x plot_height_in(rows) inches at PLOT_DPI. Returns str(path)."""
        import matplotlib.pyplot as plt

        path = str(path)
        fig = self.figure(max_units, width_in)
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            fig.savefig(path, dpi=PLOT_DPI, format="png")
        finally:
            plt.close(fig)
        return path

    def figure(self, max_units: int = 24, width_in: float = 14.0):
        """The matplotlib Figure :meth:`plot` saves (Agg backend; close it with ``plt.close``)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.collections import LineCollection, PolyCollection
        from matplotlib.patches import Patch

        groups = self._by_track()
        unit_busy: dict = {}
        for (d, u, t), b in self.busy_ps().items():
            unit_busy[(d, u)] = unit_busy.get((d, u), 0) + (0 if t == "WAIT" else b)
        canon = lambda du: (du[0], unit_sort_key(du[1]))  # noqa: E731
        shown = sorted(unit_busy, key=lambda du: (-unit_busy[du], canon(du)))[:max(0, max_units)]
        hidden = len(unit_busy) - len(shown)
        shown_set = set(shown)
        rows = sorted((k for k in groups if (k[0], k[1]) in shown_set),
                      key=lambda k: (k[0], unit_sort_key(k[1]), track_sort_key(k[2])))
        row_of = {k: i for i, k in enumerate(rows)}
        colors = track_colors({k[2] for k in rows})

        fig, ax = plt.subplots(figsize=(width_in, plot_height_in(len(rows))), dpi=PLOT_DPI)
        try:
            title = f"{self.title}: {len(self.slices)} slices, {len(shown)} units"
            if hidden > 0:
                title += f" (+{hidden} more units)"
            ax.set_title(title, fontsize=10, loc="left")
            ax.set_xlabel("time (us)")
            if not rows:
                ax.text(0.5, 0.5, "no slices", ha="center", va="center", transform=ax.transAxes)
                ax.set_yticks([])
            else:
                lo = min(int(g[0][4]) for k, g in groups.items() if k in row_of) / 1e6
                hi = max(max(int(s[5]) for s in groups[k]) for k in rows) / 1e6
                span = max(hi - lo, 1e-6)
                tol = span / (width_in * PLOT_DPI)  # ~one pixel in us: merge/widen below it
                verts_by_track: dict = {}
                for k in rows:
                    arr = np.array([(s[4], s[5]) for s in groups[k]], dtype=np.float64) / 1e6
                    st, en = arr[:, 0], np.maximum.accumulate(arr[:, 1])
                    brk = np.flatnonzero(st[1:] > en[:-1] + tol) + 1
                    first = np.concatenate(([0], brk))
                    last = np.concatenate((brk - 1, [len(st) - 1]))
                    x0, x1 = st[first], en[last]
                    x1 = np.maximum(x1, x0 + tol * 0.5)
                    y0, y1 = row_of[k] - 0.4, row_of[k] + 0.4
                    v = np.empty((len(x0), 4, 2))
                    v[:, 0, 0] = v[:, 1, 0] = x0
                    v[:, 2, 0] = v[:, 3, 0] = x1
                    v[:, 0, 1] = v[:, 3, 1] = y0
                    v[:, 1, 1] = v[:, 2, 1] = y1
                    verts_by_track.setdefault(k[2], []).append(v)
                for t in sorted(verts_by_track, key=track_sort_key):
                    ax.add_collection(PolyCollection(np.concatenate(verts_by_track[t]), facecolors=colors[t],
                                                     linewidths=0, antialiaseds=False))
                segs = []
                for _, a, b, _ in self.flows:
                    ka, kb = tuple(a[:3]), tuple(b[:3])
                    if ka in row_of and kb in row_of:
                        segs.append(((a[3] / 1e6, row_of[ka]), (b[3] / 1e6, row_of[kb])))
                if segs:
                    ax.add_collection(LineCollection(segs, colors="black", linewidths=0.4, alpha=0.5))
                ax.set_xlim(lo - 0.01 * span, hi + 0.01 * span)
                ax.set_ylim(len(rows) - 0.5, -0.5)
                ax.set_yticks(range(len(rows)))
                ax.set_yticklabels([f"d{d} {u} {t}" for d, u, t in rows], fontsize=7)
                present = sorted({k[2] for k in rows}, key=track_sort_key)
                # right of the axes, clear of the title: one column per ~legend-height of entries
                per_col = max(1, int((fig.get_figheight() - 1.1) * 72 / 12))
                legend = ax.legend(handles=[Patch(color=colors[t], label=t) for t in present], loc="upper left",
                                   bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False, borderaxespad=0,
                                   ncol=-(-len(present) // per_col))
                ax.grid(axis="x", linewidth=0.3, alpha=0.5)
            right = 0.99
            if rows:
                legend_in = legend.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi
                right = max(0.5, 0.99 - (legend_in + 0.1) / width_in)
            fig.subplots_adjust(left=0.1, right=right, top=1 - 0.5 / fig.get_figheight(),
                                bottom=0.6 / fig.get_figheight())
        except BaseException:
            plt.close(fig)
            raise
        return fig
