"""The bytes of the messages one worker's dies send another's in a partitioned run (DESIGN.md 10, workers.py).

``Engine.send(t, die, fn, arg)`` to a die another worker owns posts ``(t, origin, count, die, fn, arg)``; the codec
turns ``fn`` and ``arg`` into plain data (ids, numbers, numpy values), ``Codec.pack`` pickles a window's messages
for each peer once, in batches per kind, and the receiver (``Codec.unpack``) decodes each back into ``(fn, arg)`` on
its own engine and queues it with its original key ``(t, origin, count)``, so it runs exactly where one process
would run it. What it costs (A2E, 40 x 72 dies, CPU per message): encoding 2.2 us and pickling 1.7 us on the
sender, unpickling 1.9 us and decoding 2.7 us on the receiver.

Objects every worker holds are named by id: a GM store by its uid, a core by (launch, index in the launch's
cores) - every worker replicates the host state, so launches and their cores exist everywhere - and an
instruction by its issuer's id for it while it waits for a reply. Data travels as values (a scalar's value, a
reply's numpy array).

A message kind registers with ``register(key, name, encode, decode)``: ``key`` is what ``send`` gets as ``fn`` - an
``_EV_*`` int, or the ``__name__`` of a bound method of the engine or of its ``Remote`` - ``encode(codec, arg)``
returns picklable plain data, ``decode(codec, data)`` returns ``(fn, arg)`` on the receiving engine. The kinds of
today: remote scalar loads and polls (remote.py) and their replies, atomics, posted stores, and the staged bulk
transfers' records (staging.py: ``Pull``, ``Push``, ``Reply``), whose instruction handle travels as its issuer's
(rank, id) with what the dies on the way read of it (its spec, its GM destinations, its core, busy end and origin),
or as the key alone on its way back to its issuer; a ``Push`` lands on its instruction's destinations, which travel
with the handle only.
"""
from __future__ import annotations

import copyreg
import io
import pickle
from heapq import heappush

import numpy as np

from .errors import EmulatorError, NotPartitionableError
from .isa import COMPARE, OPS, Instr
from .staging import Pull, Push, Reply
from .views import View

# numpy ints (a kernel's slice bounds in a view's shape) pickle as their type and value: numpy's own reduce, which
# also pickles the dtype and the value's bytes, costs about three times as much
_REDUCE = copyreg.dispatch_table.copy()
for _t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
    _REDUCE[_t] = lambda x: (x.__class__, (int(x),))
_KINDS: dict = {}       # key (fn's __name__ or _EV_* int) -> (name, encode, decode)
_BY_NAME: dict = {}     # name -> (encode, decode)


def register(key, name: str, encode, decode) -> None:
    """Make messages whose ``fn`` is ``key`` travel between workers as ``name``."""
    _KINDS[key] = (name, encode, decode)
    _BY_NAME[name] = (encode, decode)


class Codec:
    """One worker's encoder and decoder: ``stores`` {uid: Store}, ``launches`` the run's launches (every worker's
    list is the same), ``engine`` the worker's engine."""

    def __init__(self, engine, stores: dict, launches: list, rank: int = 0):
        self.engine = engine
        self.rank = rank
        self.stores = stores
        self.launches = launches
        self._core_ids: dict = {}       # id(core) -> (launch index, core index)
        self._launch_index = {id(la): i for i, la in enumerate(launches)}
        self.waiting: dict = {}         # id(ins) -> ins: our instructions waiting for a reply from another worker
        self.proxies: dict = {}         # id(proxy) -> the issuer's id of the instruction it stands for
        # id(stand-in) -> (the issuer's (rank, id) of a staged transfer's instruction, the stand-in): held until it
        # travels on, so its id cannot be reused by an instruction of ours meanwhile
        self.handles: dict = {}
        self.peer = None                # the worker the messages being encoded go to
        self.logs: list = []            # race logs received with the messages (race_log.py; worker 0)
        self.log_out = None             # this window's race log, for worker 0

    # ------------------------------------------------------------------ batches
    def encode(self, messages: list) -> dict:
        """One window's messages for one peer: [(t, origin, count, die, fn, arg)] -> {kind: [(t, origin, count,
        die, data)]}, picklable plain data, in the order sent within each kind."""
        batches: dict = {}
        kinds = _KINDS
        for t, origin, count, die, fn, arg in messages:
            kind = kinds.get(fn if fn.__class__ is int else getattr(fn, "__name__", None))
            if kind is None:
                key = fn if fn.__class__ is int else getattr(fn, "__name__", None)
                raise NotPartitionableError(f"not yet partitionable: {_who(arg)}sends {key!r} to die {die}, which another "
                                    f"worker runs, and no message codec is registered for it (messages.register)")
            name, enc, _ = kind
            batch = batches.get(name)
            if batch is None:
                batch = batches[name] = []
            batch.append((t, origin, count, die, enc(self, arg)))
        return batches

    def decode(self, batches: dict, heap: list) -> None:
        """``encode``'s batches -> events (t, origin, count, die, fn, arg) on this worker's engine, queued on
        ``heap``. Decoding order does not matter: each message names its own objects, and its key (t, origin,
        count) places it in the queue."""
        for name, batch in batches.items():
            dec = _BY_NAME[name][1]
            for t, origin, count, die, data in batch:
                fn, arg = dec(self, data)
                heappush(heap, (t, origin, count, die, fn, arg))

    def pack(self, done: dict, messages: list, peer: int) -> bytes:
        """One window's payload for worker ``peer``: the launch completions seen here and the messages by kind
        (and, in a sanitized run, to worker 0: ``log_out``, the window's race log), pickled once."""
        self.peer = peer
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _REDUCE
        pickler.dump((done, self.encode(messages), self.log_out) if peer == 0 and self.log_out
                     else (done, self.encode(messages)))
        return out.getvalue()

    def unpack(self, payload: bytes, heap: list) -> dict:
        """``pack``'s payload: queue its messages on ``heap`` (with their original keys), keep its race log in
        ``logs``; returns its completions."""
        done, batches, *log = pickle.loads(payload)
        self.decode(batches, heap)
        if log:
            self.logs.append(log[0])
        return done

    @staticmethod
    def check_after(messages: list, end: int, lookahead: int) -> int:
        """The earliest time of ``messages`` (sent in a window ending at ``end``, ps); none may land before it."""
        soonest = min(m[0] for m in messages)
        if soonest < end:
            m = min(messages, key=lambda m: m[0])
            raise EmulatorError(f"message to die {m[3]} lands at {m[0]} ps, inside the window that ends at {end} ps "
                                f"(look-ahead {lookahead} ps too long)")
        return soonest

    # ------------------------------------------------------------------ object ids
    def core_id(self, core) -> tuple:
        cid = self._core_ids.get(id(core))
        if cid is None:
            li = self._launch_index[id(core.launch)]
            for ci, c in enumerate(core.launch.cores):
                self._core_ids[id(c)] = (li, ci)
            cid = self._core_ids[id(core)]
        return cid

    def core(self, cid: tuple):
        li, ci = cid
        return self.launches[li].cores[ci]

    def view(self, v) -> tuple:
        return (v.store.uid, v.offset, v.shape, v.strides, v.dtype, v.lo, v.hi)

    def view_of(self, data: tuple) -> View:
        uid, offset, shape, strides, dtype, lo, hi = data
        return View(self.stores[uid], offset, shape, strides, dtype, lo, hi)

    def instr(self, ins: Instr, reply: bool) -> tuple:
        """An instruction of one of our cores acting at another worker's die (``reply``: it waits for the answer)."""
        if reply:
            self.waiting[id(ins)] = ins
        p = {k: v for k, v in ins.p.items() if k != "fn"}
        return (id(ins), self.core_id(ins.core), ins.core.block_start, ins.spec.name,
                [self.view(v) for v in ins.dsts], [self.view(v) for v in ins.srcs], p, ins.start, ins.busy_end,
                ins.end, ins.origin, ins.hb)

    def proxy(self, data: tuple) -> Instr:
        """The receiving side's stand-in for another worker's instruction (its core is the local replica)."""
        key, cid, block_start, spec, dsts, srcs, p, start, busy_end, end, origin, hb = data
        if "cmp" in p:
            p["fn"] = COMPARE[p["cmp"]]
        ins = Instr(OPS[spec], tuple(self.view_of(v) for v in dsts), tuple(self.view_of(v) for v in srcs), p,
                    blocking=spec != "gm_store")
        ins.core = core = self.core(cid)
        ins.start, ins.busy_end, ins.end, ins.origin = start, busy_end, end, origin
        ins.hb = hb                     # a sanitized run: the instruction's name in the race log (race_log.py)
        if ins.blocking:                # waits for our answer: its core (the replica here) waits on it
            core.blocked_on, core.block_start = ins, block_start
            self.proxies[id(ins)] = key
        return ins


def _who(arg) -> str:
    """"kernel 'k' on die d " when ``arg`` (an instruction, a tuple holding one, a record with it as ``ins`` or
    ``handle``) names one, else ''."""
    for x in (arg, *(arg if isinstance(arg, tuple) else ()), getattr(arg, "ins", None), getattr(arg, "handle", None)):
        core = getattr(x, "core", None) if isinstance(x, Instr) else None
        if core is not None:
            return f"kernel '{core.launch.name}' on die {core.die} "
    return ""


# ---------------------------------------------------------------------------------- the kinds of today
def _engine_method(name: str, reply: bool):
    def encode(codec, ins):
        return codec.instr(ins, reply)

    def decode(codec, data):
        return getattr(codec.engine, name), codec.proxy(data)
    register(name, name, encode, decode)


def _remote_method(name: str):
    def encode(codec, ins):
        return codec.instr(ins, True)

    def decode(codec, data):
        return getattr(codec.engine.remote, name), codec.proxy(data)
    register(name, name, encode, decode)


def _encode_reply(codec, msg):
    proxy, value = msg
    return codec.proxies.pop(id(proxy)), value


def _decode_reply(codec, data):
    key, value = data
    return codec.engine._complete_arrived, (codec.waiting.pop(key), value)


_engine_method("_store_landed", reply=False)      # posted scalar stores
_engine_method("_add_landed", reply=True)         # atomics
_engine_method("_cas_landed", reply=True)
_remote_method("_load_arrived")                   # remote scalar loads and polls (remote.py)
_remote_method("_poll_arrived")
register("_complete_arrived", "_complete_arrived", _encode_reply, _decode_reply)   # their answers


# ---------------------------------------------------------------------------------- staged bulk transfers
def _encode_handle(codec, ins) -> tuple:
    """A staged transfer's instruction, as it travels: ours (registered until it comes home) or a stand-in's; a
    stand-in going home travels as its key alone (its issuer holds the instruction)."""
    held = codec.handles.pop(id(ins), None)       # a stand-in travels on at most once (staging.py)
    if held is not None:
        key = held[0]
        if key[0] == codec.peer:
            return (key,)
    else:
        key = (codec.rank, id(ins))
        codec.waiting[id(ins)] = ins
    dsts = ins.dsts             # GM destinations only: a relay lands there (a core's own UB stays home)
    for v in dsts:
        if v.store.space != "GM":
            dsts = None
            break
    else:
        dsts = list(map(codec.view, dsts))
    core = ins.core
    cid = codec._core_ids.get(id(core))
    return (key, codec.core_id(core) if cid is None else cid, ins.spec.name, dsts, ins.busy_end, ins.origin,
            ins.start, ins.hb)


def _decode_handle(codec, data) -> Instr:
    """Our instruction when it comes home, else a stand-in with what the dies on the way read: its spec and GM
    destinations (a relay lands there), its core (the replica), busy end and origin (a landing's trace flow)."""
    if len(data) == 1:                            # ours, home again
        return codec.waiting.pop(data[0][1])
    key, cid, spec, dsts, busy_end, origin, start, hb = data
    rank, ident = key
    if rank == codec.rank:
        return codec.waiting.pop(ident)
    ins = Instr(OPS[spec], tuple(map(codec.view_of, dsts)) if dsts is not None else (), ())
    ins.core = codec.launches[cid[0]].cores[cid[1]]        # codec.core, inline: once per bulk message
    ins.busy_end, ins.origin, ins.start, ins.hb = busy_end, origin, start, hb
    codec.handles[id(ins)] = (key, ins)
    return ins


def _encode_pull(codec, m):
    return (m.key, codec.view(m.src), m.rows, m.nbytes, m.flow, m.finish, m.issuer_die, m.to_die, m.real,
            _encode_handle(codec, m.handle))


def _decode_pull(codec, data):
    key, src, rows, nbytes, flow, finish, issuer_die, to_die, real, handle = data
    return codec.engine.staging._pulled, Pull(key, codec.view_of(src), rows, nbytes, flow, finish, issuer_die,
                                              to_die, real, _decode_handle(codec, handle))


def _encode_push(codec, m):
    handle = _encode_handle(codec, m.handle)
    # the destinations are the instruction's (staging.py): they travel once, with the handle, when it carries them
    same = m.dsts is m.handle.dsts and (len(handle) == 1 or handle[3] is not None)
    return (m.key, None if same else list(map(codec.view, m.dsts)), m.result, m.rows, m.nbytes, m.flow,
            m.finish, m.lat, m.issuer_die, m.real, m.l2_bytes, m.hbm_bytes, handle)


def _decode_push(codec, data):
    key, dsts, result, rows, nbytes, flow, finish, lat, issuer_die, real, l2, hbm, handle = data
    ins = _decode_handle(codec, handle)
    if rows is not None and ins.p is None:      # a scatter's stand-in: its rows, for the sanitizer's landing
        ins.p = {"rows": rows}
    dsts = ins.dsts if dsts is None else tuple(map(codec.view_of, dsts))
    return codec.engine.staging._pushed, Push(key, dsts, result, ins.spec.commit,
                                              rows, nbytes, flow, finish, lat, issuer_die, real, l2, hbm, ins)


def _encode_replied(codec, m):
    return m.end, m.data, m.l2_bytes, m.hbm_bytes, _encode_handle(codec, m.handle)


def _decode_replied(codec, data):
    end, value, l2, hbm, handle = data
    return codec.engine.staging._replied, Reply(end, value, l2, hbm, _decode_handle(codec, handle))


register("_pulled", "_pulled", _encode_pull, _decode_pull)
register("_pushed", "_pushed", _encode_push, _decode_push)
register("_replied", "_replied", _encode_replied, _decode_replied)
