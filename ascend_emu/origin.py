"""Where a kernel issued an instruction: the args of its trace slices (``kernel``, ``function``, ``source``).

Taken for every instruction of a traced run, so it is one of the scheduler's compiled modules (``origin.pxd``): the
lookup walks the generator's frames and finds the site's shared dict by bytecode offset, without a Python call.
``origin_at`` keeps what does not change between one core's instructions (its generator's frame and code, its
kernel's sites) in an ``Issuer``, so an instruction yielded by the kernel's own frame costs two attribute reads and
one dict lookup.
"""
from __future__ import annotations

try:                # the install compiles this module (origin.pxd declares the C call _lasti makes)
    import cython
    _COMPILED = cython.compiled
except ImportError:  # pragma: no cover - Cython is a build requirement
    _COMPILED = False


def origin_of(sites: dict, gen, kernel: str) -> dict:
    """Args naming where a kernel generator ``gen`` (suspended at a yield) issued its instruction: ``kernel`` (the
    launch), ``function`` and ``source`` ("file:line") of the innermost generator it delegates to with
    ``yield from``, and ``kernel_source`` (the kernel's own line) when that is another function. One shared dict per
    site, kept in ``sites`` (a trace's: kernel -> site key -> (args, the code objects of the key))."""
    by_site = sites.get(kernel)
    if by_site is None:
        by_site = sites[kernel] = {}
    outer = frame = getattr(gen, "gi_frame", None)    # None: the generator has finished
    if frame is None:
        key = -1
    else:
        sub = gen.gi_yieldfrom
        while sub is not None:     # ``yield from`` helpers: the innermost one yielded the instruction
            f = getattr(sub, "gi_frame", None)
            if f is None:          # a plain iterator under ``yield from``
                break
            frame = f
            sub = sub.gi_yieldfrom
        key = _site_key(frame) if outer is frame else (_site_key(frame), _site_key(outer))
    site = by_site.get(key)
    if site is not None:
        return site[0]
    o = {"kernel": kernel}
    if frame is not None:
        o["function"] = frame.f_code.co_name
        o["source"] = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if outer is not frame:
            o["kernel_source"] = f"{outer.f_code.co_filename}:{outer.f_lineno}"
    by_site[key] = (o, None if frame is None else frame.f_code, None if outer is None else outer.f_code)
    return o


def _site_key(frame):
    """A frame's site: its code object and bytecode offset (f_lasti: a field, where f_lineno walks the code's line
    table every time), as one int when the code's id is 16-byte aligned and the offset below 2**17 (the usual case:
    a C integer in the build, where a tuple key cost a third of ``origin_of``), else a tuple. Code objects by id:
    hashing one hashes its bytecode and constants on every lookup; the site's entry in ``sites`` holds its code
    objects, so their ids cannot be reused while the key is there."""
    code_id = id(frame.f_code)
    at = frame.f_lasti + 1        # -1 before the first instruction
    if code_id & 15 == 0 and 0 <= at < 1 << 17:
        return (code_id >> 4) << 17 | at
    return ("site", code_id, at)


class Issuer:
    """One core's kernel generator as ``origin_at`` last saw it: the generator, its frame, the key base of the
    frame's code (``_site_key`` less the offset; -1: no int key), its kernel's sites (``sites[kernel]``) and the
    args found for its frame's offsets (``by_at``), the latest of them also in ``ats`` / ``args`` by code unit
    modulo ``_WAYS`` (a kernel loop's few yields found without an int object or a dict lookup). ``sites`` and
    ``kernel``: what the engine passes for this core (kept here for it)."""

    __slots__ = ("gen", "frame", "base", "by_site", "by_at", "sites", "kernel", "ats", "args")

    def __init__(self, sites=None, kernel=None):
        self.gen = self.frame = self.by_site = None
        self.base = -1
        self.by_at = {}
        self.ats = [-1] * _WAYS
        self.args = [None] * _WAYS
        self.sites = sites
        self.kernel = kernel

    def _know(self, at: int, o) -> None:
        """``by_at[at] = o``, and the way of ``at`` holds it."""
        self.by_at[at] = o
        way = (at >> 1) & (_WAYS - 1)
        self.ats[way] = at
        self.args[way] = o


def origin_at(issuer: Issuer, sites: dict, gen, kernel: str) -> dict:
    """``origin_of(sites, gen, kernel)`` for a generator suspended at a yield (not finished), through ``issuer``
    (the issuing core's): a site of the generator's own frame seen before is found with the frame's offset alone."""
    if issuer.gen is not gen:
        frame = getattr(gen, "gi_frame", None)
        if frame is None:
            return origin_of(sites, gen, kernel)
        code_id = id(frame.f_code)
        issuer.gen = gen
        issuer.frame = frame
        issuer.base = (code_id >> 4) << 17 if code_id & 15 == 0 else -1
        issuer.by_site = sites.get(kernel)
        issuer.by_at = {}
        issuer.ats = [-1] * _WAYS
    # whether the frame delegates follows from its offset: suspended in a ``yield from``, it sits at that
    # statement's yield, whose next instruction (a RESUME of the yield-from kind) is what ``gi_yieldfrom`` reads; so
    # an offset seen once is known as the frame's own yield (its args kept) or a delegation (``_DELEGATES``)
    at = _lasti(issuer.frame) + 1
    way = (at >> 1) & (_WAYS - 1)       # byte offsets of 2-byte code units: the units spread over the ways
    known = issuer.ats[way]
    if known == at:
        o = issuer.args[way]
    else:
        o = issuer.by_at.get(at)
    if o is not None and o is not _DELEGATES:
        return o
    if o is None and gen.gi_yieldfrom is None:
        # a yield of the generator's own frame: its site is its offset in that frame's code, the same code for the
        # generator's life, so the offset alone finds the args (a small int: a cheaper key than the site's)
        if issuer.base >= 0 and issuer.by_site is not None and 0 <= at < 1 << 17:
            site = issuer.by_site.get(issuer.base | at)
            if site is not None:
                issuer._know(at, site[0])
                return site[0]
        o = origin_of(sites, gen, kernel)
        issuer.by_site = sites.get(kernel)
        issuer._know(at, o)
        return o
    o = origin_of(sites, gen, kernel)
    issuer.by_site = sites.get(kernel)
    issuer._know(at, _DELEGATES)
    return o


def _lasti(frame) -> int:
    """``frame.f_lasti``; compiled, the C API's ``PyFrame_GetLasti`` (the value the attribute boxes)."""
    if _COMPILED:
        return _frame_lasti(frame)   # noqa: F821 - origin.pxd's C function, named only in the build
    return frame.f_lasti


_WAYS = 8              # Issuer.ats / args: a power of two
_DELEGATES: dict = {}   # ``Issuer.by_at``'s mark of an offset where the frame delegates (compared by identity)
