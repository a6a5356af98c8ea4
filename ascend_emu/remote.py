"""Scalar accesses of another die's GM, staged at the die that owns it (DESIGN.md 10).

A core cannot see another die's memory at the instant it issues: its request crosses the fabric, the owning die
answers from its L2, and the answer crosses back. So a scalar read (``gm_load``) or a poll (``wait_gm``) of a word
on another die is a message to the owner, arriving ``arrival_ps`` after the issue: the owner reads the word then
(its value at arrival, not at issue) and replies, the reply reaching the core at the issue time plus the access's
round-trip latency. A poll the word does not satisfy yet waits at the owner; the landing that satisfies it replies
from there, one round-trip latency after the landing. A poll's bound (``timeout_us``) is kept at the owner too, at
the issue time plus the bound: a poll satisfied by then succeeds (even if its answer reaches the core after the
bound, as before the staging); one that is not expires there, and "nothing" (``on_timeout="return"``) reaches the
core the reply's latency later. Atomics and posted stores already act at the owner (engine.py:
``_sync_atomic_*``, ``_sync_gm_store``). The engine's ``send`` delivers every message; a partitioned engine swaps
only that delivery.

modeled as: the request reaches the owner after half the access's round-trip latency (the split the atomics use),
the reply takes the other half. Successful accesses keep their latencies; what they see moved (to the owner's state
at arrival); a remote poll that runs out of its bound learns it half a round trip later than before.
"""
from __future__ import annotations

import numpy as np


def arrival_ps(ins) -> int:
    """How long after its issue a scalar request of another die's word reaches the owner (ps)."""
    return ins.p["lat"] // 2


class Remote:
    """The owner-side halves of scalar accesses of another die's GM, for one engine."""

    __slots__ = ("engine",)

    def __init__(self, engine):
        self.engine = engine

    def load(self, ins) -> None:
        """``gm_load`` of another die's word, issued now: read at the owner on arrival."""
        eng = self.engine
        eng.send(eng.now + arrival_ps(ins), ins.srcs[0].store.die, self._load_arrived, ins)

    def _load_arrived(self, ins) -> None:
        if ins.core.killed:
            return
        v = ins.srcs[0]
        self.engine._complete_from_afar(ins, ins.start + ins.p["lat"], np.array(v.arr, copy=True))

    def poll(self, ins) -> None:
        """``wait_gm`` on another die's words, issued now (its bound, if any, is the issuing core's)."""
        eng = self.engine
        eng.send(eng.now + arrival_ps(ins), ins.srcs[0].store.die, self._poll_arrived, ins)

    def _poll_arrived(self, ins) -> None:
        eng = self.engine
        if ins.core.killed:
            return
        if eng._poll_ok(ins):
            eng._complete_from_afar(ins, ins.start + ins.p["lat"], np.array(ins.srcs[0].arr, copy=True))
            return
        eng.polls.add(ins)
        timeout = ins.p.get("timeout_ps")
        if timeout is not None:         # the owner keeps the bound (at once if it passed on the way)
            eng._add_timer(max(ins.start + timeout, eng.now), ins)

    def expired(self, ins) -> None:
        """The bound of a poll waiting here passed (``Engine._fire_timer`` took it out of the polls)."""
        eng = self.engine
        if ins.p.get("on_timeout") != "return":
            eng._wait_bound_exceeded(ins, eng.now)
        eng._complete_from_afar(ins, eng.now + ins.p["lat"] - arrival_ps(ins), None)
