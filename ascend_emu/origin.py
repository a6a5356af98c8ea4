"""Where a kernel issued an instruction: the args of its trace slices (``kernel``, ``function``, ``source``).

Taken for every instruction of a traced run, so it is one of the scheduler's compiled modules (``origin.pxd``): the
lookup walks the generator's frames and finds the site's shared dict by bytecode offset, without a Python call.
"""
from __future__ import annotations


def origin_of(sites: dict, gen, kernel: str) -> dict:
    """Args naming where a kernel generator ``gen`` (suspended at a yield) issued its instruction: ``kernel`` (the
    launch), ``function`` and ``source`` ("file:line") of the innermost generator it delegates to with
    ``yield from``, and ``kernel_source`` (the kernel's own line) when that is another function. One shared dict per
    site, kept in ``sites`` (a trace's: key -> (args, the code objects of the key))."""
    outer = frame = getattr(gen, "gi_frame", None)    # None: the generator has finished
    if frame is None:
        key = kernel
    else:
        sub = gen.gi_yieldfrom
        while sub is not None:     # ``yield from`` helpers: the innermost one yielded the instruction
            f = getattr(sub, "gi_frame", None)
            if f is None:          # a plain iterator under ``yield from``
                break
            frame = f
            sub = sub.gi_yieldfrom
        # keyed by bytecode offset: f_lasti is a field, f_lineno walks the code's line table every time. Code
        # objects by id: hashing one hashes its bytecode and constants on every lookup; the site's entry holds its
        # code objects, so their ids cannot be reused while the key is in ``sites``
        key = (kernel, id(frame.f_code), frame.f_lasti) if outer is frame else \
            (kernel, id(frame.f_code), frame.f_lasti, id(outer.f_code), outer.f_lasti)
    site = sites.get(key)
    if site is not None:
        return site[0]
    o = {"kernel": kernel}
    if frame is not None:
        o["function"] = frame.f_code.co_name
        o["source"] = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if outer is not frame:
            o["kernel_source"] = f"{outer.f_code.co_filename}:{outer.f_lineno}"
    sites[key] = (o, None if frame is None else frame.f_code, None if outer is None else outer.f_code)
    return o
