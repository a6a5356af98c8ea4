"""A pod's run over several worker processes gives what one process gives (DESIGN.md 10, ascend_emu/workers.py):
numbers, modeled times, instruction counts, launch times, server counters and trace digest, for 2 and 3 workers
over both transports. What cannot be partitioned yet raises a clear error, and a worker that dies or raises ends
the run with a WorkerError naming it and its dies."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.demo import BASE_M, BASE_N, int8_gemm, quantize_rows
from ascend_emu.errors import ArgumentError, DeadlockError, KernelError, WorkerError
from tests.emu.test_event_order import _exchange
from tests.emu.test_staging import _round_trip

DIES = 6            # three chips: up to three workers (0-3 / 4-5 for two, one chip each for three)
SPLITS = [(w, t) for w in (2, 3) for t in ("shm", "gloo")]


def _outcome(pod, run, tensors) -> tuple:
    """Everything a run reports that must not depend on the worker count."""
    return (run.modeled_us, run.kernel_us, run.instructions, run.bytes_moved, run.trace.digest(),
            [(la.name, la.dies, la.cores, la.start_us, la.end_us, la.l2_bytes, la.hbm_bytes, la.fabric_bytes)
             for la in run.launches],
            sorted(run.pipe_busy.items()), sorted(run.servers.items()), run.l2,
            [t.numpy().tobytes() for t in tensors])


# ------------------------------------------------------------------------------------ a cross-die protocol
@kernel(cores="aiv")
def _protocol(ctx, src, dst, counter, flag, watch, far_word, rounds):
    """Each core transforms its rows locally, counts itself on another chip's counter (an atomic), raises that
    chip's flag (a posted store), polls its own die's flag (raised from another chip) and reads a word of a third
    die (a remote load), ``rounds`` times."""
    rows = src.shape[0] // ctx.block_num
    lo = ctx.block_idx * rows
    ub = ctx.ub.alloc((rows, src.shape[1]), "fp32")
    ub2 = ctx.ub.alloc((1, src.shape[1]), "fp32")
    for r in range(rounds):
        yield ctx.copy_gm_to_ub(ub, src[lo:lo + rows])
        yield ctx.vec.adds(ub, ub, float(r + 1))
        yield ctx.copy_ub_to_gm(dst[lo:lo + rows], ub)
        old = yield ctx.atomic_add(counter, 1)
        if ctx.block_idx == 0:
            yield ctx.gm_store(flag, r + 1, after="all")
        yield ctx.wait_gm(watch, "ge", r + 1)
        seen = yield ctx.gm_load(far_word)
        yield ctx.vec.duplicate(ub2, float(np.asarray(seen).item() + np.asarray(old).item()))
        yield ctx.copy_ub_to_gm(dst[lo:lo + 1], ub2)


def _protocol_run(workers: int, transport: str = "auto", jitter_seed: int | None = None) -> tuple:
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport, jitter_seed=jitter_seed)
    src = [pod.to_gm(d, np.arange(16 * 64, dtype=np.float32).reshape(16, 64) + d) for d in range(DIES)]
    dst = [pod.alloc(d, (16, 64), "fp32") for d in range(DIES)]
    counter = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    flag = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    for d in range(DIES):
        to = (d + 2) % DIES                 # always another chip
        pod.stream(d, aiv=4).launch(_protocol, (src[d], dst[d], counter[to], flag[to], flag[d],
                                                counter[(d + 3) % DIES], 2))
    run = pod.synchronize()
    assert [int(c.numpy()[0]) for c in counter] == [8] * DIES      # 4 cores x 2 rounds from one other die each
    return _outcome(pod, run, dst + counter + flag)


@pytest.fixture(scope="module")
def protocol_one():
    return _protocol_run(1)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a_jittered_run_matches_one_process(workers, transport):
    """Seeded jitter draws per home of events (jitter.py), so a seed gives one run on any number of workers; other
    seeds give other timings."""
    runs = {seed: _protocol_run(1, jitter_seed=seed) for seed in (3, 4)}
    assert runs[3][0] != runs[4][0] or runs[3][4] != runs[4][4]       # the seed moves the timing
    assert _protocol_run(workers, transport, jitter_seed=3) == runs[3]


def _jittered_twice(workers: int, transport: str = "auto") -> tuple:
    """Two runs of a pod with seeded jitter: the second draws on where each die's generator stopped."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport, jitter_seed=3)
    outcomes = []
    for _ in range(2):
        src = [pod.to_gm(d, np.arange(16 * 64, dtype=np.float32).reshape(16, 64) + d) for d in range(DIES)]
        dst = [pod.alloc(d, (16, 64), "fp32") for d in range(DIES)]
        counter = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
        flag = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
        for d in range(DIES):
            to = (d + 2) % DIES
            pod.stream(d, aiv=4).launch(_protocol, (src[d], dst[d], counter[to], flag[to], flag[d],
                                                    counter[(d + 3) % DIES], 2))
        outcomes.append(_outcome(pod, pod.synchronize(), dst + counter))
    return tuple(outcomes)


@pytest.mark.parametrize("workers,transport", [(2, "shm"), (3, "gloo")])
def test_a_jittered_pod_run_twice_matches_one_process(workers, transport):
    """The forked workers' jitter draws come back with their results (before: the parent's generators of their
    dies had not moved, so a second run drew other latencies than one process)."""
    assert _jittered_twice(workers, transport) == _jittered_twice(1)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_a_flag_counter_protocol_across_chips_matches_one_process(protocol_one, workers, transport):
    """Atomics, posted stores, remote polls and remote loads between chips of different workers: every reported
    number is the one process's (before: ``Pod`` had no ``workers``)."""
    assert _protocol_run(workers, transport) == protocol_one


# ------------------------------------------------------------------------------------ the demo kernels
def _demo_run(workers: int, transport: str = "auto") -> tuple:
    """quantize_rows on every die, int8_gemm on dies 1, 2 and 5, each on its own die's data."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    g = torch.Generator().manual_seed(0)
    outs, m, n, k = [], 2 * BASE_M, BASE_N, 256
    for d in range(DIES):
        x = pod.to_gm(d, (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16))
        y, s = pod.alloc(d, (64, 256), "int8"), pod.alloc(d, (64,), "fp32")
        pod.stream(d, aiv=4).launch(quantize_rows, (x, y, s, 16, 8))
        outs += [y, s]
    for d in (1, 2, 5):
        a = pod.to_gm(d, torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8))
        b = pod.to_gm(d, torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8))
        ts, cs = pod.to_gm(d, torch.rand(m, generator=g) / 64), pod.to_gm(d, torch.rand(n, generator=g) / 64)
        ws = pod.alloc(d, (m // BASE_M * (n // BASE_N), BASE_M, BASE_N), "int32")
        c = pod.alloc(d, (m, n), "bf16")
        pod.stream(d, aic=2, mode="graph").launch(int8_gemm, (a, b, ts, cs, ws, c))
        outs.append(c)
    run = pod.synchronize()
    return _outcome(pod, run, outs)


@pytest.fixture(scope="module")
def demo_one():
    return _demo_run(1)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_the_demo_kernels_on_every_die_match_one_process(demo_one, workers, transport):
    assert _demo_run(workers, transport) == demo_one


def test_consecutive_runs_and_a_killed_die_match_one_process():
    """Two runs in a row (the second starts from the first's merged GM, L2 and server state) with a die killed
    during the second: the same as one process."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=4), workers=workers)
        src = [pod.to_gm(d, np.full((16, 64), float(d), np.float32)) for d in range(4)]
        dst = [pod.alloc(d, (16, 64), "fp32") for d in range(4)]
        counter = [pod.alloc(d, (1,), "int32") for d in range(4)]
        flag = [pod.alloc(d, (1,), "int32") for d in range(4)]
        out = []
        for rnd in range(2):
            for d in range(4):
                pod.stream(d, aiv=2).launch(_protocol, (src[d], dst[d], counter[(d + 2) % 4], flag[(d + 2) % 4],
                                                        flag[d], counter[(d + 1) % 4], 1))
            if rnd == 1:
                pod.kill_die(3, at_us=pod.now_us + 15.5)
            out.append(_outcome(pod, pod.synchronize(), dst + counter + flag))
        return out, [c.where for c in pod.killed]
    assert go(2) == go(1)


# ------------------------------------------------------------------------------------ not yet partitionable
@kernel(cores="aiv")
def _pull(ctx, src, dst):
    ub = ctx.ub.alloc(src.shape, "fp32")
    yield ctx.copy_gm_to_ub(ub, src)
    yield ctx.copy_ub_to_gm(dst, ub)


def _bulk_run(workers: int, transport: str = "auto") -> tuple:
    """Every die's core reads from, writes to and relays between dies of the other chips (staging.py's messages)."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    rng = np.random.default_rng(7)
    src = [pod.to_gm(d, rng.standard_normal((8 + d, 64)).astype(np.float32)) for d in range(DIES)]
    outs = []
    for d in range(DIES):
        far = [(d + 2) % DIES, (d + 4) % DIES, (d + 3) % DIES]
        mid, dst = (pod.alloc(far[i], src[far[0]].shape, "fp32") for i in (1, 2))
        back = pod.alloc(d, src[far[0]].shape, "fp32")
        pod.stream(d, aiv=1).launch(_round_trip, (src[far[0]], mid, dst, back), name=f"round{d}")
        outs += [mid, dst, back]
    run = pod.synchronize()
    for d in range(DIES):
        assert np.array_equal(outs[3 * d + 2].numpy(), src[(d + 2) % DIES].numpy() * np.float32(3.0))
    return _outcome(pod, run, outs)


@pytest.mark.parametrize("workers,transport", SPLITS)
def test_bulk_transfers_between_workers_match_one_process(workers, transport):
    """Remote reads, remote writes and DMA relays whose dies are on different workers travel as staged messages
    (messages.py's codecs for staging's records): everything reported is the one process's (before: no codec,
    the run stopped with 'not yet partitionable')."""
    assert _bulk_run(workers, transport) == _bulk_run(1)


def test_a_bulk_transfer_inside_one_worker_partitions():
    """Dies of one chip (one worker) move bulk data between them as in one process."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=4), workers=workers)
        src = pod.to_gm(1, np.arange(8 * 64, dtype=np.float32).reshape(8, 64))
        dst = pod.alloc(0, (8, 64), "fp32")
        run = pod.launch(_pull, die=0, aiv=1, args=(src, dst))
        return _outcome(pod, run, [dst])
    assert go(2) == go(1)
    assert (go(2)[-1][0] == np.arange(8 * 64, dtype=np.float32).tobytes())


def test_bad_worker_arguments_are_refused_before_the_run():
    with pytest.raises(ArgumentError, match="workers=7: use 1..3"):
        Pod(cloudmatrix384(dies=DIES), workers=7)
    for bad in (0, True, 2.0):
        with pytest.raises(ArgumentError, match="workers="):
            Pod(cloudmatrix384(dies=DIES), workers=bad)
    with pytest.raises(ArgumentError, match="transport='tcp'"):
        Pod(cloudmatrix384(dies=DIES), workers=2, transport="tcp")


# ------------------------------------------------------------------------------------ failures
@kernel(cores="aiv")
def _fails_on(ctx, word, die, how):
    yield ctx.atomic_add(word, 1)
    if ctx.die == die and ctx.block_idx == 0:
        if how == "raise":
            raise ValueError("bad row")
        os.kill(os.getpid(), signal.SIGKILL)
    yield ctx.atomic_add(word, 1)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_worker_killed_mid_run_ends_the_run_with_an_error_naming_it(transport):
    pod = Pod(cloudmatrix384(dies=4), workers=2, transport=transport)
    word = pod.alloc(0, (1,), "int32")
    pod.stream(dies=[0, 1, 2, 3], aiv=2).launch(_fails_on, (word, 3, "kill"))
    with pytest.raises(WorkerError, match=r"worker 1 \(dies 2\.\.3\) died") as e:
        pod.synchronize()
    assert e.value.worker == 1


def test_a_worker_whose_kernel_raises_ends_the_run_with_its_error():
    pod = Pod(cloudmatrix384(dies=4), workers=2)
    word = pod.alloc(0, (1,), "int32")
    pod.stream(dies=[0, 1, 2, 3], aiv=2).launch(_fails_on, (word, 2, "raise"))
    with pytest.raises(WorkerError, match=r"worker 1 \(dies 2\.\.3\) failed: KernelError: .*ValueError: bad row"):
        pod.synchronize()


# ------------------------------------------------------------------------------------ launch order and bounds
@kernel(cores="aiv")
def _poll_far(ctx, word, out, bound_us):
    """Polls a word of another chip that nobody raises, bounded: counts the polls that came back empty."""
    ub = ctx.ub.alloc((1, 8), "int32")
    seen = yield ctx.wait_gm(word, "ge", 1, timeout_us=bound_us, on_timeout="return")
    yield ctx.vec.duplicate(ub, 1 if seen is None else 2)
    yield ctx.copy_ub_to_gm(out[ctx.block_idx:ctx.block_idx + 1], ub)


def test_waiting_launches_dependencies_and_bounded_remote_polls_match_one_process():
    """A launch waiting for busy cores (it starts the instant they free), a launch on another worker's chip that
    waits for it (``after=``), and remote polls that run out of their bound: the same as one process."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=4), workers=workers)
        words = [pod.alloc(d, (1,), "int32") for d in range(4)]
        outs = [pod.alloc(d, (4, 8), "int32") for d in range(4)]
        first = pod.stream(0, aiv=[0, 1]).launch(_poll_far, (words[3], outs[0], 3.0))
        second = pod.stream(0, aiv=[1, 2], mode="graph").launch(_poll_far, (words[2], outs[1], 1.5))
        pod.stream(3, aiv=2, mode="graph").launch(_poll_far, (words[0], outs[3], 2.0), after=[second])
        pod.stream(2, aiv=1).launch(_poll_far, (words[1], outs[2], 0.5), after=[first])
        run = pod.synchronize()
        return _outcome(pod, run, outs)
    one = go(1)
    assert go(2) == one
    starts = {la[1][0]: la[3] for la in one[5]}
    assert starts[3] > starts[0]            # after= held it back



@kernel(cores="aiv")
def _copies(ctx, srcs, rounds_by_die):
    src = srcs[ctx.die]
    ub = ctx.ub.alloc(src.shape, "fp32")
    for _ in range(rounds_by_die[ctx.die]):
        yield ctx.copy_gm_to_ub(ub, src)
        yield ctx.vec.adds(ub, ub, 1.0)


def test_a_launch_waiting_for_cores_another_worker_frees_starts_when_one_process_starts_it():
    """Launch X runs on dies 0 and 2 (two workers) and ends late on die 0; launch Y waits for X's core on die 2,
    next to busy traffic of launch Z: Y starts the instant X ends, on worker 1, which must not have run die 2's
    traffic past that instant (the windows go one picosecond at a time while a launch waits for cores)."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=4), workers=workers)
        src = [pod.to_gm(d, np.ones((32, 64), np.float32)) for d in range(4)]
        pod.stream(dies=[0, 2], aiv=[0]).launch(_copies, (src, {0: 40, 2: 2}), name="X")
        pod.stream(2, aiv=[0]).launch(_copies, (src, {2: 5}), name="Y")
        pod.stream(2, aiv=[1, 2, 3]).launch(_copies, (src, {2: 120}), name="Z")
        return _outcome(pod, pod.synchronize(), src)
    one = go(1)
    assert go(2) == one
    x, y = one[5][0], one[5][1]
    assert y[3] == x[4]                   # Y started when X ended


# ------------------------------------------------------------------------------------ torchrun
_RANK_SCRIPT = """
import hashlib, os
from tests.emu.test_workers import _protocol_run
print(os.environ["RANK"], hashlib.sha256(repr(_protocol_run(2)).encode()).hexdigest(), flush=True)
"""


def test_every_rank_of_a_torchrun_job_runs_its_partition_and_ends_with_the_whole_pod(protocol_one):
    """Two processes started the way ``torchrun --nproc-per-node 2`` starts them (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) run the same script with ``Pod(workers=2)``: each runs its chips over the job's gloo group and
    both end with every number of the one-process run."""
    import hashlib
    want = hashlib.sha256(repr(protocol_one).encode()).hexdigest()
    assert torchrun_job(_RANK_SCRIPT) == [["0", want], ["1", want]]


def torchrun_job(script: str, ranks: int = 2) -> list:
    """Run ``script`` in ``ranks`` processes started the way ``torchrun`` starts them; returns each rank's
    printed words."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-c", script], cwd=root, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    lines = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        lines.append(out.split())
    return lines


@kernel(cores="aiv")
def _poll_forever(ctx, word):
    yield ctx.wait_gm(word, "ge", 1, timeout_us=2.0)


def test_a_remote_poll_past_its_bound_raises_where_one_process_raises():
    """The bound of a poll of another worker's word is kept by that word's owner: it raises the same
    DeadlockError, naming the waiting core of the other worker."""
    def go(workers):
        pod = Pod(cloudmatrix384(dies=4), workers=workers)
        word = pod.alloc(0, (1,), "int32")
        pod.stream(2, aiv=1).launch(_poll_forever, (word,), name="poller")
        with pytest.raises(DeadlockError) as e:
            pod.synchronize()
        return str(e.value).splitlines()[0]
    one = go(1)
    assert "wait bound exceeded" in one and "kernel 'poller' die 2 aiv 0" in one
    assert go(2) == one


# ------------------------------------------------------------------------------------ random cross-die patterns
def _pattern_run(pattern, cores: int, rounds: int, workers: int) -> tuple:
    """Die d counts on die ``pattern[d][0]``, raises a flag on die ``pattern[d][1]`` (which waits for it) and reads
    a word of die ``pattern[d][2]``."""
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers)
    src = [pod.to_gm(d, np.full((8, 32), float(d), np.float32)) for d in range(DIES)]
    dst = [pod.alloc(d, (8, 32), "fp32") for d in range(DIES)]
    counter = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    flags = [pod.alloc(d, (DIES,), "int32") for d in range(DIES)]
    for d in range(DIES):
        ct, fl, far = pattern[d]
        raisers = [s for s in range(DIES) if pattern[s][1] == d]
        watch = flags[d][raisers[0]:raisers[0] + 1] if raisers else None
        pod.stream(d, aiv=cores).launch(_exchange, (src[d], dst[d], counter[ct], flags[fl][d:d + 1], watch, rounds,
                                                    counter[far]))
    return _outcome(pod, pod.synchronize(), dst + counter + flags)


@settings(max_examples=6, deadline=None)
@given(pattern=st.lists(st.tuples(*[st.integers(0, DIES - 1)] * 3), min_size=DIES, max_size=DIES),
       cores=st.sampled_from([1, 2, 4]), rounds=st.integers(1, 2), workers=st.sampled_from([2, 3]))
def test_random_cross_die_patterns_match_one_process(pattern, cores, rounds, workers):
    one = _pattern_run(pattern, cores, rounds, 1)
    assert _pattern_run(pattern, cores, rounds, workers) == one
    counts = [np.frombuffer(x, np.int32)[0] for x in one[-1][DIES:2 * DIES]]
    assert counts == [cores * rounds * sum(p[0] == die for p in pattern) for die in range(DIES)]


# ------------------------------------------------------------------------------------ GM after a run that raises
@kernel(cores="aiv")
def _writes_until(ctx, out, far, word, fail_die, fail_at):
    """Each core writes row after row of its die's ``out`` and of another chip's ``far`` and counts on ``word``;
    the core on ``fail_die`` raises after row ``fail_at``."""
    t = ctx.ub.alloc((1, 64), "fp32")
    for i in range(out.shape[0] // ctx.block_num):
        row = i * ctx.block_num + ctx.block_idx
        yield ctx.vec.duplicate(t, float(i + 1))
        yield ctx.copy_ub_to_gm(out[row:row + 1], t)
        yield ctx.copy_ub_to_gm(far[row:row + 1], t)
        yield ctx.atomic_add(word, 1)
        if ctx.die == fail_die and ctx.block_idx == 0 and i == fail_at:
            raise ValueError("bad row")
        yield ctx.scalar(40)


def _raising_run(workers: int, transport: str, fail_die: int) -> tuple:
    pod = Pod(cloudmatrix384(dies=DIES), workers=workers, transport=transport)
    outs = [pod.alloc(d, (64, 64), "fp32") for d in range(DIES)]
    fars = [pod.alloc(d, (64, 64), "fp32") for d in range(DIES)]
    words = [pod.alloc(d, (1,), "int32") for d in range(DIES)]
    for d in range(DIES):
        pod.stream(d, aiv=2).launch(_writes_until, (outs[d], fars[(d + 2) % DIES], words[(d + 3) % DIES], fail_die,
                                                    9))
    with pytest.raises((KernelError, WorkerError), match="bad row") as e:
        pod.synchronize()
    gm = [t.numpy().tobytes() for t in outs + fars + words]
    return gm, type(e.value).__name__, pod.now_us


@pytest.mark.parametrize("workers,transport", SPLITS)
@pytest.mark.parametrize("fail_die", [1, 4])
def test_after_a_run_raises_the_host_reads_the_gm_of_one_process(workers, transport, fail_die):
    """A kernel raises while every other die keeps writing (its own rows, another chip's, an atomic counter):
    the GM the host reads afterwards is the one process's when it raised, whichever worker's die failed (before:
    the other workers' GM was not merged, and what they wrote later in the window showed)."""
    one = _raising_run(1, "auto", fail_die)
    assert one[1] == "KernelError"
    got = _raising_run(workers, transport, fail_die)
    assert got[0] == one[0]
    assert any(b.strip(b"\\0") for b in one[0][DIES:2 * DIES])         # remote rows had landed when it raised
