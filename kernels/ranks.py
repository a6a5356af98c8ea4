"""Per-rank plumbing shared by the kernels layer: one host drives many dies, so inputs come per rank (a list, or a
tensor with a leading rank dimension), each rank's kernel runs on its own die, and all run in one pod run.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ascend_emu import Pod, cloudmatrix384
from ascend_emu.arguments import check_dies, check_int
from ascend_emu.dtypes import as_dtype, name_of
from ascend_emu.errors import ArgumentError, DTypeError, ShapeError
from ascend_emu.memory import aliasable

# modeled as: one stream per rank on that rank's die; every launch is queued first, then one pod.synchronize()
# runs them concurrently, so RunResult.modeled_us is the slowest rank's time.


class Ranks(list):
    """Values given per rank, said explicitly: ``grouped_matmul(Ranks([x0, x1]), Ranks([w0, w1]), ...)`` runs rank
    r's kernel on ``x_r`` (on ``dies[r]``, default die r). Every native kernel accepts it wherever it takes per-rank
    inputs. It exists because torch_npu gives lists their own meaning (``npu_grouped_matmul``'s ``x=[...]`` is a
    list of groups); ``kernels.npu`` keeps torch_npu's meaning, the native kernels name ranks with ``Ranks``."""

    def __repr__(self) -> str:
        return f"Ranks({list.__repr__(self)})"


def warn_plain_list(value, name: str, kernel: str, torch_npu_name: str) -> None:
    """DeprecationWarning for a plain list/tuple where a kernel reads ranks and torch_npu reads something else."""
    if type(value) in (list, tuple):
        import warnings
        warnings.warn(f"{kernel}: a plain list {name} means one value per rank here but a list of groups in "
                      f"torch_npu.{torch_npu_name}; write kernels.Ranks([...]) for ranks (kernels.npu.{torch_npu_name} "
                      f"takes torch_npu's lists). Plain lists will be rejected in the next release.",
                      DeprecationWarning, stacklevel=3)


class Outputs:
    """Result base: fields named like torch_npu's outputs, plus ``run`` (the RunResult of the one pod run).

    Iterating yields the outputs in torch_npu order (``y, scale = dynamic_quant(x)``). Each output has the form of the
    input: a tensor for one rank, a list for a list of ranks, a stacked tensor for a leading rank dimension. In
    timing-only runs (``numeric=False``) the outputs are None."""

    _outputs: tuple = ()

    def __iter__(self):
        return iter(tuple(getattr(self, f) for f in self._outputs))

    def __getitem__(self, i):
        return tuple(self)[i]


def split_ranks(value, name: str, *, stacked_ndim: int | None = None):
    """(list of per-rank values, form). ``form``: "list" for a list/tuple, "stacked" for a tensor with one more
    dimension than ``stacked_ndim`` (a leading rank dimension), "single" otherwise."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ShapeError(f"{name}: an empty list of ranks")
        return list(value), "list"
    if stacked_ndim is not None and getattr(value, "ndim", None) == stacked_ndim + 1:
        return [value[i] for i in range(value.shape[0])], "stacked"
    return [value], "single"


def per_rank(value, n: int, name: str, *, stacked_ndim: int | None = None) -> list:
    """Broadcast an optional argument to ``n`` ranks: None, one value for every rank, a list, or a stacked tensor."""
    if value is None:
        return [None] * n
    vals, form = split_ranks(value, name, stacked_ndim=stacked_ndim)
    if form == "single":
        return vals * n
    if len(vals) != n:
        raise ShapeError(f"{name}: {len(vals)} per-rank values for {n} ranks")
    return vals


def join_ranks(outs: list, form: str):
    """Give per-rank outputs the input's form (see ``Outputs``)."""
    if outs and outs[0] is None:
        return None
    if form == "single":
        return outs[0]
    if form == "stacked":
        import torch
        return torch.stack(outs)
    return outs


def torch_dtype_name(t) -> str:
    """The emulator dtype name of a torch tensor / numpy array."""
    return name_of(as_dtype(t.dtype))


def to_gm(pod: Pod, die: int, t, name: str, numeric: bool, dtype=None, *, real: bool = False):
    """Place a host input tensor in ``die``'s GM; timing-only runs allocate a phantom of its shape (``t`` may live on
    the torch meta device) unless ``real`` (control data: counts, group lists).

    The GM tensor aliases ``t`` when it can (``pod.to_gm(copy=False)``: same dtype, contiguous, writeable), else
    holds a copy: these are the inputs of one host call, which the kernels only read and which the host cannot
    change while the call runs, so aliasing is safe and spares copying weights of gigabytes."""
    dt = as_dtype(dtype if dtype is not None else t.dtype, name)
    if numeric or real:
        if getattr(t, "is_meta", False):
            raise ArgumentError(f"{name} is a meta tensor: numeric runs need data (pass numeric=False to time only)")
        return pod.to_gm(die, t, name=name, dtype=dt, copy=not aliasable(t, dt))
    return pod.alloc(die, tuple(t.shape), dt, phantom=True, name=name)


def to_torch(a: np.ndarray):
    import torch
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def make_pod(pod: Pod | None, dies, n: int, trace: bool) -> tuple[Pod, list]:
    if dies is None:
        dies = list(range(n))
    dies = check_dies(dies) if pod is None else pod.check_dies(dies)     # distinct: each rank needs its own die
    if len(dies) != n:
        raise ShapeError(f"dies: {len(dies)} dies for {n} ranks")
    if pod is None:
        pod = Pod(cloudmatrix384(dies=max(dies) + 1), trace=trace)
    return pod, dies


def run_ranks(pod: Pod, launches) -> "object":
    """Queue ``(die, kernel, args, cores)`` launches, one stream per die, and run them in one pod run.
    ``cores`` is ``{"aiv": n}`` or ``{"aic": n}``; returns the RunResult."""
    for die, kern, args, cores, numeric in launches:
        pod.stream(die, **cores).launch(kern, args, numeric=numeric)
    return pod.synchronize()


class Pending:
    """A kernel's launches queued on the caller's streams (a host function given ``stream=``) and not yet run.
    Run them with the pod's ``synchronize()``, together with whatever else is queued; then ``collect(run)`` returns
    what the host function returns when it runs the pod itself. ``launches``: the queued ``Launch`` handles (pass
    them as ``after=`` to later launches)."""

    def __init__(self, launches: list, finish):
        self.launches = list(launches)
        self._finish = finish

    def collect(self, run):
        pending = [la.name for la in self.launches if not la.done]
        if pending:
            raise ArgumentError(f"collect: launch {pending[0]!r} has not run yet; call pod.synchronize() first")
        return self._finish(run)


def caller_streams(stream, n: int, kind: str, cores, arg: str = "cores") -> tuple[Pod, list, int, list]:
    """For a host function given ``stream=``: one ``Stream`` (one rank) or a list of them (one per rank, each on
    one die). Returns (pod, dies, core count, streams). The kernel runs on the streams' cores (their ``kind``
    count, "aic" or "aiv"); a ``cores`` the caller also gives (argument ``arg``) must be that count."""
    streams = list(stream) if isinstance(stream, (list, tuple)) else [stream]
    if len(streams) != n:
        raise ShapeError(f"stream: {len(streams)} streams for {n} ranks")
    pod = streams[0].pod
    for r, st in enumerate(streams):
        if getattr(st, "pod", None) is not pod or len(st.dies) != 1:
            raise ArgumentError(f"stream[{r}]: pass Streams of one pod, each on one die (pod.stream(die, ...))")
    counts = {len(st.aic if kind == "aic" else st.aiv) for st in streams}
    if len(counts) != 1:
        raise ArgumentError(f"stream: the ranks' streams hold different {kind.upper()} counts {sorted(counts)}")
    count = counts.pop()
    if count == 0:
        raise ArgumentError(f"stream: the kernel needs {kind.upper()} cores; the stream has none")
    if cores is not None and check_int(cores, arg, 1) != count:
        raise ArgumentError(f"{arg}={cores}: the kernel runs on the stream's {count} {kind.upper()} cores; pass "
                            f"{arg}={count} or None, or a stream with {cores}")
    return pod, [st.dies[0] for st in streams], count, streams


def queue_ranks(launches, streams: list, after=()) -> list:
    """Queue ``run_ranks``-style launches on the caller's streams (one per rank), each after ``after``."""
    return [st.launch(kern, args, numeric=numeric, after=list(after))
            for (_, kern, args, _, numeric), st in zip(launches, streams)]


def check_cores(prof, cores, kind: str = "aiv") -> int:
    """``cores`` (None = every core of ``kind`` on a die) checked against the die's count."""
    total = prof.aiv_per_die if kind == "aiv" else prof.aic_per_die
    return total if cores is None else check_int(cores, "cores", 1, total)


def integer_array(value, name: str) -> np.ndarray:
    """Integer data (expert ids, group lists) from numpy, torch or lists as int64. A float, bool or complex dtype
    raises ``DTypeError`` naming ``name``: truncating would route 2.7 to expert 2 without a word."""
    kind = getattr(value, "dtype", None)
    if kind is not None and type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        if value.dtype.is_floating_point or value.dtype.is_complex or str(value.dtype) == "torch.bool":
            raise DTypeError(f"{name} is {value.dtype}: expected integers")
        value = value.numpy()
    a = np.asarray(value)
    if a.size and a.dtype.kind not in "iu":
        raise DTypeError(f"{name} is {a.dtype}: expected integers")
    return a.astype(np.int64)


def check_finite(t, name: str, why: str) -> None:
    """Raise ``ArgumentError`` naming ``name`` and the first position of a NaN or +-inf in ``t`` (torch or numpy;
    meta tensors pass: no values). ``why``: what a non-finite value would break."""
    import torch
    if t is None or getattr(t, "is_meta", False):
        return
    v = t if torch.is_tensor(t) else torch.as_tensor(np.asarray(t, np.float32))
    if not v.is_floating_point() or v.numel() == 0:
        return                                          # integers (and nothing at all) are finite
    if v.dtype == torch.float64:
        v = v.float()                                   # the kernels' fp32: past its range is inf
    lo, hi = torch.aminmax(v)                           # one pass in the tensor's own dtype; NaN propagates
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return
    bad = ~torch.isfinite(v)                            # where: the slow path, only when something is wrong
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ArgumentError(f"{name} holds a non-finite value at {at if len(at) != 1 else at[0]}: {why}")


def check_dtype(t, name: str, allowed: tuple) -> str:
    dt = torch_dtype_name(t)
    if dt not in allowed:
        raise DTypeError(f"{name} dtype {dt} not supported: use {', '.join(allowed)}")
    return dt




class HostShape:
    """A host tensor known only by its ``shape`` and ``dtype`` (a name or numpy dtype): what a timing-only call
    (``numeric=False``) reads of its inputs, as a torch meta tensor gives it, without loading torch (about 2 s of
    CPU and 200 MB). The host functions that take one: ``grouped_matmul``, ``dynamic_quant``, ``moe_gating_top_k``."""

    __slots__ = ("shape", "dtype")
    is_meta = True

    def __init__(self, shape, dtype):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = as_dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "HostShape":
        """The same elements in ``shape`` (one entry may be -1: inferred), as numpy's reshape."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        n = math.prod(self.shape)
        known = math.prod(d for d in shape if d != -1)
        out = tuple(n // known if d == -1 and known else d for d in shape)
        if math.prod(out) != n or sum(d == -1 for d in shape) > 1:
            raise ShapeError(f"cannot reshape {self.shape} into {shape}")
        return HostShape(out, self.dtype)

    def __repr__(self) -> str:
        return f"HostShape({self.shape}, {name_of(self.dtype)})"
