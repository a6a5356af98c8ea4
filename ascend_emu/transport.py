"""Message exchange between the worker processes of a multi-process run (DESIGN.md 10).

A partitioned run advances in windows; at each window's end every worker calls ``exchange`` once with the messages
it produced for each other worker and the time of its next pending event, and gets back every message addressed
to it (in the order of the senders' ranks, each sender's in the order sent) and the smallest next-event time of all
workers, where the next window starts. Two transports give the same answer:

- ``ShmTransport``: one host; shared-memory rings (``shm_ring``), one per ordered pair of workers.
- ``GlooTransport``: ``torch.distributed`` with the gloo backend, across hosts (``torchrun``) or on one.

    results = run_workers(3, fn, args=(x,), transport="shm")      # fn(transport, x) in 3 local processes

Failures end the run everywhere: a worker that raises reports it (``fail``) and its peers raise ``WorkerError``
naming it and its cause; a worker that dies is seen by its peers through its status record and process id (shm)
or by the launcher; any wait longer than ``timeout_s`` without a frame raises ``WorkerError`` naming the silent peer.
"""
from __future__ import annotations

import os
import struct
import time
import traceback
from collections import deque
from dataclasses import dataclass

from .errors import ArgumentError, WorkerError
from .shm_ring import FAILED, FINISHED, RUNNING, RingSegment

DATA, END, ERROR, PART = 0, 1, 2, 3      # PART: a fragment of a message too large for one frame; DATA ends it
_END = struct.Struct("<qq")            # next event time (ps), messages sent this window
NEVER = 2 ** 62                        # a worker with no pending event
_CHECK_EVERY_S = 0.005                 # how often a waiting worker looks at its silent peers' status


@dataclass
class Exchange:
    """What one window's exchange returns: ``inbox`` (sender rank, payload bytes) in sender order, then send order;
    ``next_ps``: the smallest next-event time over all workers (``NEVER``: none has one)."""
    inbox: list
    next_ps: int


class Transport:
    """One worker's end: ``rank`` of ``size`` workers."""
    rank: int
    size: int
    timeout_s: float

    def exchange(self, outbox: dict, next_ps: int) -> Exchange:
        """Send ``outbox`` ({destination rank: [payload bytes]}) and this worker's next event time; receive."""
        raise NotImplementedError

    def fail(self, cause: str) -> None:
        """Tell the peers this worker failed (they raise ``WorkerError`` naming it)."""

    def close(self) -> None:
        """Leave the run (after the last exchange)."""


def _check_outbox(outbox: dict, rank: int, size: int) -> None:
    for dst in outbox:
        if not (isinstance(dst, int) and 0 <= dst < size) or dst == rank:
            raise ArgumentError(f"outbox: destination {dst!r} is not another worker (0..{size - 1}, not {rank})")


class ShmTransport(Transport):
    """Exchange through a ``RingSegment``'s rings. A full ring does not block the window: the worker drains its
    incoming rings while it waits for space, so every exchange completes whatever the message volume."""

    def __init__(self, segment: RingSegment, rank: int, *, timeout_s: float = 60.0):
        self.seg, self.rank, self.size, self.timeout_s = segment, rank, segment.workers, float(timeout_s)
        self.peers = [j for j in range(self.size) if j != rank]
        segment.set_status(rank, RUNNING)

    def exchange(self, outbox: dict, next_ps: int) -> Exchange:
        _check_outbox(outbox, self.rank, self.size)
        seg, rank = self.seg, self.rank
        queues = {j: deque(self._frames(outbox.get(j, ()))) for j in self.peers}
        ends = {j: _END.pack(int(next_ps), len(outbox.get(j, ()))) for j in self.peers}
        inbox, parts = {j: [] for j in self.peers}, {j: [] for j in self.peers}
        pending_end, peer_next = set(self.peers), {}
        waited, last, finished = 0, time.monotonic(), set()
        next_check = 0.0
        while pending_end or len(peer_next) < len(self.peers):
            moved = False
            for j in self.peers:
                ring, q = seg.ring(rank, j), queues[j]
                while q and ring.put(*q[0]):
                    q.popleft()
                    moved = True
                if not q and j in pending_end and ring.put(END, ends[j]):
                    pending_end.discard(j)
                    moved = True
            for j in self.peers:
                if j in peer_next:
                    continue
                ring = seg.ring(j, rank)
                while (frame := ring.get()) is not None:
                    kind, payload = frame
                    moved = True
                    if kind == DATA:
                        inbox[j].append(b"".join(parts[j]) + payload if parts[j] else payload)
                        parts[j] = []
                    elif kind == PART:
                        parts[j].append(payload)
                    elif kind == END:          # what follows belongs to the next window
                        nxt, count = _END.unpack(payload)
                        if count != len(inbox[j]):
                            raise WorkerError(j, f"sent {count} messages but {len(inbox[j])} arrived (ring corrupt)")
                        peer_next[j] = nxt
                        break
                    else:
                        raise WorkerError(j, f"failed: {payload.decode(errors='replace')}")
            if moved:
                waited, last, finished = 0, time.monotonic(), set()
                continue
            waited += 1
            # spin a little (a window exchange is usually quick), then yield the CPU in sleeps doubling up to half a
            # millisecond; the peers' status (a read of /proc per peer) is checked every few milliseconds only: on
            # a shared machine a waiting worker must not eat the CPU the others compute with
            if waited <= 64:
                continue
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_EVERY_S
                # a peer that finished did so after its last frames: gone only if it was finished before a read
                # that found nothing (its END may have landed between this pass's reads and the status check)
                gone = self._check_peers(pending_end | (set(self.peers) - set(peer_next)), last)
                if gone & finished:
                    raise WorkerError(min(gone & finished), "left the run before this exchange (it finished early)")
                finished = gone
            time.sleep(min(5e-4, 1e-6 * 2 ** min(waited - 64, 9)))
        return Exchange([(j, p) for j in self.peers for p in inbox[j]],
                        min([int(next_ps), *peer_next.values()]))

    def _frames(self, messages) -> list:
        """(kind, payload) frames of ``messages``: one DATA frame each, or PART frames and a last DATA frame for a
        message larger than half a ring (so it never waits for space the ring cannot have)."""
        most = self.seg.capacity // 2 - 8
        frames = []
        for m in messages:
            m = bytes(m)
            while len(m) > most:
                frames.append((PART, m[:most]))
                m = m[most:]
            frames.append((DATA, m))
        return frames

    def _check_peers(self, waiting_on: set, since: float) -> set:
        """Raise for a peer we wait on that failed, died or stayed silent past the bound; returns those that
        finished."""
        finished = set()
        for j in sorted(waiting_on):
            state, pid, text = self.seg.status(j)
            if state == FAILED:
                raise WorkerError(j, f"failed: {text}")
            if state == FINISHED:
                finished.add(j)
            if state == RUNNING and not _alive(pid):
                raise WorkerError(j, f"died (process {pid} is gone)")
        if time.monotonic() - since > self.timeout_s:
            j = min(waiting_on)
            raise WorkerError(j, f"sent nothing for {self.timeout_s:g} s (the exchange's bound, timeout_s)")
        return finished

    def fail(self, cause: str) -> None:
        self.seg.set_status(self.rank, FAILED, cause)
        for j in self.peers:                  # best effort: a full ring still has the status record
            self.seg.ring(self.rank, j).put(ERROR, cause.encode()[:4096])

    def close(self) -> None:
        state, _, _ = self.seg.status(self.rank)
        if state == RUNNING:
            self.seg.set_status(self.rank, FINISHED)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class GlooTransport(Transport):
    """Exchange through ``torch.distributed`` (gloo): one all-gather per window of every worker's (next time,
    outbox, failure). Joins the process group the environment describes (``torchrun``: ``init_method="env://"``)
    unless one is initialised already; collectives are bounded by ``timeout_s``."""

    def __init__(self, rank: int | None = None, size: int | None = None, *, init_method: str = "env://",
                 timeout_s: float = 60.0):
        import atexit
        import datetime

        import torch.distributed as dist
        self.dist = dist
        self.timeout_s = float(timeout_s)
        self.owner = not dist.is_initialized()
        if self.owner:
            kw = {} if rank is None else {"rank": rank, "world_size": size}
            dist.init_process_group("gloo", init_method=init_method,
                                    timeout=datetime.timedelta(seconds=self.timeout_s), **kw)
            # a group still up when the interpreter exits tears gloo's threads down under them (the process
            # aborts: "terminate called without an active exception"); a pod keeps its torchrun transport open
            atexit.register(self.close)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def _gather(self, item) -> list:
        out = [None] * self.size
        try:
            self.dist.all_gather_object(out, item)
        except Exception as e:            # a peer gone (connection reset) or silent past the bound
            raise WorkerError(None, f"a peer of worker {self.rank} left the gloo group or stayed silent past "
                                    f"{self.timeout_s:g} s: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}") from e
        return out

    def exchange(self, outbox: dict, next_ps: int) -> Exchange:
        _check_outbox(outbox, self.rank, self.size)
        gathered = self._gather((int(next_ps), {j: list(v) for j, v in outbox.items() if v}, None))
        for j, (_, _, failure) in enumerate(gathered):
            if failure is not None:
                raise WorkerError(j, f"failed: {failure}")
        inbox = [(j, p) for j, (_, box, _) in enumerate(gathered) if j != self.rank for p in box.get(self.rank, ())]
        return Exchange(inbox, min(t for t, _, _ in gathered))

    def fail(self, cause: str) -> None:
        try:                              # the peers are in (or will enter) an exchange: answer it with the failure
            self._gather((NEVER, {}, cause))
        except WorkerError:
            pass

    def close(self) -> None:
        if self.owner and self.dist.is_initialized():
            self.dist.destroy_process_group()


# ============================================================================================ local workers
def _worker(rank: int, size: int, kind: str, spec: dict, fn, args: tuple, results) -> None:
    transport = None
    try:
        if kind == "shm":
            seg = RingSegment.attach(spec["name"], size, spec["capacity"], spec["locks"])
            transport = ShmTransport(seg, rank, timeout_s=spec["timeout_s"])
        else:
            transport = GlooTransport(rank, size, init_method=spec["init_method"], timeout_s=spec["timeout_s"])
        value = fn(transport, *args)
        transport.close()
        results.put((rank, True, value))
    except BaseException as e:
        cause = f"{type(e).__name__}: {e}"
        if transport is not None and not isinstance(e, WorkerError):
            transport.fail(cause)
        results.put((rank, False, (cause, isinstance(e, WorkerError), traceback.format_exc())))


def run_workers(n: int, fn, args: tuple = (), *, transport: str = "auto", timeout_s: float = 60.0,
                capacity: int = 1 << 20) -> list:
    """Run ``fn(transport, *args)`` in ``n`` local worker processes (spawned: ``fn`` and ``args`` must pickle);
    returns the values in rank order. ``transport``: "shm", "gloo" or "auto" (shm). ``capacity``: bytes per ring.
    Raises ``WorkerError`` naming the worker that failed first (its own error, not a peer's report of it)."""
    import multiprocessing as mp
    import queue
    import tempfile
    if not (isinstance(n, int) and n >= 1):
        raise ArgumentError(f"n={n!r}: workers must be an int >= 1")
    if transport not in ("auto", "shm", "gloo"):
        raise ArgumentError(f"transport={transport!r}: use 'auto', 'shm' or 'gloo'")
    kind = "shm" if transport == "auto" else transport
    ctx = mp.get_context("spawn")
    seg, tmp = None, None
    if kind == "shm":
        locks = RingSegment.make_locks(ctx, n)
        seg = RingSegment.create(n, capacity, locks)
        spec = {"name": seg.name, "capacity": capacity, "locks": locks, "timeout_s": timeout_s}
    else:
        tmp = tempfile.NamedTemporaryFile(prefix="ascend_emu_gloo_", delete=False)
        tmp.close()
        os.unlink(tmp.name)               # the file store creates it
        spec = {"init_method": f"file://{tmp.name}", "timeout_s": timeout_s}
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, n, kind, spec, fn, args, results), daemon=True) for r in range(n)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, seg, timeout_s, queue)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if seg is not None:
            seg.close()
        if tmp is not None and os.path.exists(tmp.name):
            os.unlink(tmp.name)


def _collect(procs, results, seg, timeout_s: float, queue) -> list:
    """Wait for every worker's result; a worker that dies without one is marked FAILED for its peers."""
    values, errors, reported = {}, {}, set()
    bound = max(timeout_s * 4, 30.0)
    deadline = time.monotonic() + bound
    while len(values) + len(errors) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.05)
            (values if ok else errors)[rank] = value
            continue
        except queue.Empty:
            pass
        for r, p in enumerate(procs):
            if r in values or r in errors or p.is_alive() or r in reported:
                continue
            try:                       # its result may still be in the queue's pipe
                rank, ok, value = results.get(timeout=0.5)
                (values if ok else errors)[rank] = value
                continue
            except queue.Empty:
                pass
            reported.add(r)
            cause = f"died with exit code {p.exitcode}"
            if seg is not None:
                seg.set_status(r, FAILED, cause)
            errors[r] = (cause, False, "")
        if time.monotonic() > deadline:
            raise WorkerError(min(set(range(len(procs))) - set(values) - set(errors)),
                              f"did not finish within {bound:g} s")
    if errors:
        # the root cause: a worker's own failure, not a peer's report of it
        own = sorted(r for r, (_, reported_peer, _) in errors.items() if not reported_peer) or sorted(errors)
        r = own[0]
        raise WorkerError(r, errors[r][0] if errors[r][0].startswith("died") else f"failed: {errors[r][0]}")
    return [values[r] for r in range(len(procs))]
