"""The bytes of the messages one worker's dies send another's in a partitioned run (DESIGN.md 10, workers.py).

``Engine.send(t, die, fn, arg)`` to a die another worker owns posts ``(t, origin, count, die, fn, arg)``; the codec
turns ``fn`` and ``arg`` into plain data (ids, numbers, numpy values), ``Codec.pack`` pickles a window's messages
for each peer once, in batches per kind, and the receiver (``Codec.unpack``) decodes each back into ``(fn, arg)`` on
its own engine and queues it with its original key ``(t, origin, count)``, so it runs exactly where one process
would run it.

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
with the handle only. Those three kinds register with ``register_batch`` instead: a window's records of one kind
encode together, flat (int fields packed as int64, the other fields in one list, each route key and view layout
once: ``FIELDS``, ``OBJS``).
"""
from __future__ import annotations

import copyreg
import io
import pickle
from array import array

import numpy as np

from .engine import queue
from .errors import EmulatorError, NotPartitionableError
from .isa import COMPARE, OPS, Instr, new_instr
from .staging import Pull, Push, Reply
from .views import View

# numpy ints (a kernel's slice bounds in a view's shape) pickle as their type and value: numpy's own reduce, which
# also pickles the dtype and the value's bytes, costs about three times as much
_REDUCE = copyreg.dispatch_table.copy()
for _t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
    _REDUCE[_t] = lambda x: (x.__class__, (int(x),))
_KINDS: dict = {}       # key (fn's __name__ or _EV_* int) -> name
_BY_NAME: dict = {}     # name -> (encode a batch, decode a batch)


def register(key, name: str, encode, decode) -> None:
    """Make messages whose ``fn`` is ``key`` travel between workers as ``name``, each as ``encode(codec, arg)``'s
    plain data."""
    def encode_batch(codec, batch):
        return [(t, origin, count, die, encode(codec, arg)) for t, origin, count, die, _, arg in batch]

    def decode_batch(codec, batch, heap):
        for t, origin, count, die, data in batch:
            fn, arg = decode(codec, data)
            queue(heap, t, origin, count, die, fn, arg)
    register_batch(key, name, encode_batch, decode_batch)


def register_batch(key, name: str, encode, decode) -> None:
    """``register`` for kinds that encode a window's messages together: ``encode(codec, [(t, origin, count, die,
    fn, arg)])`` returns picklable plain data, ``decode(codec, data, heap)`` queues the events on ``heap``."""
    _KINDS[key] = name
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
        """One window's messages for one peer: [(t, origin, count, die, fn, arg)] -> {kind: its batch encoder's
        data}, picklable plain data, in the order sent within each kind."""
        batches: dict = {}
        kinds = _KINDS
        for m in messages:
            fn = m[4]
            name = kinds.get(fn if fn.__class__ is int else getattr(fn, "__name__", None))
            if name is None:
                key = fn if fn.__class__ is int else getattr(fn, "__name__", None)
                raise NotPartitionableError(f"not yet partitionable: {_who(m[5])}sends {key!r} to die {m[3]}, which "
                                            f"another worker runs, and no message codec is registered for it "
                                            f"(messages.register)")
            batch = batches.get(name)
            if batch is None:
                batch = batches[name] = []
            batch.append(m)
        return {name: _BY_NAME[name][0](self, batch) for name, batch in batches.items()}

    def decode(self, batches: dict, heap: list) -> None:
        """``encode``'s batches -> events (t, origin, count, die, fn, arg) on this worker's engine, queued on
        ``heap``. Decoding order does not matter: each message names its own objects, and its key (t, origin,
        count) places it in the queue."""
        for name, data in batches.items():
            _BY_NAME[name][1](self, data, heap)

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
# A batch of staged transfers' records travels flat: ``(ints, objs, views, table)``, every record ``FIELDS[name]``
# ints (the message's key and die, the record's numbers, its handle's numbers) and ``OBJS[name]`` objects, the views
# it names in ``views`` (``VIEW_INTS`` each, in record order), ints as int64 bytes, written and read through typed
# buffers when compiled (no Python int per number: boxing each and packing them with ``struct`` cost more than the
# rest of a record). A record's route key and a view's layout (shape, strides, dtype) are indices in ``table``, which
# holds each distinct one once (a numpy int in a shape pickles through a Python call: 1.7 us).
_HANDLE_INTS = ("home", "rank", "ident", "launch", "core", "busy_end", "start", "ndsts")
_HANDLE_OBJS = ("spec", "ins_origin", "hb")
FIELDS = {
    "_pulled": ("t", "origin", "count", "die", "key", "nbytes", "flow", "finish", "real", *_HANDLE_INTS),
    "_pushed": ("t", "origin", "count", "die", "key", "nbytes", "flow", "finish", "lat", "real", "l2_bytes",
                "hbm_bytes", "ndsts_own", *_HANDLE_INTS),
    "_replied": ("t", "origin", "count", "die", "end", "l2_bytes", "hbm_bytes", *_HANDLE_INTS),
}
OBJS = {
    "_pulled": ("rows", "issuer_die", "to_die", *_HANDLE_OBJS),
    "_pushed": ("result", "rows", "issuer_die", *_HANDLE_OBJS),
    "_replied": ("data", *_HANDLE_OBJS),
}
VIEW_INTS = ("uid", "offset", "lo", "hi", "layout")
_HOME_OBJS = (None, None, None)


def _int64s(n: int) -> array:
    return array("q", bytes(8 * n))


class _Flat:
    """One flat batch being encoded (``FIELDS`` / ``OBJS``): its records' ints (``ints``, ``n`` written) and
    objects, the ints of the views they name (``vints``, ``nv`` written), and the table of route keys and layouts."""

    __slots__ = ("ints", "iv", "n", "objs", "vints", "vv", "nv", "table", "index", "codec", "handles", "waiting",
                 "core_ids", "peer", "rank")

    def __init__(self, codec, name: str, records: int):
        self.ints = self.iv = _int64s(records * len(FIELDS[name]))      # every record has exactly its FIELDS
        self.vints = self.vv = _int64s(8 * len(VIEW_INTS))
        self.n = self.nv = 0
        self.objs, self.table, self.index = [], [], {}
        self.codec, self.handles, self.waiting, self.core_ids = codec, codec.handles, codec.waiting, codec._core_ids
        self.peer, self.rank = codec.peer, codec.rank

    def put(self, x: int) -> None:
        self.iv[self.n] = x
        self.n += 1

    def message(self, t: int, origin: int, count: int, die: int) -> None:
        """A record's first ints: its message's key and die."""
        iv, n = self.iv, self.n
        iv[n] = t
        iv[n + 1] = origin
        iv[n + 2] = count
        iv[n + 3] = die
        self.n = n + 4

    def transfer(self, key: tuple, nbytes: int, flow: int, finish: int) -> None:
        """A staged transfer's (pull's or push's) route key (its index in the table), bytes, flow and finish."""
        self.put(self.key(key))
        self.put(nbytes)
        self.put(flow)
        self.put(finish)

    def key(self, key: tuple) -> int:
        """A route key's index in the table (keys equal as tuples name the same route: Paths.path's memo)."""
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.table)
            self.table.append(key)
        return i

    def views(self, views) -> None:
        index, table = self.index, self.table
        for v in views:
            shape = v.shape
            lay = (shape, v.strides, id(v.dtype))
            for x in shape:
                if x.__class__ is not int:  # equal shapes whose ints differ in type (a numpy int from a kernel's
                    lay = (shape, v.strides, id(v.dtype), tuple([y.__class__ for y in shape]))   # slice) each travel
                    break
            i = index.get(lay)
            if i is None:
                i = index[lay] = len(table)
                table.append((shape, v.strides, v.dtype))
            k = self.nv
            if k + 5 > len(self.vints):         # grow by doubling (a batch's views are not known up front)
                grown = _int64s(2 * len(self.vints))
                grown[:k] = self.vints[:k]
                self.vints = self.vv = grown
            vv = self.vv
            vv[k] = v.store.uid
            vv[k + 1] = v.offset
            vv[k + 2] = v.lo
            vv[k + 3] = v.hi
            vv[k + 4] = i
            self.nv = k + 5

    def handle(self, ins) -> tuple:
        """A staged transfer's instruction, as it travels: ours (registered until it comes home) or a stand-in's; a
        stand-in going home travels as its ident alone (its issuer holds the instruction). Puts its ints (and its
        views); returns its objects."""
        held = self.handles.pop(id(ins), None)        # a stand-in travels on at most once (staging.py)
        if held is not None:
            key = held[0]
            if key[0] == self.peer:
                for x in (1, 0, key[1], 0, 0, 0, 0, -1):
                    self.put(x)
                return _HOME_OBJS
        else:
            key = (self.rank, id(ins))
            self.waiting[id(ins)] = ins
        dsts = ins.dsts         # GM destinations only: a relay lands there (a core's own UB stays home)
        for v in dsts:
            if v.store.space != "GM":
                n = -1
                break
        else:
            n = len(dsts)
            self.views(dsts)
        core = ins.core
        cid = self.core_ids.get(id(core))
        if cid is None:
            cid = self.codec.core_id(core)
        self.put(0)
        self.put(key[0])
        self.put(key[1])
        self.put(cid[0])
        self.put(cid[1])
        self.put(ins.busy_end)
        self.put(ins.start)
        self.put(n)
        return ins.spec.name, ins.origin, ins.hb

    def data(self) -> tuple:
        return self.ints.tobytes(), self.objs, self.vints[:self.nv].tobytes(), self.table


class _Read:
    """One flat batch being decoded: its ints (``iv``, ``n`` read), objects, views' ints (``vv``, ``nv`` read),
    table, and the codec's state they name."""

    __slots__ = ("iv", "n", "objs", "vv", "nv", "table", "stores", "waiting", "handles", "launches", "rank")

    def __init__(self, codec, data: tuple):
        ints, self.objs, vints, self.table = data
        iv, vv = array("q"), array("q")
        iv.frombytes(ints)
        vv.frombytes(vints)
        self.iv, self.vv = iv, vv
        self.n = self.nv = 0
        self.stores, self.waiting, self.handles = codec.stores, codec.waiting, codec.handles
        self.launches, self.rank = codec.launches, codec.rank

    def get(self) -> int:
        self.n += 1
        return self.iv[self.n - 1]

    def views_of(self, n: int) -> tuple:
        """The next ``n`` views of the batch."""
        stores, vv, table = self.stores, self.vv, self.table
        out = []
        k = self.nv
        for _ in range(n):
            shape, strides, dtype = table[vv[k + 4]]
            out.append(View(stores[vv[k]], vv[k + 1], shape, strides, dtype, vv[k + 2], vv[k + 3]))
            k += 5
        self.nv = k
        return tuple(out)

    def handle(self, spec, origin, hb) -> Instr:
        """Our instruction when it comes home, else a stand-in with what the dies on the way read: its spec and GM
        destinations (a relay lands there), its core (the replica), busy end and origin (a landing's trace flow)."""
        home, rank, ident, li, ci = self.get(), self.get(), self.get(), self.get(), self.get()
        busy_end, start, n = self.get(), self.get(), self.get()
        if home or rank == self.rank:               # ours, home again
            if n > 0:                               # (its destinations: we hold them)
                self.nv += 5 * n
            return self.waiting.pop(ident)
        ins = new_instr(OPS[spec], self.views_of(n) if n >= 0 else (), ())
        ins.core = self.launches[li].cores[ci]      # codec.core, inline: once per bulk message
        ins.busy_end, ins.origin, ins.start, ins.hb = busy_end, origin, start, hb
        self.handles[id(ins)] = ((rank, ident), ins)
        return ins


def _encode_pulls(codec, batch: list) -> tuple:
    out = _Flat(codec, "_pulled", len(batch))
    objs = out.objs
    for t, origin, count, die, _, m in batch:
        out.message(t, origin, count, die)
        out.transfer(m.key, m.nbytes, m.flow, m.finish)
        out.put(m.real)
        out.views((m.src,))
        ho = out.handle(m.handle)
        objs += (m.rows, m.issuer_die, m.to_die, *ho)
    return out.data()


def _decode_pulls(codec, data: tuple, heap: list) -> None:
    rd = _Read(codec, data)
    fn = codec.engine.staging._pulled
    objs = rd.objs
    for r in range(0, len(objs), len(OBJS["_pulled"])):
        t, origin, count, die, key = rd.get(), rd.get(), rd.get(), rd.get(), rd.get()
        nbytes, flow, finish, real = rd.get(), rd.get(), rd.get(), rd.get()
        src = rd.views_of(1)[0]
        ins = rd.handle(objs[r + 3], objs[r + 4], objs[r + 5])
        queue(heap, t, origin, count, die, fn, Pull(rd.table[key], src, objs[r], nbytes, flow, finish, objs[r + 1],
                                                   objs[r + 2], real, ins))


def _encode_pushes(codec, batch: list) -> tuple:
    out = _Flat(codec, "_pushed", len(batch))
    objs = out.objs
    for t, origin, count, die, _, m in batch:
        out.message(t, origin, count, die)
        out.transfer(m.key, m.nbytes, m.flow, m.finish)
        out.put(m.lat)
        out.put(m.real)
        out.put(m.l2_bytes)
        out.put(m.hbm_bytes)
        at = out.n              # ndsts_own: known once the handle has travelled (below)
        out.n += 1
        ho = out.handle(m.handle)
        # the destinations are the instruction's (staging.py): they travel once, with the handle, when it carries
        # them (home, or its own destinations listed)
        if m.dsts is m.handle.dsts and (out.iv[at + 1] or out.iv[at + 8] >= 0):
            out.iv[at] = -1
        else:
            out.iv[at] = len(m.dsts)
            out.views(m.dsts)
        objs += (m.result, m.rows, m.issuer_die, *ho)
    return out.data()


def _decode_pushes(codec, data: tuple, heap: list) -> None:
    rd = _Read(codec, data)
    fn = codec.engine.staging._pushed
    objs = rd.objs
    for r in range(0, len(objs), len(OBJS["_pushed"])):
        t, origin, count, die, key = rd.get(), rd.get(), rd.get(), rd.get(), rd.get()
        nbytes, flow, finish, lat, real, l2, hbm, n = rd.get(), rd.get(), rd.get(), rd.get(), rd.get(), rd.get(), \
            rd.get(), rd.get()
        rows = objs[r + 1]
        ins = rd.handle(objs[r + 3], objs[r + 4], objs[r + 5])
        if rows is not None and ins.p is None:      # a scatter's stand-in: its rows, for the sanitizer's landing
            ins.p = {"rows": rows}
        dsts = ins.dsts if n < 0 else rd.views_of(n)
        queue(heap, t, origin, count, die, fn, Push(rd.table[key], dsts, objs[r], ins.spec.commit, rows, nbytes, flow,
                                                   finish, lat, objs[r + 2], real, l2, hbm, ins))


def _encode_replies(codec, batch: list) -> tuple:
    out = _Flat(codec, "_replied", len(batch))
    objs = out.objs
    for t, origin, count, die, _, m in batch:
        out.message(t, origin, count, die)
        out.put(m.end)
        out.put(m.l2_bytes)
        out.put(m.hbm_bytes)
        ho = out.handle(m.handle)
        objs += (m.data, *ho)
    return out.data()


def _decode_replies(codec, data: tuple, heap: list) -> None:
    rd = _Read(codec, data)
    fn = codec.engine.staging._replied
    objs = rd.objs
    for r in range(0, len(objs), len(OBJS["_replied"])):
        t, origin, count, die = rd.get(), rd.get(), rd.get(), rd.get()
        end, l2, hbm = rd.get(), rd.get(), rd.get()
        ins = rd.handle(objs[r + 1], objs[r + 2], objs[r + 3])
        queue(heap, t, origin, count, die, fn, Reply(end, objs[r], l2, hbm, ins))


register_batch("_pulled", "_pulled", _encode_pulls, _decode_pulls)
register_batch("_pushed", "_pushed", _encode_pushes, _decode_pushes)
register_batch("_replied", "_replied", _encode_replies, _decode_replies)
