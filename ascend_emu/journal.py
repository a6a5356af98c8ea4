"""The host's pod calls between runs, for forked workers that hold parked launches (workers.py, DESIGN.md 10).

A forked worker that keeps a parked launch outlives its run, with its own replica of the pod. Between runs the
script changes the parent's pod; ``Journal`` records what the workers must repeat on their replicas and
``Journal.replay`` repeats it there at the next ``synchronize``:

- calls (``journaled`` methods: streams, launches, host writes, faults, ``invalidate_l2``), pickled when made, with
  the pod's objects named by what names them on every worker (a stream by its place in ``pod._streams``, a launch
  by its serial, a GM tensor by its store's uid and its view) and kernels by module and name;
- GM: stores allocated since the run (any way: ``alloc``, ``to_gm``, a communicator's rings) with their bytes, in
  uid order, and the bytes of older stores the host changed (``GMTensor.write``, an aliased host array), found by
  a digest of every store taken when the workers were kept.

A call that cannot be sent (a lambda or a local function as a kernel, a launch of an earlier run in ``after=``)
raises ``ArgumentError`` naming it before it changes the parent's pod; so do host functions (``Launch.on_done``)
of the launches queued since, which are sent at the next ``synchronize`` (they are added after the call), by
reference (module-level functions).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import io
import pickle

import numpy as np

from .errors import ArgumentError, EmulatorError


def journaled(method):
    """Record ``method``'s call on the pod's journal when forked workers hold parked launches (between runs)."""
    @functools.wraps(method)
    def call(self, *args, **kw):
        pod = getattr(self, "pod", self)
        journal = pod._journal
        if journal is None or pod._in_run:
            return method(self, *args, **kw)
        entry = journal.encode(pod, method.__name__, self, args, kw)
        out = method(self, *args, **kw)
        journal.calls.append(entry)
        return out
    return call


def _digest(store) -> bytes:
    return hashlib.blake2b(store.data, digest_size=16).digest()


def _stores(pod) -> list:
    return [st for a in pod.gm._arenas.values() for st in a._stores]


class Journal:
    """What the parent's host did to its pod since the run that left launches parked on forked workers."""

    def __init__(self, pod):
        self.calls: list = []
        self.next_uid = pod.gm._next_uid
        self.next_serial = pod._launch_serial
        self.digests = {st.uid: _digest(st) for st in _stores(pod) if st.data is not None}

    # ------------------------------------------------------------------ the parent
    def encode(self, pod, name: str, target, args: tuple, kw: dict) -> bytes:
        buf = io.BytesIO()
        p = _Pickler(buf, pod)
        try:
            p.dump((name, target, args, kw))
        except (pickle.PicklingError, TypeError, AttributeError, ArgumentError) as e:
            what = f"{type(target).__name__.lower()}.{name}"
            raise ArgumentError(
                f"{what}: {e}. Forked workers hold launches parked in the last run, so every call that changes the "
                f"pod between runs is sent to them, and this one cannot be (pass a module-level @kernel function "
                f"and picklable arguments, or let the persistent launches finish before it)") from None
        return buf.getvalue()

    def payload(self, pod) -> bytes:
        """Everything the workers repeat at the next run: the calls and the GM the host changed (one pickle)."""
        fresh = [(st.uid, st.die, st.nbytes, st.data is None, st.name,
                  None if st.data is None or not st.data.any() else st.data.tobytes())
                 for st in sorted(_stores(pod), key=lambda s: s.uid) if st.uid >= self.next_uid]
        changed = {st.uid: st.data.tobytes() for st in _stores(pod)
                   if st.uid < self.next_uid and st.data is not None and _digest(st) != self.digests.get(st.uid)}
        # host functions given to the launches queued since (``launch.on_done.append(fn)`` follows the call)
        hosts = [(la.serial, self.encode(pod, "on_done", la, tuple(la.on_done), {}))
                 for la in pod._launches if la.serial >= self.next_serial and la.on_done]
        return pickle.dumps((self.next_uid, pod.gm._next_uid, fresh, self.calls, hosts, changed),
                            protocol=pickle.HIGHEST_PROTOCOL)

    # ------------------------------------------------------------------ a worker
    @staticmethod
    def replay(pod, payload: bytes) -> None:
        """Repeat the parent's host calls and GM changes on this worker's replica of the pod."""
        base, top, fresh, calls, hosts, changed = pickle.loads(payload)
        gm = pod.gm
        if gm._next_uid != base:
            raise EmulatorError(f"GM stores {gm._next_uid}.. of this worker are not the parent's {base}..")
        stores = {st.uid: st for st in _stores(pod)}
        for uid, die, nbytes, phantom, name, data in fresh:
            gm._next_uid = uid
            buf = None if data is None else np.frombuffer(data, np.uint8).copy()
            stores[uid] = gm.alloc(die, (nbytes,), "uint8", phantom=phantom, name=name, data=buf).store
        gm._next_uid = top
        for raw in calls:
            name, target, args, kw = _Unpickler(io.BytesIO(raw), pod, stores).load()
            getattr(target, name)(*args, **kw)
        for _, raw in hosts:
            _, la, fns, _ = _Unpickler(io.BytesIO(raw), pod, stores).load()
            la.on_done = list(fns)
        for uid, data in changed.items():
            stores[uid].data[...] = np.frombuffer(data, np.uint8)


class _Pickler(pickle.Pickler):
    def __init__(self, buf, pod):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.pod = pod

    def persistent_id(self, obj):
        from .kernel import Kernel
        from .memory import GMTensor
        from .pod import Launch, Pod, Stream
        if isinstance(obj, Pod):
            if obj is not self.pod:
                raise ArgumentError("another pod")
            return ("pod",)
        if isinstance(obj, Stream):
            return ("stream", next(i for i, s in enumerate(self.pod._streams) if s is obj))
        if isinstance(obj, Launch):
            if obj.done:
                raise ArgumentError(f"launch {obj.name!r} finished in an earlier run")
            return ("launch", obj.serial)
        if isinstance(obj, GMTensor):
            return ("gm", obj.store.uid, obj.offset, obj.shape, obj.strides, obj.dtype, obj.lo, obj.hi)
        if isinstance(obj, Kernel):
            mod, qual = getattr(obj.fn, "__module__", None), getattr(obj.fn, "__qualname__", "")
            try:
                found = _lookup(mod, qual)
            except (ImportError, AttributeError):
                found = None
            if found is not obj:
                raise ArgumentError(f"kernel {obj.name!r} is not a module-level @kernel function ({mod}.{qual})")
            return ("kernel", mod, qual)
        return None


def _lookup(mod: str, qual: str):
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, pod, stores: dict):
        super().__init__(buf)
        self.pod, self.stores = pod, stores

    def persistent_load(self, pid):
        from .memory import GMTensor
        kind, *rest = pid
        pod = self.pod
        if kind == "pod":
            return pod
        if kind == "stream":
            return pod._streams[rest[0]]
        if kind == "launch":
            return next(la for la in pod._launches if la.serial == rest[0])
        if kind == "gm":
            uid, offset, shape, strides, dtype, lo, hi = rest
            return GMTensor(self.stores[uid], offset, shape, strides, dtype, lo, hi)
        return _lookup(*rest)
