"""A core's scalar access of another die's GM is answered by the owning die when the request arrives there
(remote.py, DESIGN.md 10): it sees the word as it is at arrival, half the access's round trip after the issue, not
as it was at the issue. Latencies are those of the access as before; only what it sees moved."""
from __future__ import annotations

import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel

PS_PER_US = 1_000_000


@kernel(cores="aiv")
def _load(ctx, word, seen):
    seen["issue"] = ctx.now_us
    v = yield ctx.gm_load(word)
    seen["value"], seen["done"] = int(v[0]), ctx.now_us


@kernel(cores="aiv")
def _poll(ctx, word, seen):
    seen["issue"] = ctx.now_us
    v = yield ctx.wait_gm(word, "eq", 7, timeout_us=None)
    seen["value"], seen["done"] = int(v[0]), ctx.now_us


def _run(kern, write_after_issue_ps=None):
    """``kern`` on die 0 reads a word of die 1 (0 until the host writes 7 into it ``write_after_issue_ps`` after
    the read's issue). Returns what the kernel saw, the issue time (ps) and the access's round trip (ps)."""
    pod = Pod(cloudmatrix384(dies=2))
    word = pod.alloc(1, (1,), "int32")
    seen = {}
    rtt = pod.engine.paths.scalar_lat(0, 1, True)
    issue_ps = round(_issue_us() * PS_PER_US)
    if write_after_issue_ps is not None:
        pod.host_write(word, np.array([7], np.int32), at_us=(issue_ps + write_after_issue_ps) / PS_PER_US)
    pod.launch(kern, die=0, aiv=1, args=(word, seen))
    assert round(seen["issue"] * PS_PER_US) == issue_ps
    return seen, issue_ps, rtt


def _issue_us() -> float:
    """When the kernel's first instruction issues on a fresh pod (the launch overhead)."""
    pod = Pod(cloudmatrix384(dies=2))
    seen = {}
    pod.launch(_load, die=0, aiv=1, args=(pod.alloc(1, (1,), "int32"), seen))
    return seen["issue"]


def test_a_remote_load_reads_the_word_when_its_request_reaches_the_owner():
    """The host writes 7 into die 1's word a quarter round trip after die 0's load issues: before the request
    arrives (half a round trip), so the load returns 7; written just after the arrival, it returns 0. Either way
    the load takes one round trip (before the staging it returned 0 in both cases: it read at its issue)."""
    _, _, rtt = _run(_load)
    seen, issue, _ = _run(_load, write_after_issue_ps=rtt // 4)
    assert seen["value"] == 7
    assert round(seen["done"] * PS_PER_US) == issue + rtt
    seen, issue, _ = _run(_load, write_after_issue_ps=rtt // 2 + 1)
    assert seen["value"] == 0
    assert round(seen["done"] * PS_PER_US) == issue + rtt


def test_a_remote_load_at_the_arrival_instant_sees_a_host_write_of_that_instant():
    """At equal times the host's actions come before the dies' events (engine.py): a write landing exactly when
    the request arrives is seen."""
    _, _, rtt = _run(_load)
    seen, _, _ = _run(_load, write_after_issue_ps=rtt // 2)
    assert seen["value"] == 7


@pytest.mark.parametrize("after_arrival_ps, waits", [(-1, False), (1, True)])
def test_a_remote_poll_is_checked_at_the_owner_from_the_arrival_on(after_arrival_ps, waits):
    """A poll for 7: satisfied by a write before its request arrives, it returns one round trip after its issue;
    by a write after the arrival, one round trip after that write lands (the owner answers the landing)."""
    _, _, rtt = _run(_load)
    write = rtt // 2 + after_arrival_ps
    seen, issue, _ = _run(_poll, write_after_issue_ps=write)
    assert seen["value"] == 7
    assert round(seen["done"] * PS_PER_US) == issue + (write + rtt if waits else rtt)


def _bounded(timeout_us):
    @kernel(cores="aiv")
    def poll(ctx, word, seen):
        seen["issue"] = ctx.now_us
        v = yield ctx.wait_gm(word, "eq", 7, timeout_us=timeout_us, on_timeout="return")
        seen["value"], seen["done"] = (None if v is None else int(v[0])), ctx.now_us
    return poll


def test_a_remote_polls_bound_is_kept_at_the_owner():
    """A bound shorter than the round trip still lets a poll the word satisfies on arrival succeed (the owner
    answers before the bound passes there: one round trip after the issue, as before the staging); a poll it
    never satisfies learns that its bound passed when the owner's "nothing" arrives, half a round trip after."""
    _, _, rtt = _run(_load)
    bound = rtt * 3 // 4
    seen, issue, _ = _run(_bounded(bound / PS_PER_US), write_after_issue_ps=rtt // 4)
    assert seen["value"] == 7 and round(seen["done"] * PS_PER_US) == issue + rtt
    seen, issue, _ = _run(_bounded(bound / PS_PER_US))
    assert seen["value"] is None and round(seen["done"] * PS_PER_US) == issue + bound + rtt - rtt // 2
