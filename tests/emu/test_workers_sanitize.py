"""The race sanitizer over several workers (ascend_emu/race_log.py) reports what one process reports: the same races
(kinds, accesses, times, missing edges, counts) in the same order, the same ``RaceError`` with ``sanitize=True``,
and the same numbers, modeled times and trace digest, for 2 and 3 workers over both transports.

The corpus of broken protocols (tests/emu/test_sanitizer_corpus.py) runs on one-die chips, so that its dies 0 and
1 are on different workers; its one-die protocols run with their data on another worker's die. Each broken case is
caught on every split (none is missed) and each fixed twin is clean."""
from __future__ import annotations

import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.errors import RaceError
from tests.emu.test_sanitizer_corpus import (DATA, ROWS, aiv_to_aic, count_then_read, counter_bump, exchange_halves,
                                             handoff_scenario, ring_scenario, row_sums, shared_window_dispatch,
                                             two_writers)

SPLITS = [(w, t) for w in (2, 3) for t in ("shm", "gloo")]
SEEDS = (None, 5)


def _profile(workers: int):
    """One die per chip: dies 0 and 1 are on different workers, and there are chips enough for three."""
    return cloudmatrix384(dies=3, dies_per_chip=1)


def _run(scenario, workers: int, transport: str = "auto", seed=None, mode="collect", crossed: bool = False) -> tuple:
    pod = Pod(_profile(workers), workers=workers, transport=transport, sanitize=mode, jitter_seed=seed)
    runs, synchronize = [], pod.synchronize

    def recorded():
        run = synchronize()
        runs.append((run.modeled_us, run.instructions, run.trace.digest(), [r.to_dict() for r in run.races]))
        return run
    pod.synchronize = recorded
    try:
        out = scenario(pod)
        error = None
    except RaceError as e:
        out, error = None, (str(e), [r.to_dict() for r in e.races])
    races = [r.to_dict() for r in pod.races]
    gm = [st.data.tobytes() for arena in pod.gm._arenas.values() for st in arena._stores if st.data is not None]
    if crossed:                 # the run's dies talked across workers: the sanitizer saw both sides' accesses
        assert pod.worker_stats[1]["messages"] > 0 and pod.worker_stats[0]["messages"] > 0
    return (None if out is None else np.asarray(out).tobytes(), error, races, pod.now_us, runs, gm)


# ----------------------------------------------------------------------------------- scenarios over two workers
def _window(broken):
    def scenario(pod):
        xs = [pod.to_gm(d, DATA + 100 * d) for d in (0, 1)]
        win = pod.to_gm(0, np.zeros((2 * ROWS, DATA.shape[1]), np.float32))
        flags = pod.alloc(0, (8,), "int32")
        pod.launch(shared_window_dispatch, dies=[0, 1], aiv=1, args=(xs, win, flags[0:2], not broken))
        return win.numpy()
    return scenario


def _two_writers(broken):
    def scenario(pod):          # the cores on die 1 write die 0's rows
        out = pod.to_gm(0, np.zeros((2 * ROWS, DATA.shape[1]), np.float32))
        pod.launch(two_writers, die=1, aiv=2, args=(pod.to_gm(0, DATA), out, broken))
        return out.numpy()
    return scenario


def _counter(broken):
    def scenario(pod):          # die 1's cores bump a counter on die 0
        counter = pod.alloc(0, (8,), "int32")
        pod.launch(counter_bump, die=1, aiv=4, args=(counter[0:1], not broken))
        return counter.numpy()
    return scenario


def _halves(broken):
    def scenario(pod):
        buf = pod.alloc(2, (2 * ROWS, DATA.shape[1]), "fp32")
        out = pod.alloc(0, (2 * ROWS, DATA.shape[1]), "fp32")
        pod.launch(exchange_halves, die=1, aiv=2, args=(pod.to_gm(0, DATA), buf, out, not broken))
        return out.numpy()
    return scenario


def _count_then_read(broken):
    def scenario(pod):
        buf = pod.alloc(0, (4, ROWS, DATA.shape[1]), "fp32")
        out = pod.alloc(2, (ROWS, DATA.shape[1]), "fp32")
        counter = pod.alloc(0, (8,), "int32")
        pod.launch(count_then_read, die=1, aiv=4,
                   args=(pod.to_gm(2, DATA), buf, counter[0:1], out, None if broken else "all"))
        return out.numpy()
    return scenario


def _mix(broken):
    def scenario(pod):
        buf = pod.alloc(0, (2, ROWS, DATA.shape[1]), "fp32")
        pod.launch(aiv_to_aic, die=1, aic=1, args=(pod.to_gm(2, DATA), buf, None, "MTE2" if broken else "MTE3", 1))
        return buf.numpy()
    return scenario


def _row_sums(broken):
    def scenario(pod):
        out = pod.alloc(0, (DATA.shape[1],), "fp32")
        src = pod.alloc(2, (ROWS, DATA.shape[1]), "fp32") if broken else pod.to_gm(2, DATA)
        pod.launch(row_sums, die=1, aiv=1, args=(src, out, not broken))
        return out.numpy()
    return scenario


CASES = {
    "missing flag wait": (lambda broken: handoff_scenario(wait=not broken, delay=4000), "unpublished-read"),
    "flag without after": (lambda broken: handoff_scenario(after=None if broken else "MTE3"), "flag-misuse"),
    "shared window": (_window, "data-race"),
    "ring without back pressure": (lambda broken: ring_scenario(back_pressure=not broken), "slot-reuse"),
    "ack without after": (lambda broken: ring_scenario(ack_after=None if broken else "MTE2"), "slot-reuse"),
    "two writers": (_two_writers, "data-race"),
    "counter without atomics": (_counter, "data-race"),
    "missing barrier": (_halves, "unpublished-read"),
    "counter without after": (_count_then_read, "flag-misuse"),
    "cross-core flag after MTE2": (_mix, "flag-misuse"),
    "uninitialised data": (_row_sums, "uninitialized-read"),
}


@pytest.fixture(scope="module")
def one_process():
    return {(name, broken, seed): _run(CASES[name][0](broken), 1, seed=seed)
            for name in CASES for broken in (True, False) for seed in SEEDS}


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_the_corpus_reports_the_same_races_as_one_process(one_process, workers, transport):
    """Every broken protocol is caught as its kind and every fixed one is clean, on each split and seed, with the
    one process's races, numbers and modeled times (before: refused with NotPartitionableError)."""
    for name, (scenario_of, kind) in CASES.items():
        for broken in (True, False):
            for seed in SEEDS:
                got = _run(scenario_of(broken), workers, transport, seed, crossed=True)
                assert got == one_process[(name, broken, seed)], (name, broken, seed)
                kinds = {r["kind"] for r in got[2]}
                assert (kind in kinds) if broken else not kinds, (name, broken, seed, kinds)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_sanitize_true_raises_the_one_process_race_error(workers, transport):
    """``sanitize=True`` raises at the end of the launch that raced: the same RaceError on every split, and the host
    then reads the one process's GM (before: the other workers' GM was not merged after a raise)."""
    for name in ("missing flag wait", "two writers", "uninitialised data"):
        scenario = CASES[name][0](True)
        want = _run(scenario, 1, mode=True)
        assert want[1] is not None
        assert _run(scenario, workers, transport, mode=True) == want, name


_TORCHRUN_SCRIPT = """
import hashlib, os
from tests.emu.test_workers_sanitize import torchrun_cases
print(os.environ["RANK"], hashlib.sha256(repr(torchrun_cases(2)).encode()).hexdigest(), flush=True)
"""


def torchrun_cases(workers: int) -> list:
    """Racy protocols collected and raised, and a sanitized persistent kernel parked across two runs."""
    from ascend_emu.pod import pod_defaults
    from tests.emu.test_workers_host import _parked_run
    outs = [_run(CASES[name][0](True), workers) for name in ("missing flag wait", "counter without after")]
    outs.append(_run(CASES["two writers"][0](True), workers, mode=True))
    with pod_defaults(sanitize="collect") as sanitizers:
        outs.append(_parked_run(workers, die=3, stop_die=0))
    outs.append([r.to_dict() for s in sanitizers for r in s.races])
    return outs


def test_every_rank_of_a_torchrun_job_reports_the_one_process_races():
    """In a torchrun job rank 0 replays the logs; every rank then reports its races and raises its RaceError."""
    import hashlib
    from tests.emu.test_workers import torchrun_job
    want = hashlib.sha256(repr(torchrun_cases(1)).encode()).hexdigest()
    assert torchrun_job(_TORCHRUN_SCRIPT) == [["0", want], ["1", want]]


# ----------------------------------------------------------------------------------- the XCCL protocols' sweep
def _sweep_scenario(monkeypatch, test, *args) -> tuple:
    """The scenario (and its dies and pod options) a test of tests/xccl/test_sanitize_sweep.py sweeps."""
    import tests.xccl.test_sanitize_sweep as sweep
    got = []
    monkeypatch.setattr(sweep, "_sweep", lambda scenario, dies, **options: got.append((scenario, dies, options)))
    test(*args)
    return got[0]


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.float().numpy() if hasattr(x, "float") and not hasattr(x, "store") else x.numpy()
    return [np.asarray(x).tobytes()]


def _protocol_run(scenario, dies: int, options: dict, workers: int, transport: str = "auto", seed=None) -> tuple:
    pod = Pod(cloudmatrix384(dies=dies), workers=workers, transport=transport, sanitize="collect",
              jitter_seed=seed, trace=False, **options)
    out = _flat(scenario(pod))
    return out, [r.to_dict() for r in pod.races], pod.now_us


@pytest.mark.parametrize("name", ["send/recv", "pull dispatch/combine", "a2e/e2a", "expert service"])
def test_the_xccl_protocols_report_the_one_process_races(monkeypatch, name):
    """The XCCL sweep's protocols, sanitized under a jitter seed: on 2 workers (shared memory) and 3 (gloo) the
    same outputs, races (none) and end time as one process."""
    import tests.xccl.test_sanitize_sweep as sweep
    test, args = {"send/recv": (sweep.test_send_recv, ("mtu",)),
                  "pull dispatch/combine": (sweep.test_pull_dispatch_combine, ()),
                  "a2e/e2a": (sweep.test_a2e_e2a, ("mtu", True)),
                  "expert service": (sweep.test_expert_service_with_a_server_killed, ())}[name]
    scenario, dies, options = _sweep_scenario(monkeypatch, test, *args)
    one = _protocol_run(scenario, dies, options, 1, seed=4)
    assert not one[1]
    for workers, transport in ((2, "shm"), (3, "gloo")):
        assert _protocol_run(scenario, dies, options, workers, transport, seed=4) == one, (workers, transport)
