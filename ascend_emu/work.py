"""How much work each die of a pod has in one run: what a run over several workers balances (DESIGN.md 10).

A partitioned run (workers.py) ends each window when its slowest worker does, so it lasts as long as its busiest
worker, and a worker's CPU time is close to proportional to the engine events of its dies (each event is one
instruction issuing or completing, a poll, a message landing: the engine's per-origin counts, ``Engine._counts``).
``work_estimate(pod, launches)`` gives each die's expected events for the run about to start:

- measured, when the pod ran the same launches before (same kernels on the same dies, in the same order: a serving
  loop's steps, a benchmark's repeats): the events each die's cores caused during that run;
- else estimated from the queued launches: a kernel that knows its loops says how many instructions each die's
  cores issue (``@kernel(work=...)``), because the same kernel can do very different work on different dies: an
  A2E / E2A attention die sends all its tokens' rows and sums them back, a trampoline forwards and reduces a
  group's rows from every source, its partner only polls once and copies its own rows back (about 4100, 4600 and
  700 events at paper scale: split evenly by dies, one of two workers had 26 % more work than the other). A kernel
  without one counts its cores on the die, each as much as the average core of the kernels that do say (one per
  core when none does): right for kernels whose ranks are symmetric, such as the EP group's dispatch and combine
  (xccl.moe, kernels.fused_moe: every rank sends and receives its share of tokens).

Only the split depends on it: any partitioning gives the same results, so a poor estimate costs wall time only.

    weights = work_estimate(pod, launches)      # [pod.profile.dies] floats
    parts = partition(pod.profile, pod.profile.dies, workers, weights=weights)
"""
from __future__ import annotations

import weakref

_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # pod -> (launches' signature, event counts)


def work_estimate(pod, launches: list) -> list:
    """Each die's expected work (engine events) for a run of ``launches``: [dies] floats (see the module doc)."""
    dies = pod.profile.dies
    counts = list(pod.engine._counts[:dies])
    signature = tuple((la.kernel.name, tuple(la.dies), len(launch_cores(la))) for la in launches)
    last = _LAST.get(pod)
    _LAST[pod] = (signature, counts)
    if last is not None and last[0] == signature:
        measured = [float(now - then) for now, then in zip(counts, last[1])]
        if any(measured):
            return measured
    return estimated_work(dies, launches)


def estimated_work(dies: int, launches: list) -> list:
    """Each die's work from the launches alone: the kernels' own estimates, or their cores (module doc)."""
    work = [0.0] * dies
    hinted_work = hinted_cores = 0.0
    unhinted = [0.0] * dies                 # cores of launches whose kernel gives no estimate
    for la in launches:
        cores = len(launch_cores(la))
        hint = la.kernel.work
        for d in la.dies:
            if hint is None:
                unhinted[d] += cores
                continue
            w = max(0.0, float(hint(d, cores, *la.args)))
            work[d] += w
            hinted_work += w
            hinted_cores += cores
    per_core = hinted_work / hinted_cores if hinted_cores else 1.0
    return [w + per_core * n for w, n in zip(work, unhinted)]


def launch_cores(la) -> list:
    """The core indices a launch takes on each of its dies (a MIX kernel: its AICs and their AIVs)."""
    stream, kind = la.stream, la.kernel.cores
    if kind == "aiv":
        return list(stream.aiv)
    if kind == "aic":
        return list(stream.aic)
    return list(stream.aic) * 3
