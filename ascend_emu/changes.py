"""What a worker's dies changed during a partitioned run, and folding it into another worker's pod (workers.py).

Every worker starts a run from the same state (forked, or the same script in every rank): ``Snapshot`` takes what
a worker's changes are measured from, ``harvest`` lists what its own dies changed (GM it wrote, its L2s, the servers
it used, trace records, busy times, counters, launch traffic, the cores it killed, its dies' jitter draws) as plain
data, and ``merge`` writes another worker's harvest into this process's pod, which then holds what one process would
have.
"""
from __future__ import annotations

import numpy as np

_L2_FIELDS = ("resident", "dirty", "hit", "miss", "evicted", "read_hit", "read_miss", "write_lines", "writeback")


def _server_state(s) -> tuple:
    return (s.free, s.busy_ps, s.bytes, 0 if s.log is None else len(s.log))


def _l2_state(c) -> tuple:
    return tuple(getattr(c, f) for f in _L2_FIELDS)


class Snapshot:
    """The state a run starts from, the same in every worker (taken before the fork): what changed is shipped."""

    def __init__(self, pod):
        eng = pod.engine
        self.launches = [la for la in pod._launches if not la.done]
        self.queued = len(pod._launches)        # launches queued after this one (host functions) follow them
        self.traffic = [(la.traffic.l2_bytes, la.traffic.hbm_bytes, la.traffic.fabric_bytes) for la in self.launches]
        self.servers = {name: _server_state(s) for name, s in eng.paths.servers.items()}
        self.l2 = {die: _l2_state(c) for die, c in eng.paths.caches.by_die.items()}
        tr = eng.trace
        self.trace = (0, 0) if tr is None else (len(tr.slices), len(tr.flows))
        self.n_instr, self.bytes_moved, self.busy = eng.n_instr, eng.bytes_moved, dict(eng.busy)
        self.killed = len(pod.killed)

    def run_launches(self, pod) -> list:
        """The run's launches: those it started with, then those its host functions queued (every worker's list
        is the same, ``Partition.launches``)."""
        return self.launches + pod._launches[self.queued:]


def harvest(pod, part, before: Snapshot, blocked: list) -> dict:
    """What this worker's dies changed during the run, as plain data for the parent."""
    eng, owned, codec = pod.engine, part.owned, part.codec
    servers = {}
    for name, s in eng.paths.servers.items():
        old = before.servers.get(name, (0, 0, 0, 0))
        if _server_state(s) != old:
            servers[name] = (s.die, s.bw, s.free, s.busy_ps, s.bytes, None if s.log is None else s.log[old[3]:])
    l2 = {}
    for die, c in eng.paths.caches.by_die.items():
        if owned[die] and _l2_state(c) != before.l2.get(die):
            l2[die] = (_l2_state(c), c.pages())
    tr = eng.trace
    dies = [d for d in range(len(owned)) if owned[d]]
    written = part.written_stores()
    launches = before.run_launches(pod)
    busy = {k: v - before.busy.get(k, 0) for k, v in eng.busy.items() if v != before.busy.get(k, 0)}
    for la in launches:
        if not la.done:                 # parked: its cores' work so far is this run's (``Pod._result``)
            for c in la.cores:
                if owned[c.die]:
                    for pipe, ps in c.busy.items():
                        key = (c.die, c.unit, pipe)
                        busy[key] = busy.get(key, 0) + ps
    traffic = before.traffic + [(0, 0, 0)] * (len(launches) - len(before.traffic))
    return {
        "gm": {uid: st.data.tobytes() for uid, st in codec.stores.items()
               if owned[st.die] and st.data is not None and uid in written},
        "servers": servers, "l2": l2,
        "trace": None if tr is None else (tr.slices[before.trace[0]:], tr.flows[before.trace[1]:]),
        "n_instr": eng.n_instr - before.n_instr, "bytes_moved": eng.bytes_moved - before.bytes_moved,
        "busy": busy,
        "last_activity": eng.last_activity, "now": eng.now,
        "counts": {d: eng._counts[d] for d in dies},
        "flows": {h: n for h, n in eng._flows.items() if 0 <= h < len(owned) and owned[h]},
        "traffic": [(la.traffic.l2_bytes - a, la.traffic.hbm_bytes - b, la.traffic.fabric_bytes - c)
                    for la, (a, b, c) in zip(launches, traffic)],
        "killed": [codec.core_id(c) for c in pod.killed[before.killed:]],
        "parked": [codec.core_id(c) for la in launches if not la.done for c in la.cores
                   if owned[c.die] and not c.done],
        "jitter": None if pod.jitter is None else pod.jitter.state_of(owned),
        "blocked": blocked, **counters(part),
    }


# what a worker reports of its run (Pod.worker_stats): windows, messages sent, wall time waiting at window ends and
# in the window loop, CPU time of the loop, of packing and unpacking messages and of the exchanges (spinning before
# it sleeps), payload bytes sent
COUNTERS = ("windows", "messages", "syncs", "wait_s", "run_s", "cpu_s", "encode_s", "decode_s", "wait_cpu_s", "bytes_sent")


def counters(part) -> dict:
    return {k: getattr(part, k) for k in COUNTERS}


def merge(pod, before: Snapshot, res: dict) -> None:
    """Fold another worker's changes into this process's pod."""
    eng = pod.engine
    stores = {st.uid: st for a in pod.gm._arenas.values() for st in a._stores}
    for uid, data in res["gm"].items():
        stores[uid].data[...] = np.frombuffer(data, np.uint8)
    paths = eng.paths
    for name, (die, bw, free, busy_ps, nbytes, log) in res["servers"].items():
        s = paths.server(name, bw * 1000.0, die)
        s.free, s.busy_ps, s.bytes = free, busy_ps, nbytes
        if log and s.log is not None:
            s.log.extend(log)
    for die, (state, pages) in res["l2"].items():
        c = paths.caches.of(die)
        c.load(pages)                   # empties it first: the counters after
        for f, v in zip(_L2_FIELDS, state):
            setattr(c, f, v)
    if res["trace"] is not None and eng.trace is not None:
        eng.trace.slices.extend(res["trace"][0])
        eng.trace.flows.extend(res["trace"][1])
    eng.n_instr += res["n_instr"]
    eng.bytes_moved += res["bytes_moved"]
    for k, v in res["busy"].items():
        eng.busy[k] = eng.busy.get(k, 0) + v
    eng.last_activity = max(eng.last_activity, res["last_activity"])
    eng.now = max(eng.now, res["now"])
    for d, n in res["counts"].items():
        eng._counts[d] = n
    eng._flows.update(res["flows"])
    launches = before.run_launches(pod)
    for la, (a, b, c) in zip(launches, res["traffic"]):
        la.traffic.l2_bytes += a
        la.traffic.hbm_bytes += b
        la.traffic.fabric_bytes += c
    if res["jitter"] is not None:
        pod.jitter.merge_state(res["jitter"])
    for li, ci in res["killed"]:
        core = launches[li].cores[ci]
        core.killed = core.done = True
        pod.killed.append(core)
