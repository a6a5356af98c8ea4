"""Stateless expert service (DESIGN.md 4): attention clients post micro-batches into slots on expert servers.

    svc = ExpertService(pod, clients=[0, 1, 2], servers=[3, 4, 5, 6], num_experts=8, hidden=64, top_k=2,
                        max_tokens=8, weights=w)                     # w [8, 64, 64] bf16; monitor on die 7
    res = svc.run(topk_ids, x, topk_weights, kill=[(4, 60.0)])       # [C, R, B, K], [C, R, B, H], [C, R, B, K]
    res.out, res.completions, res.resends, res.throughput_per_us, res.slot_states

Roles. ``clients`` are attention dies (one AIV each runs the client kernel), ``servers`` are expert dies
(``server_cores`` AICs each run the server loop: poll, batch, grouped GEMM on the cube, write back), ``monitor`` is one
AIV on a die of its own (default: the first die of the pod that is neither) that tracks heartbeats. Each expert ``e``
has ``replicas`` copies on distinct servers, ``placement[e] = [s0, s1, ...]`` (host-planned, ``replica_placement``
spreads each server's fallbacks over the others): a client sends a row to the first replica it believes alive, and to
the next one if that server dies. Expert ``e`` computes ``y = bf16(x @ W_e)`` (bf16 in, fp32 accumulate over 128-wide
K tiles in L0C, bf16 out through the fixpipe).

Client kernel, per request (``tokens`` x ``top_k`` rows, row ``t * top_k + k`` for token ``t``'s k-th expert):
  1. gm_load the request's expert ids and its own health table; rows go to the first live replica of their expert,
     sorted by (expert, row) per server so every expert is one contiguous run of the slot.
  2. per server: gather the token rows into UB and write them into the slot payload (remote mtu-out), the expert id of
     each row, the header, then the state field ``[1, seq]`` ordered after all of it (``after="all"``); server by
     server, so the first computes while the next is fed.
  3. per server: poll ``state[0:2] == [2, seq]`` (the sequence number is the dedupe key: a stale "done" of an older
     send never matches) in heartbeat-long bounded waits (``on_timeout="return"``). A server is dead once the
     monitor's health table says so, or its heartbeat counter did not move over a whole ``poll_timeout_us``; its rows
     go back to step 1 and are resent to the next live replica (a resend).
  4. read the result rows back (remote mtu-in), scatter them into a local ``[tokens * top_k, H]`` buffer, reset the
     slot to ``[0, seq]``. Combine: ``out[t] = bf16(((w0 * y0) + w1 * y1) + ...)`` in fp32 on the vector unit, in k
     order, so the output does not depend on which replica computed a row. Then the completion record.
  5. after its last request: "finished" in its heartbeat row, its beat core stopped, state ``[3, 0, 1]`` (offline,
     reason 1 = finished) on every server.
Server kernel, AIC 0 (the leader): watch its whole state array (``wait_gm(..., "ne", known, how="any")``, bounded by
the heartbeat period), batch every slot in state 1 and publish the batch (number + the send sequence number of each
slot in it) to the other AICs: per hosted expert, the runs of every ready slot are stacked in one L1 tile (grouped GEMM: the
expert's weight tiles are loaded once per batch and M tile), mmad, fixpipe bf16 straight into each slot's result
area; the work units (expert, M tile, N tile) are dealt round-robin over the AICs, which count into a die-local join
counter behind their fixpipe writes. Then per slot ``atomic_cas(state, 1 -> 2)`` ordered after the leader's own
fixpipe writes.
A slot in state 3 is released: reset to ``[0, 0, reason]``, any pending work dropped (a CAS that finds 3 releases
too), the client counted gone. The server exits when every client is gone.
Monitor kernel: every ``heartbeat_us`` reads the heartbeat table (one local load), marks a member dead when its
counter has not moved for ``dead_after_us`` (counted for a member that never beat from when its first beat could
have landed: the monitor's start plus the path latency from its die): a dead server in every client's health table, a dead client as state
``[3, 0, 2]`` (offline, reason 2 = dead) in its slot on every server. It exits when every member finished or died.

Beat kernel, one AIV (``BEAT_AIV``) on every server and client die: post the member's heartbeat (word 0 of its row),
sleep ``heartbeat_us`` in a bounded wait on the member's stop flag, again, until the member sets the flag at its end.
Heartbeats say the die is alive, not how far its work got: a member busy with a long batch or a large payload beats
on time (heartbeats posted by the working core between its steps made a long step look like a death), and a killed
die stops. ``silence_bounds`` gives the longest gap between a healthy member's beats and the monitor's read period;
the constructor requires ``poll_timeout_us`` above the first (a client compares two reads of a server's heartbeat
that far apart) and ``dead_after_us`` above their sum, so a fault-free run never declares a live member dead.

GM layout (int32 32-byte fields unless noted; C clients, S servers, ``rows = max_tokens * top_k``):
  server die: ``svc.state``  [C, 8]   w0 state (0 empty, 1 client wrote, 2 server done, 3 client offline), w1 send
                                      sequence number, w2 offline/release reason (1 finished, 2 dead)
              ``svc.header`` [C, 8]   w0 layer id, w1 seq, w2 request id, w3 tokens, w4 rows, w5 client, w6 attempt
              ``svc.eid``    [C, rows]          expert id of each payload row
              ``svc.x``      [C, rows, H] bf16  payload hidden rows; ``svc.y`` [C, rows, H] bf16 result rows
              ``svc.w``      [hosted, H, H] bf16 expert weights; ``svc.stats`` [C, 8] w0 sends served, w1 rows served,
                                      w2 batches, w3 release reason, w4 work dropped at the release (1 a request
                                      it never answered, 2 results the client never read back)
              ``svc.batch``  [2 + C, padded to 8] w0 batch number, w1 stop, w2.. the send sequence number of
                                      each slot in the batch, 0 = not in it (leader -> the other AICs)
              ``svc.join``   [8]      w0 follower joins (atomic add)
  every server and client die: ``svc.beat_stop`` [8] w0 1 = the member is done and its beat core stops
  client die: ``svc.health`` [S, 8]   w0 1 = server dead, w1 detection time (ns); ``svc.ybuf`` [rows, H] bf16;
              per run ``svc.done`` [R, 8]: w0 completions (atomic add), w1 sends, w2 resends, w3 completion time (ns);
              ``svc.src`` [R, rows]: server die that delivered each row
  monitor:    ``svc.hb``     [S + C, 8] w0 heartbeat counter, w1 1 = finished, w2 finish time (ns);
              ``svc.log``    [S + C, 8] w0 1 = declared dead, w1 time (ns)

modeled as: the state byte is word 0 of an int32 32-byte field; one MoE layer (its id travels in the header); one AIV
per client (one outstanding request per client); the server's vector cores stay idle; a death is permanent (a client
never sends to a server it declared dead again); a
kernel reads the system counter for time stamps (``GetSystemCycle``); the router weights stay on the client, which
applies them in its combine (the server returns unweighted rows), so a row's result does not depend on the replica;
persistent kernels are started before the service opens (no communication start-up); a server's GM stays readable
after its die is killed (a client that saw "done" before the kill still reads its rows back); the monitor's die must
stay alive (it is the heartbeat table's home, and nobody else judges deaths): ``run`` refuses to kill it, also when
it is a client's die, and a run whose monitor died anyway raises an ``XcclError`` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.arguments import check_int
from ascend_emu.errors import ArgumentError, DeadlockError, ShapeError
from ascend_emu.timing import Paths

from .comm import XcclError, integer_ids

EMPTY, WRITTEN, DONE, OFFLINE = 0, 1, 2, 3
FINISHED, DEAD = 1, 2                                   # offline reasons
H_LAYER, H_SEQ, H_REQ, H_TOKENS, H_ROWS, H_CLIENT, H_ATTEMPT = range(7)
MT, KT, NT = 128, 128, 128                              # cube tiles: L0A/L0B 2 x 32 KiB, L0C 2 x 64 KiB
IO_BYTES = 48 * 1024                                    # client UB: each of the two staging slots
BEAT_AIV = 2                                            # the vector core that posts a member's heartbeats


def _field(*words) -> np.ndarray:
    f = np.zeros(8, np.int32)
    f[:len(words)] = words
    return f


def _ns(ctx) -> int:
    return int(round(ctx.now_us * 1000))


# ============================================================================================== server
@kernel(cores="aic")
def server_kernel(ctx, job):
    """Poll the slots, batch every slot in state 1, grouped GEMM per hosted expert, write back, state 2.

    AIC 0 leads (polls, releases, publishes each batch in ``svc.batch``, joins, sets the states); the work units
    (expert, M tile, N tile) of a batch are dealt round-robin over the server's AICs."""
    s = job.servers.index(ctx.die)
    H = job.hidden
    kt, nt = min(KT, H), min(NT, H)
    bufs = (ctx.l1.alloc((2, MT, kt), "bf16", name="x_l1"), ctx.l1.alloc((2, kt, nt), "bf16", name="w_l1"),
            ctx.l0a.alloc((2, MT, kt), "bf16", name="x_l0"), ctx.l0b.alloc((2, kt, nt), "bf16", name="w_l0"),
            ctx.l0c.alloc((2, MT, nt), "fp32", name="acc"))
    me = {"step": [0, 0], "batch": 0}
    if ctx.block_idx == 0:
        yield from _server_leader(ctx, job, s, bufs, me)
    else:
        yield from _server_follower(ctx, job, s, bufs, me)


def _server_leader(ctx, job, s, bufs, me):
    st, C = job.state[s], job.num_clients
    n_aic = ctx.block_num
    known = np.zeros((C, 8), np.int32)
    gone = [False] * C
    stats = np.zeros((C, 8), np.int32)
    while not all(gone):
        seen = yield ctx.wait_gm(st, "ne", known.copy(), how="any", timeout_us=None)
        seen = np.asarray(seen).reshape(C, 8)
        ready = []
        for c in range(C):
            owed = known[c, 0] == DONE                   # results out, the client's reset not seen yet
            known[c] = seen[c]
            if gone[c]:
                continue
            if seen[c, 0] == OFFLINE:
                reason = int(seen[c, 2])                 # a finished client collected everything first
                held = DONE if owed and reason != FINISHED else EMPTY
                yield from _release(ctx, job, s, c, reason, held, stats)
                known[c] = _field(EMPTY, 0, int(seen[c, 2]))
                gone[c] = True
            elif seen[c, 0] == WRITTEN:
                ready.append(c)
        if not ready:
            continue
        me["batch"] += 1
        if n_aic > 1:                  # publish the batch: number, stop flag, send sequence number of each slot
            desc = np.zeros(job.batch[s].shape[0], np.int32)
            desc[0] = me["batch"]
            desc[2 + np.array(ready)] = seen[ready, 1]
            yield ctx.gm_store(job.batch[s], desc)
        rows = yield from _batch_rows(ctx, job, s, ready, seen[:, 1])
        yield from _grouped_gemm(ctx, job, s, rows, bufs, me)
        if n_aic > 1:                                    # join: every follower's results are visible
            yield ctx.wait_gm(job.join[s][0:1], "ge", me["batch"] * (n_aic - 1), timeout_us=None)
        for i, c in enumerate(ready):
            # ordered after the batch's results: the FIXP pipe is in order and its last write lands last
            old = yield ctx.atomic_cas(st[c, 0:1], WRITTEN, DONE, after="FIXP" if i == 0 else None)
            stats[c, 2] += 1
            if old == WRITTEN:
                known[c, 0] = DONE
                stats[c, 0] += 1
                stats[c, 1] += len(rows[c])
                yield ctx.gm_store(job.stats[s][c], stats[c].copy())
            elif old == OFFLINE:                           # the client went offline while we computed
                f = yield ctx.gm_load(st[c])
                yield from _release(ctx, job, s, c, int(f[2]), WRITTEN, stats)
                known[c] = _field(EMPTY, 0, int(f[2]))
                gone[c] = True
    if n_aic > 1:
        yield ctx.gm_store(job.batch[s][0:2], np.array([me["batch"] + 1, 1], np.int32))
    yield from _finish_beats(ctx, job, s)


def _server_follower(ctx, job, s, bufs, me):
    """Wait for the leader's next batch, compute this AIC's share of the units, count into the join."""
    while True:
        yield ctx.wait_gm(job.batch[s][0:1], "ge", me["batch"] + 1, timeout_us=None)
        desc = np.asarray((yield ctx.gm_load(job.batch[s])))
        if desc[1]:
            return
        me["batch"] = int(desc[0])
        seqs = desc[2:2 + job.num_clients]       # the leader's snapshot: a slot may go offline meanwhile
        ready = [int(c) for c in np.flatnonzero(seqs)]
        rows = yield from _batch_rows(ctx, job, s, ready, seqs)
        yield from _grouped_gemm(ctx, job, s, rows, bufs, me)
        yield ctx.atomic_add(job.join[s][0:1], 1, after="FIXP")


def _batch_rows(ctx, job, s, ready, seqs):
    """{client: expert id of each payload row} of the batch, read from the headers and expert-id lists."""
    hdr = yield ctx.gm_load(job.header[s])
    eids = yield ctx.gm_load(job.eid[s])
    rows = {}
    for c in ready:
        if hdr[c, H_SEQ] != seqs[c]:
            raise XcclError(f"server die {ctx.die}: slot of client {c} holds state seq {seqs[c]} but header "
                            f"seq {hdr[c, H_SEQ]} (the header must land before the state)")
        rows[c] = np.asarray(eids[c, :int(hdr[c, H_ROWS])], np.int64)
    return rows


def _finish_beats(ctx, job, m: int):
    """Member ``m`` is done: "finished" in its heartbeat row (the monitor stops judging it), then its beat core's stop
    flag, ordered after every earlier write of this core."""
    yield ctx.gm_store(job.hb[m][1:3], np.array([1, _ns(ctx)], np.int32), after="all")
    yield ctx.gm_store(job.beat_stop[m], _field(1))


@kernel(cores="aiv")
def beat_kernel(ctx, job, m: int):
    """The heartbeat of member ``m`` (server index, or S + client index) from a vector core of its own die: word 0 of
    its row in ``svc.hb`` counts up every ``heartbeat_us`` until the member raises its stop flag. It says the die is
    alive (a killed die stops beating; a busy one does not), so its period is the heartbeat, whatever the work."""
    beat = 0
    while True:
        beat += 1
        yield ctx.gm_store(job.hb[m][0:1], np.array([beat], np.int32))
        if (yield ctx.wait_gm(job.beat_stop[m][0:1], "ne", 0, timeout_us=job.heartbeat_us,
                              on_timeout="return")) is not None:
            return


def _release(ctx, job, s, c, reason, held, stats):
    """Slot of client ``c`` goes back to empty; the reason (1 finished, 2 dead) stays in the state field."""
    stats[c, 3], stats[c, 4] = reason, held
    yield ctx.gm_store(job.state[s][c], _field(EMPTY, 0, reason))
    yield ctx.gm_store(job.stats[s][c], stats[c].copy())


def _grouped_gemm(ctx, job, s, rows, bufs, me):
    """For each hosted expert: the runs of every ready slot stacked in L1 tiles of MT rows, y = x @ W_e."""
    a_l1, b_l1, a_l0, b_l0, acc = bufs
    step = me["step"]
    H = job.hidden
    kt, nt = min(KT, H), min(NT, H)
    x, y, w = job.px[s], job.py[s], job.w[s]
    local = job.local_index[s]
    runs: dict = {}
    for c in sorted(rows):
        e = rows[c]
        if len(e) == 0:
            continue
        cuts = np.flatnonzero(np.diff(e)) + 1
        for r0, r1 in zip(np.r_[0, cuts], np.r_[cuts, len(e)]):
            ex = int(e[r0])
            if ex not in local:
                raise XcclError(f"server die {ctx.die}: client {c} sent expert {ex}, this server hosts "
                                f"{sorted(local)}")
            runs.setdefault(ex, []).append((c, int(r0), int(r1 - r0)))
    unit = 0
    for ex in sorted(runs):
        el = local[ex]
        pieces, tiles, m = [], [], 0               # cut the runs into M tiles of at most MT rows
        for c, r0, n in runs[ex]:
            while n:
                take = min(n, MT - m)
                pieces.append((c, r0, take, m))
                m, r0, n = m + take, r0 + take, n - take
                if m == MT:
                    tiles.append((pieces, m))
                    pieces, m = [], 0
        if m:
            tiles.append((pieces, m))
        yield ctx.scalar(4 * len(runs[ex]))          # run bookkeeping on the scalar unit
        for pieces, m in tiles:
            for n0 in range(0, H, nt):
                unit += 1
                if (unit - 1) % ctx.block_num != ctx.block_idx:
                    continue
                j = step[1] % 2
                step[1] += 1
                for kk, k0 in enumerate(range(0, H, kt)):
                    b = step[0] % 2
                    step[0] += 1
                    for c, r0, n, m0 in pieces:
                        yield ctx.copy_gm_to_l1(a_l1[b, m0:m0 + n], x[c, r0:r0 + n, k0:k0 + kt])
                    yield ctx.copy_gm_to_l1(b_l1[b], w[el, k0:k0 + kt, n0:n0 + nt])
                    yield ctx.copy_l1_to_l0a(a_l0[b, :m], a_l1[b, :m])
                    yield ctx.copy_l1_to_l0b(b_l0[b], b_l1[b])
                    yield ctx.mmad(acc[j, :m], a_l0[b, :m], b_l0[b], accumulate=kk > 0)
                for c, r0, n, m0 in pieces:
                    yield ctx.copy_l0c_to_gm(y[c, r0:r0 + n, n0:n0 + nt], acc[j, m0:m0 + n])


# ============================================================================================== client
@kernel(cores="aiv")
def client_kernel(ctx, job):
    """Send each request's rows to live replicas, await, resend on server death, read back, combine."""
    c = job.clients.index(ctx.die)
    S, K, H = len(job.servers), job.top_k, job.hidden
    rows_max = job.max_tokens * K
    rx = max(1, min(rows_max, IO_BYTES // (2 * H)))
    io = ctx.ub.alloc((2, rx, H), "bf16", name="io")
    et = ctx.ub.alloc((-(-rows_max // 8) * 8,), "int32", phantom=False, name="eids")
    rt, hc = job.combine_tiling
    yk = ctx.ub.alloc((rt * K, hc), "bf16", name="y_rows")
    f = ctx.ub.alloc((rt * K, hc), "fp32", name="acc")
    o = ctx.ub.alloc((rt, hc), "bf16", name="out")
    wt = ctx.ub.alloc((rt * K, 1), "fp32", name="w")
    me = {"dead": [False] * S, "seq": 0, "io": 0}
    for r in range(job.num_requests):
        ids = np.asarray((yield ctx.gm_load(job.ids[c][r])), np.int64).reshape(-1)       # [B * K]
        B = len(ids) // K
        pending = list(range(len(ids)))
        src = np.full(len(ids), -1, np.int32)            # server die that delivered each row
        sends = resends = attempt = 0
        while pending:
            yield from _refresh_health(ctx, job, c, me)
            groups: dict = {}
            for row in pending:
                live = [s for s in job.placement[ids[row]] if not me["dead"][s]]
                if not live:
                    raise XcclError(f"client die {ctx.die}: expert {ids[row]} (request {r}) has no live replica "
                                    f"among servers {[job.servers[s] for s in job.placement[ids[row]]]}")
                groups.setdefault(live[0], []).append(row)
            seqs = {}
            for s in sorted(groups):                 # server by server: the first starts while the next is fed
                g = sorted(groups[s], key=lambda q: (ids[q], q))
                groups[s] = g
                me["seq"] += 1
                seqs[s] = me["seq"]
                yield from _send(ctx, job, c, s, r, g, ids, B, attempt, me, io, et)
                sends += 1
                resends += attempt > 0
            failed = []
            for s in sorted(groups):
                ok = yield from _await(ctx, job, c, s, seqs[s], me)
                if ok:
                    if (src[groups[s]] >= 0).any():
                        raise XcclError(f"client die {ctx.die}: request {r} rows {groups[s]} delivered twice")
                    src[groups[s]] = job.servers[s]
                    yield from _read_back(ctx, job, c, s, groups[s], seqs[s], me, io)
                else:
                    me["dead"][s] = True
                    failed += groups[s]
            pending = sorted(failed)
            attempt += 1
        yield from _combine(ctx, job, c, r, B, (yk, f, o, wt), me)
        yield ctx.atomic_add(job.done[c][r, 0:1], 1, after="all")
        yield ctx.gm_store(job.done[c][r, 1:4], np.array([sends, resends, _ns(ctx)], np.int32))
        yield ctx.gm_store(job.src[c][r, :len(ids)], src)
    yield from _finish_beats(ctx, job, S + c)
    for s in range(S):                               # offline, finished: the servers release the slots
        yield ctx.gm_store(job.state[s][c], _field(OFFLINE, 0, FINISHED))


def _refresh_health(ctx, job, c, me):
    h = yield ctx.gm_load(job.health[c][:, 0])
    for s, v in enumerate(np.asarray(h).reshape(-1)):
        if v:
            me["dead"][s] = True


def _send(ctx, job, c, s, r, rows, ids, B, attempt, me, io, et):
    """Payload rows (gathered token rows), expert ids, header, then the state field ordered after them."""
    K, n = job.top_k, len(rows)
    x = job.x[c][r]
    rx = io.shape[1]
    for i0 in range(0, n, rx):
        m = min(rx, n - i0)
        t = io[me["io"] % 2, :m]
        me["io"] += 1
        yield ctx.gather_gm_to_ub(t, x, [q // K for q in rows[i0:i0 + m]])
        yield ctx.copy_ub_to_gm(job.px[s][c, i0:i0 + m], t)
    yield ctx.set_value(et, slice(0, n), ids[rows].astype(np.int32))
    yield ctx.copy_ub_to_gm(job.eid[s][c, 0:n], et[0:n], pad=True)
    yield ctx.gm_store(job.header[s][c], _field(job.layer, me["seq"], r, B, n, c, attempt))
    yield ctx.gm_store(job.state[s][c], _field(WRITTEN, me["seq"]), after="all")


def _await(ctx, job, c, s, seq, me):
    """Bounded polls for [2, seq]; False once server ``s`` is known dead (health table or a silent heartbeat)."""
    slot = job.state[s][c, 0:2]
    want = np.array([DONE, seq], np.int32)
    checked_t, checked_hb = ctx.now_us, None
    while True:
        v = yield ctx.wait_gm(slot, "eq", want, timeout_us=job.heartbeat_us, on_timeout="return")
        if v is not None:
            return True
        h = yield ctx.gm_load(job.health[c][s, 0:1])
        if int(np.asarray(h).reshape(-1)[0]):
            return False
        if ctx.now_us - checked_t >= job.poll_timeout_us:
            beat = int(np.asarray((yield ctx.gm_load(job.hb[s][0:1]))).reshape(-1)[0])
            if checked_hb is not None and beat == checked_hb and beat > 0:
                return False                        # not one heartbeat over a whole poll timeout (0: not begun)
            checked_t, checked_hb = ctx.now_us, beat


def _read_back(ctx, job, c, s, rows, seq, me, io):
    n, rx = len(rows), io.shape[1]
    for i0 in range(0, n, rx):
        m = min(rx, n - i0)
        t = io[me["io"] % 2, :m]
        me["io"] += 1
        yield ctx.copy_gm_to_ub(t, job.py[s][c, i0:i0 + m])
        yield ctx.scatter_ub_to_gm(job.ybuf[c], t, rows[i0:i0 + m])
    yield ctx.gm_store(job.state[s][c], _field(EMPTY, seq), after="MTE2")


def _combine(ctx, job, c, r, B, bufs, me):
    """out[t] = bf16(sum_k w[t, k] * y[t, k]) in fp32, k in order."""
    yk, f, o, wt = bufs
    K, H = job.top_k, job.hidden
    rt, hc = job.combine_tiling
    for t0 in range(0, B, rt):
        n = min(rt, B - t0)
        w = wt[:n * K]
        yield ctx.copy_gm_to_ub(w, job.w_route[c][r, t0 * K:(t0 + n) * K], pad=True)
        for c0 in range(0, H, hc):
            y = yk[:n * K]
            yield ctx.copy_gm_to_ub(y, job.ybuf[c][t0 * K:(t0 + n) * K, c0:c0 + hc])
            f3 = f[:n * K].reshape(n, K, hc)
            yield ctx.vec.cast(f[:n * K], y)
            yield ctx.vec.mul(f3, f3, w.reshape(n, K, 1))
            for k in range(1, K):
                yield ctx.vec.add(f3[:, 0], f3[:, 0], f3[:, k])
            yield ctx.vec.cast(o[:n], f3[:, 0])
            yield ctx.copy_ub_to_gm(job.out[c][r, t0:t0 + n, c0:c0 + hc], o[:n])


# ============================================================================================== monitor
@kernel(cores="aiv")
def monitor_kernel(ctx, job):
    """Heartbeat tracking: mark servers dead in every health table, clients offline (reason 2) on every server."""
    S, C = len(job.servers), job.num_clients
    last = np.zeros(S + C, np.int64)               # counter 0: no beat yet; the first can land one path latency in
    last_t = ctx.now_us + np.asarray(job.first_beat_us)
    status = [0] * (S + C)                         # 0 alive, 1 finished, 2 dead
    while True:
        v = np.asarray((yield ctx.gm_load(job.hb)))
        now = ctx.now_us
        for m in range(S + C):
            if status[m]:
                continue
            if v[m, 1]:
                status[m] = 1
            elif v[m, 0] != last[m]:
                last[m], last_t[m] = v[m, 0], now
            elif now - last_t[m] > job.dead_after_us:
                status[m] = 2
                yield ctx.gm_store(job.log[m], _field(1, _ns(ctx)))
                if m < S:
                    for c in range(C):
                        yield ctx.gm_store(job.health[c][m], _field(1, _ns(ctx)))
                else:
                    for s in range(S):
                        if status[s] != 2:
                            yield ctx.gm_store(job.state[s][m - S], _field(OFFLINE, 0, DEAD))
        if all(status):
            return
        yield ctx.wait_gm(job.hb[:, 0], "lt", -1, timeout_us=job.heartbeat_us, on_timeout="return")   # sleep


# ============================================================================================== host API
@dataclass
class _Job:
    servers: list
    clients: list
    placement: list                 # [E] -> list of server indices (replica order)
    local_index: list               # [S] -> {expert: index in svc.w}
    hidden: int
    top_k: int
    max_tokens: int
    layer: int
    heartbeat_us: float
    poll_timeout_us: float
    dead_after_us: float
    combine_tiling: tuple
    state: list
    header: list
    eid: list
    px: list
    py: list
    w: list
    stats: list
    batch: list                     # [S] -> [2 + C padded to 8] int32: batch number, stop, slot mask
    join: list                      # [S] -> [8] int32: follower AICs' join counter
    health: list
    ybuf: list
    hb: object
    log: object
    beat_stop: list                 # [S + C] -> [8] int32 on the member's die: w0 1 = its beat core may stop
    first_beat_us: list             # [S + C] modeled us from a beat's post to its landing on the monitor's die
    x: list = field(default_factory=list)          # per run: [C] -> [R, B, H] bf16 on the client
    ids: list = field(default_factory=list)        # [C] -> [R, B, K] int32
    w_route: list = field(default_factory=list)    # [C] -> [R, B * K, 1] fp32
    out: list = field(default_factory=list)        # [C] -> [R, B, H] bf16
    done: list = field(default_factory=list)       # [C] -> [R, 8] int32
    src: list = field(default_factory=list)        # [C] -> [R, B * K] int32: server die that delivered each row
    num_requests: int = 0

    @property
    def num_clients(self) -> int:
        return len(self.clients)


@dataclass
class ServiceResult:
    """What one service run produced (times in modeled us, from the pod's clock).

    ``out``: [C, R, B, H] bf16 (None in timing-only runs); ``completions`` [C, R] int (1 = completed once, 0 = lost
    with its killed client); ``completion_us`` [C, R] (NaN if not completed); ``sends`` / ``resends`` [C, R]
    sub-requests sent / resent to a replica; ``start_us`` first client start; ``span_us`` start to last completion;
    ``throughput_per_us`` completed requests / span; ``slot_states`` / ``slot_reasons`` {server die: [C]} words 0 and
    2 of every slot's state field at the end; ``served`` {server die: [C]} sends served; ``release_reason``
    {server die: [C]} (0 never released, 1 client finished, 2 client declared dead) and ``release_held`` the work
    dropped then (0 none, 1 a request never answered, 2 results never read back); ``row_server`` [C, R, B * K] the server die that delivered each row (0 for
    requests never completed); ``dead`` {die: detection us} by the monitor; ``run`` the RunResult."""
    out: np.ndarray | None
    completions: np.ndarray
    completion_us: np.ndarray
    sends: np.ndarray
    resends: np.ndarray
    start_us: float
    span_us: float
    throughput_per_us: float
    slot_states: dict
    slot_reasons: dict
    served: dict
    release_reason: dict
    release_held: dict
    row_server: np.ndarray
    dead: dict
    run: object


def replica_placement(num_experts: int, num_servers: int, replicas: int) -> np.ndarray:
    """[E, replicas] server indices. The primary of expert ``e`` is server ``p = e % S``; replica ``r >= 1`` sits at
    ``(p + 1 + (e // S + r - 1) % (S - 1)) % S``, so the experts of one server fall back to different servers (a dead
    server's load spreads instead of doubling one neighbour's). Distinct per expert while ``replicas <= S``."""
    S = num_servers
    return np.array([[e % S if r == 0 else (e % S + 1 + (e // S + r - 1) % (S - 1)) % S for r in range(replicas)]
                     for e in range(num_experts)], np.int64)


def combine_tiling(hidden: int, top_k: int, tokens: int, budget: int) -> tuple[int, int]:
    """(tokens per tile, columns per chunk) of the client combine: K rows bf16 + fp32, an out row, K weights."""
    for parts in range(1, hidden // 16 + 1):
        if hidden % parts or (hidden // parts) % 16:
            continue
        hc = hidden // parts
        per_token = top_k * hc * 6 + hc * 2 + top_k * 4 + 64
        if per_token <= budget:
            return int(max(1, min(tokens, 64, budget // per_token))), hc
    raise ArgumentError(f"hidden={hidden}, top_k={top_k}: no column chunk of the combine fits {budget} UB bytes")


def silence_bounds(profile, monitor: int, heartbeat_us: float) -> tuple[float, float]:
    """(longest silence of a healthy member's heartbeat, the monitor's read period), modeled us.

    A member's beat core posts a beat, then sleeps ``heartbeat_us`` in a bounded wait: beats land one constant path
    latency after they are issued, ``heartbeat_us`` plus the issue of those two instructions apart, whatever the
    member's own work. The monitor reads its table every ``heartbeat_us`` plus one local scalar round trip."""
    issue_us = profile.cycles_to_ps(2 * profile.issue_cycles) / 1e6
    read_us = Paths(profile).scalar_lat(monitor, monitor, True) / 1e6
    return heartbeat_us + issue_us, heartbeat_us + read_us + issue_us


def _check_detection(profile, monitor, heartbeat_us, poll_timeout_us, dead_after_us) -> None:
    """Detection windows longer than a healthy member's modeled silence (``silence_bounds``), so a fault-free run
    never declares a live member dead."""
    for arg, v in (("heartbeat_us", heartbeat_us), ("poll_timeout_us", poll_timeout_us),
                   ("dead_after_us", dead_after_us)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0 < v < np.inf:
            raise ArgumentError(f"{arg}={v!r}: a positive finite time in us")
    member_us, read_us = silence_bounds(profile, monitor, heartbeat_us)
    if poll_timeout_us <= member_us:
        raise ArgumentError(f"poll_timeout_us={poll_timeout_us}: a client declares a server dead when its heartbeat "
                            f"does not move over this window, and healthy beats land up to {member_us:.3f} us apart "
                            f"(heartbeat_us={heartbeat_us}); use more than that")
    if dead_after_us <= member_us + read_us:
        raise ArgumentError(f"dead_after_us={dead_after_us}: healthy beats land up to {member_us:.3f} us apart "
                            f"(heartbeat_us={heartbeat_us}) and the monitor reads every {read_us:.3f} us; use more "
                            f"than {member_us + read_us:.3f} us")


class ExpertService:
    """A stateless expert service over ``clients`` (attention dies) and ``servers`` (expert dies) of ``pod``.

    ``num_experts`` experts, each ``y = x @ W_e`` with ``W_e`` [hidden, hidden] bf16 (``weights`` [E, H, H], None in
    timing-only services), ``replicas`` copies each (``placement`` [E, replicas] server indices, default
    ``replica_placement``); slots sized for ``max_tokens`` tokens x ``top_k`` experts per request; ``server_cores``
    AICs per server share each batch's GEMM work. Times in us:
    servers and clients post heartbeats every ``heartbeat_us``; the monitor (on ``monitor`` die, default the first
    die that is neither a client nor a server) declares a member dead after ``dead_after_us`` without one; a client
    declares a server dead when its heartbeat did not move over ``poll_timeout_us``. Both windows must exceed the
    modeled silence of a healthy member (``silence_bounds``; ArgumentError otherwise). ``phantom``: timing-only
    payloads (control data stays real)."""

    def __init__(self, pod: Pod, clients, servers, *, num_experts: int, hidden: int, top_k: int, max_tokens: int,
                 replicas: int = 2, placement=None, weights=None, monitor: int | None = None, layer: int = 0,
                 heartbeat_us: float = 2.0, poll_timeout_us: float = 6.0, dead_after_us: float = 10.0,
                 server_cores: int = 4, phantom: bool = False, mode: str = "graph"):
        clients, servers = pod.check_dies(clients, "clients"), pod.check_dies(servers, "servers")
        every = clients + servers
        if len(set(every)) != len(every):
            raise ArgumentError(f"clients={clients}, servers={servers}: need one or more of each, all distinct dies")
        S = len(servers)
        check_int(replicas, "replicas", 1, S)
        for arg, v in (("num_experts", num_experts), ("top_k", top_k), ("max_tokens", max_tokens)):
            check_int(v, arg, 1)
        check_int(hidden, "hidden", 16)
        if hidden % 16 or (hidden > KT and hidden % KT):
            raise ArgumentError(f"hidden={hidden}: a multiple of 16 up to {KT}, or a multiple of {KT}")
        check_int(server_cores, "server_cores", 1, pod.profile.aic_per_die)
        pl = replica_placement(num_experts, S, replicas) if placement is None else \
            integer_ids(placement, "placement")
        if pl.shape != (num_experts, replicas):
            raise ShapeError(f"placement has shape {pl.shape}, expected [num_experts={num_experts}, "
                             f"replicas={replicas}]")
        if pl.min() < 0 or pl.max() >= S or any(len(set(row)) != replicas for row in pl.tolist()):
            raise ArgumentError(f"placement: server indices must be in 0..{S - 1}, distinct per expert")
        if monitor is None:
            free = [d for d in range(pod.profile.dies) if d not in every]
            if not free:
                raise ArgumentError(f"no die left for the monitor: the pod has {pod.profile.dies} dies, all clients "
                                    f"or servers; pass monitor=")
            monitor = free[0]
        monitor = check_int(monitor, "monitor", 0, pod.profile.dies - 1)
        if monitor in servers:
            raise ArgumentError(f"monitor={monitor} is a server die: put the monitor on a client or a free die")
        _check_detection(pod.profile, monitor, heartbeat_us, poll_timeout_us, dead_after_us)
        if weights is None and not phantom:
            raise ArgumentError("weights [num_experts, hidden, hidden] are required unless phantom=True")
        if weights is not None:
            wshape = tuple(weights.shape)
            if wshape != (num_experts, hidden, hidden):
                raise ShapeError(f"weights has shape {wshape}, expected [{num_experts}, {hidden}, {hidden}]")
        self.pod, self.clients, self.servers, self.monitor = pod, clients, servers, monitor
        self.num_experts, self.hidden, self.top_k, self.max_tokens = num_experts, hidden, top_k, max_tokens
        self.replicas, self.placement, self.phantom, self.mode = replicas, pl, phantom, mode
        self.server_cores = int(server_cores)
        C, rows = len(clients), max_tokens * top_k
        hosted = [sorted(e for e in range(num_experts) if s in pl[e]) for s in range(S)]
        self.hosted = hosted
        wt = None if weights is None else _as_bf16(weights)
        state, header, eid, px, py, w, stats, batch, join = [], [], [], [], [], [], [], [], []
        for s, d in enumerate(servers):
            state.append(pod.alloc(d, (C, 8), "int32", name=f"svc.state{d}"))
            header.append(pod.alloc(d, (C, 8), "int32", name=f"svc.header{d}"))
            eid.append(pod.alloc(d, (C, rows), "int32", name=f"svc.eid{d}"))
            px.append(pod.alloc(d, (C, rows, hidden), "bf16", phantom=phantom, name=f"svc.x{d}"))
            py.append(pod.alloc(d, (C, rows, hidden), "bf16", phantom=phantom, name=f"svc.y{d}"))
            n = max(len(hosted[s]), 1)
            if wt is None:
                w.append(pod.alloc(d, (n, hidden, hidden), "bf16", phantom=True, name=f"svc.w{d}"))
            else:
                w.append(pod.to_gm(d, wt[hosted[s]] if hosted[s] else np.zeros((1, hidden, hidden), wt.dtype),
                                   dtype="bf16", name=f"svc.w{d}"))
            stats.append(pod.alloc(d, (C, 8), "int32", name=f"svc.stats{d}"))
            batch.append(pod.alloc(d, (-(-(2 + C) // 8) * 8,), "int32", name=f"svc.batch{d}"))
            join.append(pod.alloc(d, (8,), "int32", name=f"svc.join{d}"))
        health = [pod.alloc(d, (S, 8), "int32", name=f"svc.health{d}") for d in clients]
        ybuf = [pod.alloc(d, (rows, hidden), "bf16", phantom=phantom, name=f"svc.ybuf{d}") for d in clients]
        budget = pod.profile.ub_bytes - 2 * IO_BYTES - rows * 4 - 4096
        self._job = _Job(servers=servers, clients=clients, placement=[list(map(int, p)) for p in pl],
                         local_index=[{e: i for i, e in enumerate(h)} for h in hosted], hidden=hidden, top_k=top_k,
                         max_tokens=max_tokens, layer=int(layer), heartbeat_us=float(heartbeat_us),
                         poll_timeout_us=float(poll_timeout_us), dead_after_us=float(dead_after_us),
                         combine_tiling=combine_tiling(hidden, top_k, max_tokens, budget),
                         state=state, header=header, eid=eid, px=px, py=py, w=w, stats=stats, batch=batch,
                         join=join, health=health,
                         ybuf=ybuf, hb=pod.alloc(monitor, (S + C, 8), "int32", name=f"svc.hb{monitor}"),
                         log=pod.alloc(monitor, (S + C, 8), "int32", name=f"svc.log{monitor}"),
                         beat_stop=[pod.alloc(d, (8,), "int32", name=f"svc.beat_stop{d}") for d in servers + clients],
                         first_beat_us=[Paths(pod.profile).scalar_lat(d, monitor, False) / 1e6
                                        for d in servers + clients])
        self._ran = False

    def run(self, topk_ids, x=None, topk_weights=None, *, kill=()) -> ServiceResult:
        """Serve ``R`` requests per client, each ``B`` tokens routed to ``top_k`` experts, and run the pod.

        ``topk_ids`` [C, R, B, K] int (0..E-1), ``x`` [C, R, B, H] bf16-representable, ``topk_weights`` [C, R, B, K]
        fp32 (both None in timing-only services). ``kill``: (die, at_us) pairs, a die (server or client) stopped at
        that modeled time of the pod. Runs once per service."""
        if self._ran:
            raise ArgumentError("ExpertService.run: a service runs once (its slots and heartbeats are spent)")
        pod, job = self.pod, self._job
        C, K, H = len(self.clients), self.top_k, self.hidden
        ids = integer_ids(topk_ids, "topk_ids")
        if ids.ndim != 4 or ids.shape[0] != C or ids.shape[3] != K or not 1 <= ids.shape[2] <= self.max_tokens:
            raise ShapeError(f"topk_ids has shape {ids.shape}, expected [clients={C}, requests, tokens<="
                             f"{self.max_tokens}, top_k={K}]")
        R, B = ids.shape[1], ids.shape[2]
        if R < 1:
            raise ShapeError("topk_ids: need at least one request per client")
        if ids.min() < 0 or ids.max() >= self.num_experts:
            raise ArgumentError(f"topk_ids holds expert {int(ids.min() if ids.min() < 0 else ids.max())}: allowed "
                                f"0..{self.num_experts - 1}")
        if not self.phantom:
            if x is None or topk_weights is None:
                raise ArgumentError("x and topk_weights are required in numeric runs")
            xs, ws = _as_bf16(x), np.asarray(_np(topk_weights), np.float32)
            if xs.shape != (C, R, B, H) or ws.shape != ids.shape:
                raise ShapeError(f"x {xs.shape} / topk_weights {ws.shape}: expected [{C}, {R}, {B}, {H}] / "
                                 f"{list(ids.shape)}")
        kill = [tuple(k) for k in kill]
        for d, t in kill:
            check_int(d, "kill die", 0, self.pod.profile.dies - 1)
            if d not in self.clients and d not in self.servers:
                raise ArgumentError(f"kill die {d}: not a client or server of this service (monitor {self.monitor} "
                                    f"must stay alive)")
            if d == self.monitor:
                raise ArgumentError(f"kill die {d}: client {d} also hosts the service's monitor (monitor={d}), "
                                    f"which must stay alive to declare deaths; place the monitor on a free die "
                                    f"to kill this client")
            if not 0 <= t < np.inf:
                raise ArgumentError(f"kill die {d} at_us={t}: a modeled time >= 0")
        if len({d for d, _ in kill}) != len(kill):
            raise ArgumentError(f"kill={kill}: a die is killed once")
        self._ran = True
        ph = self.phantom
        for c, d in enumerate(self.clients):
            job.ids.append(pod.to_gm(d, ids[c].astype(np.int32), name=f"svc.ids{d}"))
            if ph:
                job.x.append(pod.alloc(d, (R, B, H), "bf16", phantom=True, name=f"svc.in{d}"))
                job.w_route.append(pod.alloc(d, (R, B * K, 1), "fp32", phantom=True, name=f"svc.route{d}"))
            else:
                job.x.append(pod.to_gm(d, xs[c], dtype="bf16", name=f"svc.in{d}"))
                job.w_route.append(pod.to_gm(d, ws[c].reshape(R, B * K, 1), name=f"svc.route{d}"))
            job.out.append(pod.alloc(d, (R, B, H), "bf16", phantom=ph, name=f"svc.out{d}"))
            job.done.append(pod.alloc(d, (R, 8), "int32", name=f"svc.done{d}"))
            job.src.append(pod.alloc(d, (R, B * K), "int32", name=f"svc.src{d}"))
        job.num_requests = R
        for d, t in kill:
            pod.kill_die(d, at_us=t)
        launches = []
        mon_aiv = [1] if self.monitor in self.clients else [0]
        pod.stream(self.monitor, aiv=mon_aiv, aic=0, mode=self.mode).launch(
            monitor_kernel, (job,), numeric=not ph, persistent=True, name="svc.monitor")
        for d in self.servers:
            pod.stream(d, aiv=0, aic=self.server_cores, mode=self.mode).launch(
                server_kernel, (job,), numeric=not ph, persistent=True, name=f"svc.server{d}")
        for d in self.clients:
            launches.append(pod.stream(d, aiv=[0], aic=0, mode=self.mode).launch(
                client_kernel, (job,), numeric=not ph, persistent=True, name=f"svc.client{d}"))
        for m, d in enumerate(self.servers + self.clients):     # AIV 2: free beside the client and the monitor
            pod.stream(d, aiv=[BEAT_AIV], aic=0, mode=self.mode).launch(
                beat_kernel, (job, m), numeric=not ph, persistent=True, name=f"svc.beat{d}")
        try:
            run = pod.synchronize()
        except DeadlockError as e:
            if any(core.die == self.monitor for core in pod.killed):
                raise XcclError(f"expert service: the monitor's die {self.monitor} was killed, so no death can be "
                                f"declared and the servers wait for their clients forever ({e})") from e
            raise
        return self._result(run, launches)

    def _result(self, run, launches) -> ServiceResult:
        job = self._job
        done = np.stack([d.numpy() for d in job.done])                     # [C, R, 8]
        completions = done[:, :, 0].astype(np.int64)
        t_us = np.where(completions > 0, done[:, :, 3] / 1000.0, np.nan)
        start = min(la.start_ps for la in launches) / 1e6
        n = int((completions > 0).sum())
        span = float(np.nanmax(t_us) - start) if n else 0.0
        states = {d: job.state[s].numpy() for s, d in enumerate(self.servers)}
        stats = {d: job.stats[s].numpy() for s, d in enumerate(self.servers)}
        log = job.log.numpy()
        members = self.servers + self.clients
        dead = {members[m]: log[m, 1] / 1000.0 for m in range(len(members)) if log[m, 0]}
        out = None if self.phantom else np.stack([o.numpy() for o in job.out])
        return ServiceResult(out=out, completions=completions, completion_us=t_us,
                             sends=done[:, :, 1].astype(np.int64), resends=done[:, :, 2].astype(np.int64),
                             start_us=start, span_us=span, throughput_per_us=n / span if span > 0 else 0.0,
                             slot_states={d: v[:, 0].copy() for d, v in states.items()},
                             slot_reasons={d: v[:, 2].copy() for d, v in states.items()},
                             served={d: v[:, 0].copy() for d, v in stats.items()},
                             release_reason={d: v[:, 3].copy() for d, v in stats.items()},
                             release_held={d: v[:, 4].copy() for d, v in stats.items()},
                             row_server=np.stack([v.numpy() for v in job.src]).astype(np.int64), dead=dead, run=run)


def _np(a):
    if type(a).__module__.startswith("torch"):
        import torch
        if a.dtype == torch.bfloat16:
            a = a.float()
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _as_bf16(a) -> np.ndarray:
    import ml_dtypes
    v = _np(a)
    if v.dtype == ml_dtypes.bfloat16:
        return v
    from ascend_emu.numerics import cast
    return cast(np.ascontiguousarray(v, dtype=np.float32), ml_dtypes.bfloat16)


def service_reference(x, topk_ids, topk_weights, weights):
    """torch reference, bit-exact with the service: ``y[t, k] = bf16(sum over 128-wide K tiles of x[t] @ W_e)``
    (fp32 accumulation tile by tile), ``out[t] = bf16(((w0 * y0) + w1 * y1) + ...)`` in fp32.

    ``x`` [..., B, H] bf16, ``topk_ids`` / ``topk_weights`` [..., B, K], ``weights`` [E, H, H] bf16 -> [..., B, H]
    bf16 torch tensor."""
    import torch
    xs = torch.as_tensor(_np(x), dtype=torch.float32).to(torch.bfloat16).float()
    w = torch.as_tensor(_np(weights), dtype=torch.float32).to(torch.bfloat16).float()
    ids = torch.as_tensor(np.asarray(_np(topk_ids), np.int64))
    rw = torch.as_tensor(np.asarray(_np(topk_weights), np.float32))
    H = xs.shape[-1]
    kt, nt = min(KT, H), min(NT, H)
    lead = xs.shape[:-1]
    xf, idf, rwf = xs.reshape(-1, H), ids.reshape(-1, ids.shape[-1]), rw.reshape(-1, ids.shape[-1])
    K = idf.shape[1]
    ys = torch.zeros(xf.shape[0], K, H, dtype=torch.bfloat16)
    for e in torch.unique(idf).tolist():
        tok, kk = torch.nonzero(idf == e, as_tuple=True)
        xe = xf[tok]
        for n0 in range(0, H, nt):
            acc = None
            for k0 in range(0, H, kt):
                part = xe[:, k0:k0 + kt] @ w[e, k0:k0 + kt, n0:n0 + nt]
                acc = part if acc is None else acc + part
            ys[tok, kk, n0:n0 + nt] = acc.to(torch.bfloat16)
    acc = rwf[:, 0:1] * ys[:, 0].float()
    for k in range(1, K):
        acc = acc + rwf[:, k:k + 1] * ys[:, k].float()
    return acc.to(torch.bfloat16).reshape(*lead, H)
