"""Seeded jitter: perturb the latencies of a run so that different seeds explore different interleavings.

``Pod(..., jitter_seed=N, jitter=0.3)`` moves every fabric and memory latency of a transfer (the route's link
latency plus its L2 / HBM load-to-use; a transfer staged between dies, staging.py: its memory latency only, its
fabric hops are messages that keep the profile's latency), every flag, poll and atomic latency and every launch
overhead by up to +-30 % of its profile value, drawn afresh for each transfer, access or launch. A protocol whose
result depends on which of two unordered events comes first then gives different results under different seeds,
while a correct protocol gives the same numbers under all of them (``ascend_emu.explore`` runs a scenario over many
seeds and compares).

Deterministic: each home of events (a die, the host: DESIGN.md 10) draws from a generator of its own, seeded with
``N`` and the home, in the order of that home's events, which the scheduler fixes whatever else runs and however the
dies are split over worker processes; so the same seed gives the same run (numbers, modeled times, trace) every
time, on any number of workers. Bandwidths and
compute costs are not perturbed: only latencies, which is where the order of unsynchronised events comes from.

The order the machine keeps survives: a core's MTE3 (or fixpipe) writes to one die still land in issue order (a
perturbed write never lands before the previous one of that queue), and two latencies keep one value per path for
the whole run instead of one per access: a core's posted scalar stores to a die (stores to one word arrive in issue
order) and a core's cross-core flag sets (counted in order).
"""
from __future__ import annotations

import random

from .arguments import is_int
from .errors import ArgumentError


def _host() -> int:
    return -1


class Jitter:
    """Latency perturbation for one pod: ``fraction`` in [0, 1), drawn uniformly in [-fraction, +fraction]."""

    __slots__ = ("seed", "fraction", "home", "_draws", "_fixed", "_queues")

    def __init__(self, seed: int, fraction: float = 0.3):
        if not is_int(seed) or seed < 0:
            raise ArgumentError(f"jitter_seed={seed!r}: a seed is an integer >= 0")
        self.check_fraction(fraction)
        self.seed = int(seed)
        self.fraction = float(fraction)
        self.home = _host                 # the home of the event being processed (Pod sets the engine's)
        self._draws: dict = {}            # home -> its generator's draw
        self._fixed: dict = {}
        self._queues: dict = {}       # (die, core, pipe, destination die) -> when its last write lands (ps)

    @staticmethod
    def check_fraction(fraction) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
            raise ArgumentError(f"jitter={fraction!r}: the largest perturbation, a fraction in [0, 1) of each "
                                f"latency (0.3: +-30 %)")

    def latency(self, ps: int) -> int:
        """``ps`` perturbed by a fresh draw (picoseconds, >= 0)."""
        home = self.home()
        draw = self._draws.get(home)
        if draw is None:
            # str seeds hash with sha512: stable across runs and processes
            draw = self._draws[home] = random.Random(f"{self.seed}@{home}").random
        return ps + int(ps * self.fraction * (2.0 * draw() - 1.0))

    def transfer_end(self, ins, finish: int, latency: int) -> int:
        """When transfer ``ins``, whose bytes have passed every server at ``finish``, lands: ``latency`` perturbed,
        but an MTE3 or fixpipe write lands no earlier than the previous one of its core's queue to that die."""
        end = finish + self.latency(latency)
        pipe = ins.spec.pipe
        if pipe == "MTE3" or pipe == "FIXP":
            core = ins.core
            key = (core.die, core.unit, pipe, ins.dsts[0].store.die)
            last = self._queues.get(key, 0)
            if end < last:
                end = last
            self._queues[key] = end
        return end

    def fixed(self, ps: int, path) -> int:
        """``ps`` perturbed by the draw of ``path`` (any hashable of str / int): the same for every call with that
        path in this run, and independent of the order in which paths are first seen."""
        u = self._fixed.get(path)
        if u is None:
            # a generator of its own per path, seeded from text (str seeds hash with sha512: stable across runs)
            u = self._fixed[path] = 2.0 * random.Random(f"{self.seed}/{path!r}").random() - 1.0
        return ps + int(ps * self.fraction * u)

    def state_of(self, owned: list) -> tuple:
        """What a worker of a partitioned run drew for its dies (``owned[die]``): each owned die's generator state
        and the write queues into its dies, for the parent (changes.harvest; forked workers end with the run)."""
        draws = {home: draw.__self__.getstate() for home, draw in self._draws.items()
                 if 0 <= home < len(owned) and owned[home]}
        return draws, {k: v for k, v in self._queues.items() if owned[k[3]]}

    def merge_state(self, state: tuple) -> None:
        """Take another worker's ``state_of``: the next run draws on where its dies' generators are."""
        draws, queues = state
        for home, st in draws.items():
            rng = random.Random()
            rng.setstate(st)
            self._draws[home] = rng.random
        self._queues.update(queues)

    def __repr__(self) -> str:
        return f"Jitter(seed={self.seed}, fraction={self.fraction})"
