"""Point-to-point send / recv over global shared memory (DESIGN.md 4, e.g. KV cache prefill -> decode).

A transfer of ``nbytes`` is cut into chunks of the ring's ``slot_bytes``; chunk ``i`` travels on lane ``i % cores``
(sender core c <-> receiver core c), as the ``j``-th chunk of that lane. Per lane, with ``seq`` = the lane's
cumulative chunk number (both sides count transfers in submission order):

    receiver                                              sender
    0. post readiness into the sender's ACK field:
       event id, transfer number, (zero-copy) app address
                                                          0. poll own ACK field until the receiver posted this
                                                             transfer; check its event id (mismatch: XcclError)
                                                          -- back-pressure: poll ACK head >= seq - slots + 1
                                                          1. mtu-in: app area -> UB (ping-pong)
                                                          2. mtu-out: UB -> receiver's ring slot (or the DMA
                                                             engine: app -> remote slot, no UB)
                                                          3. once the slot has landed: NOTIFY field on the
                                                             receiver = event id, chunk id, tail = seq + 1
    5. poll own NOTIFY tail >= seq + 1; check event id
       and sizes (mismatch: XcclError)
    6. mtu-in ring slot -> UB -> mtu-out app area
    7. once the slot is read: ACK head = seq + 1
                                                          4/8. sync mode: poll ACK head until every chunk of
                                                             the lane is consumed, then return
Asynchronous mode skips steps 4/8 (the sender returns once its data is out; completion is the receiver's).
Zero-copy mode writes straight into the receiver's app area at the address it posted; the receiver copies nothing.
Both sides must agree on it and on the number of cores: the sender announces both in the NOTIFY field and the
receiver checks them with the event id and the byte count (a mismatch is an XcclError, never a transfer that
completes with the wrong bytes or hangs on a lane the other side does not use).
Sends between one (src, dst) pair run in submission order, as do the receives. Transfers queued on one die at the
same time never share a vector core (a shared core would serialise two transfers that may wait on each other): each
launch takes the lowest-numbered cores no other pending transfer on its die holds, and a call that would need more
than the die has raises an XcclError naming the cores held and the limit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ascend_emu import GMTensor, kernel
from ascend_emu.arguments import check_int
from ascend_emu.errors import ArgumentError

from .comm import (ACK, FLAG_ZERO_COPY, NOTIFY, W_BYTES, W_EVENT, W_FLAGS, W_LANES, W_SEQ, W_TAIL, Communicator,
                   XcclError, check_event_id)

W_ADDR_LO, W_ADDR_HI = 6, 7


@dataclass
class _Plan:
    """Everything one side's kernel needs, computed on the host (addresses, counts, lane bases)."""
    app: object                 # the app-area tensor as flat uint8 bytes
    peer: int                   # the other die
    event_id: int
    seq: int                    # transfer number of this (src, dst) pair, from 1
    nbytes: int
    chunk: int                  # bytes per chunk (= ring slot bytes)
    n_chunks: int
    cores: int
    base: list                  # per lane: chunks this lane carried before this transfer
    ring: object                # receiver's ring (lanes, slots, slot_bytes) uint8, or None (zero-copy)
    notify: list                # per lane: the NOTIFY field on the receiver
    ack: list                   # per lane: the ACK field on the sender
    slots: int
    tile: int = 64 * 1024       # bytes per UB ping-pong tile (a slot may span several)
    path: str = "mtu"
    sync: bool = True
    zero_copy: bool = False
    app_die: int = 0
    aiv: tuple = ()             # the vector cores of this side's launch on its die
    extra: dict = field(default_factory=dict)


def _lane_chunks(p: _Plan, lane: int):
    return range(lane, p.n_chunks, p.cores)


@kernel(cores="aiv")
def send_kernel(ctx, p: _Plan):
    lane = ctx.block_idx
    ack, notify = p.ack[lane], p.notify[lane]
    # 0. wait until the receiver has posted this transfer, then check what it expects
    yield ctx.wait_gm(ack[W_SEQ], "ge", p.seq)
    posted = yield ctx.gm_load(ack)
    if posted[W_SEQ] == p.seq and posted[W_EVENT] != p.event_id:
        raise XcclError(f"send die {ctx.die} -> die {p.peer}: the receiver posted event id {posted[W_EVENT]}, "
                        f"this send has event id {p.event_id} (transfer {p.seq}, lane {lane})")
    if p.zero_copy:
        addr = (int(posted[W_ADDR_LO]) & 0xFFFFFFFF) | ((int(posted[W_ADDR_HI]) & 0xFFFFFFFF) << 32)
        remote_app = ctx.gm_at(p.peer, addr, (p.nbytes,), "uint8")
    ub = ctx.ub.alloc((2, p.tile), "uint8", name="pingpong") if p.path == "mtu" else None
    mover = "MTE3" if p.path == "mtu" else "DMA"
    base = p.base[lane]
    chunks = _lane_chunks(p, lane)
    n_full = p.nbytes // p.chunk                                     # only the last chunk may be partial
    app_rows = p.app[:n_full * p.chunk].reshape(n_full, p.chunk) if n_full else None
    head = base                   # chunks of this lane the receiver has consumed, as last seen
    j = 0
    while j < len(chunks):
        i = chunks[j]
        seq = base + j
        lo, n = i * p.chunk, min(p.chunk, p.nbytes - i * p.chunk)
        b = 1
        if p.path == "dma" and i < n_full:
            # one descriptor for a run of whole chunks: the DMA start-up is paid per descriptor, not per slot
            run = sum(1 for k in chunks[j:] if k < n_full)
            b = run if p.zero_copy else min(run, p.slots - seq % p.slots)
        if not p.zero_copy and seq >= head + p.slots:
            # back-pressure: a slot is free once the chunk it held before has been consumed
            seen = yield ctx.wait_gm(ack[W_TAIL], "ge", seq - p.slots + 1)
            head = int(seen)
        if not p.zero_copy:
            b = min(b, head + p.slots - seq)     # DMA: refill the slots known to be free, no more
        if p.zero_copy:
            dst = remote_app[lo:lo + n] if b == 1 else \
                remote_app[:n_full * p.chunk].reshape(n_full, p.chunk)[i:i + (b - 1) * p.cores + 1:p.cores]
        else:
            s0 = seq % p.slots
            dst = p.ring[lane, s0, :n] if b == 1 else p.ring[lane, s0:s0 + b]
        if p.path == "mtu":
            for k, t0 in enumerate(range(0, n, p.tile)):                # a slot in UB-sized pieces, ping-pong
                m = min(p.tile, n - t0)
                t = ub[(j + k) % 2, :m]
                yield ctx.copy_gm_to_ub(t, p.app[lo + t0:lo + t0 + m], pad=True)    # 1. mtu-in
                yield ctx.copy_ub_to_gm(dst[t0:t0 + m], t, pad=True)                 # 2. mtu-out to the peer
        else:
            src = p.app[lo:lo + n] if b == 1 else app_rows[i:i + (b - 1) * p.cores + 1:p.cores]
            yield ctx.dma_copy(dst, src)                                 # 2. DMA: app -> remote, no UB
        # 3. tail pointer, once the chunks have landed
        last = chunks[j + b - 1]
        yield ctx.gm_store(notify, _words(p.event_id, last, seq + b, p.n_chunks, p.nbytes, p.seq, _flags(p),
                                          p.cores), after=mover)
        j += b
    if p.sync:                     # 4/8. busy-poll the acknowledgement of every chunk of this lane
        yield ctx.wait_gm(ack[W_TAIL], "ge", base + len(_lane_chunks(p, lane)))


@kernel(cores="aiv")
def recv_kernel(ctx, p: _Plan):
    lane = ctx.block_idx
    ack, notify = p.ack[lane], p.notify[lane]
    base = p.base[lane]
    addr = p.app.addr
    # 0. post readiness (and where the data may go, for zero-copy) into the sender's ACK field
    yield ctx.gm_store(ack, _words(p.event_id, -1, base, p.n_chunks, p.nbytes, p.seq, addr, addr >> 32))
    ub = ctx.ub.alloc((2, p.tile), "uint8", name="pingpong") if not p.zero_copy else None
    for j, i in enumerate(_lane_chunks(p, lane)):
        seq = base + j
        yield ctx.wait_gm(notify[W_TAIL], "ge", seq + 1)              # 5. poll for new data
        if j == 0:
            f = yield ctx.gm_load(notify)
            if f[W_SEQ] == p.seq and (f[W_EVENT] != p.event_id or f[W_BYTES] != p.nbytes or
                                      f[W_FLAGS] != _flags(p) or f[W_LANES] != p.cores):
                sender_zc = bool(f[W_FLAGS] & FLAG_ZERO_COPY)
                raise XcclError(f"recv die {ctx.die} <- die {p.peer}: the sender announced event id {f[W_EVENT]}, "
                                f"{f[W_BYTES]} bytes, cores={f[W_LANES]} and zero_copy={sender_zc}; this recv "
                                f"expects event id {p.event_id}, {p.nbytes} bytes, cores={p.cores} and "
                                f"zero_copy={p.zero_copy} (transfer {p.seq}, lane {lane}): both sides must agree")
        lo, n = i * p.chunk, min(p.chunk, p.nbytes - i * p.chunk)
        if not p.zero_copy:
            slot = p.ring[lane, seq % p.slots]
            for k, t0 in enumerate(range(0, n, p.tile)):
                m = min(p.tile, n - t0)
                t = ub[(j + k) % 2, :m]
                yield ctx.copy_gm_to_ub(t, slot[t0:t0 + m], pad=True)                # 6. ring -> UB
                yield ctx.copy_ub_to_gm(p.app[lo + t0:lo + t0 + m], t, pad=True)     #    UB -> app area
        # 7. acknowledge: the slot may be reused once it has been read
        yield ctx.gm_store(ack, _words(p.event_id, i, seq + 1, p.n_chunks, p.nbytes, p.seq, addr, addr >> 32),
                           after="MTE2" if not p.zero_copy else None)


def _flags(p: _Plan) -> int:
    """The sender's mode word of a NOTIFY field (the receiver checks it against its own)."""
    return FLAG_ZERO_COPY if p.zero_copy else 0


def _words(*vals) -> np.ndarray:
    """A 32-byte field's eight int32 words (values wrap modulo 2^32, e.g. the halves of a 64-bit address)."""
    return np.array(vals, dtype=np.int64).astype(np.int32)


class Transfer:
    """Handle of a queued send or recv: ``wait()`` runs the pod until all queued work is done."""

    def __init__(self, comm: Communicator, launch, kind: str):
        self.comm = comm
        self.launch = launch
        self.kind = kind
        self.result = None

    @property
    def done(self) -> bool:
        return self.launch.done

    @property
    def modeled_us(self) -> float | None:
        """Start-to-end of this side's kernel (after it ran)."""
        if not self.launch.done:
            return None
        return (self.launch.end_ps - self.launch.start_ps) / 1e6

    def wait(self):
        """Run the simulation until every queued launch finished; returns the RunResult."""
        if not self.done:
            self.result = self.comm.pod.synchronize()
        return self.result


def _flat_bytes(t, arg):
    if not t.is_contiguous:
        raise ArgumentError(f"{arg} {t.describe()} must be contiguous to be sent")
    return t.reshape(-1).view_as("uint8") if t.dtype.itemsize != 1 or t.ndim != 1 else t.view_as("uint8")


def _free_cores(comm: Communicator, die: int, key, cores: int, name: str) -> tuple:
    """The ``cores`` lowest-numbered vector cores of ``die`` that no other pending transfer on the die holds
    (launches of one (pair, side) run in submission order, so they may reuse each other's cores)."""
    st = _state(comm)
    pending = st["pending"][die] = [(k, aiv, la) for k, aiv, la in st["pending"].get(die, []) if not la.done]
    held = {}
    for k, aiv, la in pending:
        if k != key:
            held.update({c: la.name for c in aiv})
    total = comm.pod.profile.aiv_per_die
    free = [c for c in range(total) if c not in held]
    if len(free) < cores:
        users = ", ".join(sorted(set(held.values())))
        raise XcclError(f"{name}: cores={cores}, but die {die} has {total} vector cores and {len(held)} of them are "
                        f"held by transfers still queued on it ({users}); concurrent transfers never share a core: "
                        f"wait() for the earlier ones or use at most {len(free)} cores")
    return tuple(free[:cores])


def _state(comm: Communicator) -> dict:
    return comm.__dict__.setdefault("_p2p", {"streams": {}, "last": {}, "pending": {}})


def _launch(comm: Communicator, die: int, key, kernel, plan: _Plan, numeric: bool, name: str):
    """Launch one side of a transfer on the cores its plan holds, after the previous launch of its (pair, side)."""
    st = _state(comm)
    s = st["streams"].get((die, plan.aiv))
    if s is None:
        s = st["streams"][(die, plan.aiv)] = comm.pod.stream(die, aiv=list(plan.aiv))
    prev = st["last"].get(key)
    la = s.launch(kernel, (plan,), numeric=numeric, name=name, after=[prev] if prev is not None else [])
    st["last"][key] = la
    st["pending"][die].append((key, plan.aiv, la))
    return la


def _plan(comm: Communicator, app, src_die, dst_die, event_id, cores, side, path="mtu", sync=True,
          zero_copy=False) -> tuple[_Plan, tuple, str]:
    """Check one side's arguments, take its cores, then (nothing can fail past this point) advance the pair's
    sequence and lane counters. Returns (plan, stream key, launch name)."""
    arg = "src" if side == "send" else "dst"
    if not isinstance(app, GMTensor):
        raise ArgumentError(f"{arg} must be a GM tensor (pod.alloc / pod.to_gm), got {type(app).__name__}")
    event_id = check_event_id(event_id)
    check_int(cores, "cores", 1, comm.lanes)
    if path not in ("mtu", "dma"):
        raise ArgumentError(f"path={path!r}: use 'mtu' or 'dma'")
    comm.rank(src_die), comm.rank(dst_die)
    if src_die == dst_die:
        raise ArgumentError(f"send/recv between die {src_die} and itself: use a local copy")
    flat = _flat_bytes(app, arg)
    nbytes = flat.numel
    if nbytes == 0:
        raise ArgumentError(f"{arg}: a transfer of 0 bytes")
    die, peer = (src_die, dst_die) if side == "send" else (dst_die, src_die)
    key = (side, src_die, dst_die)
    name = (f"send d{src_die}->d{dst_die}" if side == "send" else f"recv d{dst_die}<-d{src_die}") + f" ev{event_id}"
    aiv = _free_cores(comm, die, key, cores, name)
    chunk = comm.slot_bytes
    n_chunks = -(-nbytes // chunk)
    seq = comm.next_seq(src_die, dst_die, side)
    lane_key = ("lanes", src_die, dst_die, side)
    counts = comm.__dict__.setdefault("_lane_counts", {}).setdefault(lane_key, [0] * comm.lanes)
    base = list(counts)
    for c in range(cores):
        counts[c] += len(range(c, n_chunks, cores))
    plan = _Plan(app=flat, peer=peer, event_id=event_id, seq=seq,
                 nbytes=nbytes, chunk=chunk, n_chunks=n_chunks, cores=cores, base=base,
                 ring=None if zero_copy else comm.ring(dst_die, src_die),
                 notify=[comm.field(dst_die, src_die, c, NOTIFY) for c in range(cores)],
                 ack=[comm.field(src_die, dst_die, c, ACK) for c in range(cores)],
                 slots=comm.slots, tile=min(chunk, comm.ub_tile), path=path, sync=sync, zero_copy=zero_copy,
                 app_die=app.die, aiv=aiv)
    return plan, key, name


def send(comm: Communicator, src, dst_die: int, event_id: int, *, cores: int = 1, path: str = "mtu",
         sync: bool = True, zero_copy: bool = False, numeric: bool = True) -> Transfer:
    """Queue a send of GM tensor ``src`` (on its die) to ``dst_die``; returns a Transfer handle.

    ``cores``: computing cores (lanes) on each side; ``path``: "mtu" (UB ping-pong) or "dma" (DMA engine);
    ``sync``: busy-poll the receiver's acknowledgement before returning; ``zero_copy``: write into the receiver's
    app area directly. The matching ``recv`` must use the same ``cores``, ``zero_copy`` and byte count."""
    if zero_copy and not sync:
        raise ArgumentError("zero_copy needs sync=True: the receiver learns its data arrived from the tail")
    p, key, name = _plan(comm, src, getattr(src, "die", None), dst_die, event_id, cores, "send", path, sync,
                         zero_copy)
    return Transfer(comm, _launch(comm, p.app_die, key, send_kernel, p, numeric, name), "send")


def recv(comm: Communicator, dst, src_die: int, event_id: int, *, cores: int = 1, zero_copy: bool = False,
         numeric: bool = True) -> Transfer:
    """Queue a receive into GM tensor ``dst`` (on its die) from ``src_die``; returns a Transfer handle."""
    p, key, name = _plan(comm, dst, src_die, getattr(dst, "die", None), event_id, cores, "recv",
                         zero_copy=zero_copy)
    return Transfer(comm, _launch(comm, p.app_die, key, recv_kernel, p, numeric, name), "recv")
