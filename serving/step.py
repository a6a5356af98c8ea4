"""One serving step as kernel launches on one pod: the step builder of ``EmulatedRunner``, numeric or timing-only.

A step is a few *parts*: one layer's attention for one microbatch, its MoE (or dense FFN), the head. A part is a
generator: it queues kernels through their host functions' ``stream=`` / ``after=`` arguments and yields
``(op, pendings)`` (a ``kernels.ranks.Pending`` or a list of them); the builder resumes it with the collected
results at the modeled time the last of those launches finishes (``Launch.on_done``). So the host glue between
kernels (RMSNorm, residual adds, the routing's replica mapping, argmax: torch code, the same as the reference) runs
at that point of the pod's timeline and takes no modeled time, and the part's next kernel is queued then (its
launch overhead included). A part starts once the parts it was given as ``after`` have finished and the previous
part of its lane has finished. The whole step is one ``pod.synchronize()``.

Queue-ahead parts (``add(..., ahead=True)``, the timing-only decode layer of ``serving.timing``): a part with no
host glue between its kernels needs no results, so its body is run to its end when it is added and every kernel is
queued at once, before the run: a kernel waits for the one before it on its stream (stream order) and for the
launches it is given as ``after=`` (an event wait, as a captured graph does). The dependencies on other parts
(queue-ahead ones, already queued) become those launches: the body is ``body(after)`` with ``after`` {die: the
launches of the last op on that die of each ``after`` part}. Resuming a part at each op's end instead (the mode
above) would give the same start when the next kernel is on the same stream (both start at the end plus the
launch overhead), but a kernel waiting on another stream's launch would pay the launch overhead after that
launch's end instead of having it hidden, and every resume adds host callbacks to the event queue; queue-ahead
parts keep the event order and times of a schedule queued in full before the run. Their records' ``start_us`` is
the host's time when they were queued.

Lanes: with one microbatch every die has one stream on all its cores ("attn" and "moe" name the same streams and
the parts run one after the other); with two, every die has an attention stream (the last ``attn_cores`` AICs with
their AIVs) and a MoE stream (the other AICs and their AIVs): parts of the two lanes run at once on the same die,
so their contention for HBM, L2 and ports is modeled.

Timing-only (``numeric=False``): the same parts with phantom GM tensors (``kernels.ranks.HostShape`` inputs: shape
and dtype); what the kernels do then depends only on shapes and *control data*: the values that decide which work a
kernel does and where its data goes rather than what it computes. In a step: the sequences' token counts, positions,
cache slots and block tables, the routing (expert ids per token, recorded from a numeric run:
``StepOutput.routing``), and what follows from it on the host (the replica mapping, each rank's received rows and
per-expert counts). Token values and weights are not control data (they change the outputs, not the work); MTP's
accepted drafts would be (they choose the MTP layer's rows), so timing-only steps run without MTP.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ascend_emu import HardwareProfile, Launch, Pod
from ascend_emu.errors import ArgumentError

PS_PER_US = 1_000_000


@dataclass
class OpRecord:
    """One op of a part: ``key`` the part's (layer, microbatch) or ("head", microbatch), ``lane`` where it ran
    ("attn", "moe", "head"), ``op`` its name, ``start_us`` when its launches were queued (the launch overhead
    counts in the op), ``launches`` its kernel launches, ``work`` what it must do at least on each die it ran on
    (``kernels.roofline.Work``s, for its roofline; empty when the part did not say)."""
    key: tuple
    lane: str
    op: str
    start_us: float
    launches: list
    work: list = field(default_factory=list)

    @property
    def end_us(self) -> float:
        return max((la.end_ps / PS_PER_US for la in self.launches), default=self.start_us)


@dataclass
class Part:
    """A generator of queued ops (see the module doc) and when it may start."""
    key: tuple
    lane: str
    label: str
    body: object
    after: list
    started: bool = False
    done: bool = False
    result: object = None
    records: list = field(default_factory=list)
    ahead: bool = False


class StepPod:
    """One pod for one step of ``dies`` dies: the lanes' streams, the parts and their records.

    ``microbatches`` 1 (one stream per die) or 2 (an attention and a MoE stream per die, ``attn_cores`` AICs for
    attention); ``launch_mode`` "graph" or "single-op"; ``numeric`` False for timing-only; ``trace``: record the
    pod's trace."""

    def __init__(self, profile: HardwareProfile, *, microbatches: int, attn_cores: int, launch_mode: str,
                 numeric: bool = True, trace: bool = False):
        self.pod = Pod(profile, trace=trace, launch_mode=launch_mode, max_modeled_us=None)
        self.numeric = numeric
        prof = profile
        dies = range(prof.dies)
        if microbatches == 1:
            whole = [self.pod.stream(d) for d in dies]
            self._streams = {"attn": whole, "moe": whole}
            self._aic = {"attn": prof.aic_per_die, "moe": prof.aic_per_die}
            self._chain = {"attn": "die", "moe": "die"}
        else:
            moe_aic = prof.aic_per_die - attn_cores
            per = prof.aiv_per_aic
            self._streams = {
                "attn": [self.pod.stream(d, aic=range(moe_aic, prof.aic_per_die),
                                         aiv=range(per * moe_aic, prof.aiv_per_die)) for d in dies],
                "moe": [self.pod.stream(d, aic=range(moe_aic), aiv=range(per * moe_aic)) for d in dies]}
            self._aic = {"attn": attn_cores, "moe": moe_aic}
            self._chain = {"attn": "attn", "moe": "moe"}
        self.parts: list[Part] = []
        self._last: dict = {}           # chain -> its last part
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------------- building
    def streams(self, lane: str, dies) -> list:
        """The ``lane``'s stream on each of ``dies`` (one per rank, for a host function's ``stream=``)."""
        return [self._streams[lane][d] for d in dies]

    def aic(self, lane: str) -> int:
        """AICs of one die's ``lane`` stream."""
        return self._aic[lane]

    def add(self, key: tuple, lane: str, body, *, after=(), label: str | None = None, ahead: bool = False) -> Part:
        """Add a part: ``body`` a generator (not started) queuing on ``lane``'s streams; it starts after the parts
        ``after`` and the lane's previous part. ``label``: the lane shown in records (default ``lane``).

        ``ahead=True`` (see the module doc): ``body(after)`` gives the generator, which yields ``(op, handles,
        work)`` (handles: a ``Pending``, a ``Launch`` or a list of them; ``work``: a list of
        ``kernels.roofline.Work``) and is resumed at once with None; it runs to its end now. ``after`` must be
        queue-ahead parts; the lane's previous part is not added (stream order already keeps a lane's kernels in
        order)."""
        deps = [p for p in after if p is not None]
        if ahead:
            late = [p.key for p in deps if not p.ahead]
            if late:
                raise ArgumentError(f"after: parts {late} are not queue-ahead; a queue-ahead part waits for "
                                    f"launches already queued")
            part = Part(key, lane, label or lane, None, deps, started=True, ahead=True)
            self.parts.append(part)
            self._queue_ahead(part, body)
            return part
        if any(p.ahead for p in deps):
            raise ArgumentError("after: a queue-ahead part finishes inside the run without telling the builder; "
                                "a part resumed at its ops' ends cannot wait for one")
        chain = self._chain[lane]
        if chain in self._last:
            deps.append(self._last[chain])
        part = Part(key, lane, label or lane, body, deps)
        self._last[chain] = part
        self.parts.append(part)
        return part

    def _queue_ahead(self, part: Part, body) -> None:
        after: dict = {}
        for dep in part.after:
            last: dict = {}                 # die -> the launches of the part's last op on it
            for record in reversed(dep.records):
                mine = {}
                for la in record.launches:
                    if la.dies[0] not in last:
                        mine.setdefault(la.dies[0], []).append(la)
                last.update(mine)
            for die, launches in last.items():
                after.setdefault(die, []).extend(launches)
        gen = body(after)
        while True:
            try:
                op, handles, work = gen.send(None)
            except StopIteration as stop:
                part.result = stop.value
                return
            handles = handles if isinstance(handles, (list, tuple)) else [handles]
            launches = [h for item in handles for h in ([item] if isinstance(item, Launch) else item.launches)]
            part.records.append(OpRecord(part.key, part.label, op, self.pod.now_us, launches, list(work)))

    # ------------------------------------------------------------------------------------------- running
    def run(self):
        """Start the parts that can start, run the pod until every part has finished; returns the RunResult. An
        exception raised by a part's host glue is raised here, after the run (the launches it had queued ran)."""
        self._start_ready()
        run = self.pod.synchronize()
        for part in self.parts:
            if part.ahead:                  # its launches have run: the run waits for every queued launch
                part.done = True
        if self.error is not None:
            raise self.error
        left = [p.key for p in self.parts if not p.done]
        if left:                                # cannot happen unless a dependency cycle was built
            raise RuntimeError(f"parts {left} never started: their dependencies did not finish")
        return run

    def _start_ready(self) -> None:
        if self.error is not None:
            return
        for part in self.parts:
            if not part.started and all(d.done for d in part.after):
                part.started = True
                self._advance(part, None)

    def _advance(self, part: Part, value) -> None:
        """Resume ``part`` with ``value``; queue what it yields next, or finish it."""
        try:
            item = part.body.send(value)
        except StopIteration as stop:
            part.done, part.result = True, stop.value
            self._start_ready()
            return
        except BaseException as e:          # host glue failed: stop this part, report after the run
            self.error = self.error or e
            return
        op, pendings = item
        single = not isinstance(pendings, (list, tuple))
        pendings = [pendings] if single else list(pendings)
        launches = [la for p in pendings for la in p.launches]
        part.records.append(OpRecord(part.key, part.label, op, self.pod.now_us, launches))
        waiting = {id(la) for la in launches if not la.done}

        def resume():
            try:
                results = [p.collect(None) for p in pendings]
            except BaseException as e:      # reading the outputs failed: as a glue error
                self.error = self.error or e
                return
            self._advance(part, results[0] if single else results)
        if not waiting:
            resume()
            return

        def done(launch):
            waiting.discard(id(launch))
            if not waiting:
                resume()
        for la in launches:
            if not la.done:
                la.on_done.append(done)

    # ------------------------------------------------------------------------------------------- figures
    def records(self) -> list:
        """Every op of every part, in the order the parts were added."""
        return [r for p in self.parts for r in p.records]
