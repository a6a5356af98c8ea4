"""One case of a robustness sweep in a child process: a crash (segfault, abort) or a hang fails that case with what
happened, instead of taking down the test run.

The children fork from a forkserver that imported the packages once (fast to start, and safe: the server never ran
a torch thread pool). A case is a module-level function; it checks its own result against the reference and returns
nothing, or raises. ``outcome`` says which of four things happened; ``check`` turns it into the suite's rule: the
case passed, or it raised one of the library's own errors whose message names one of the arguments it was given.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass

PRELOAD = ["numpy", "torch", "ascend_emu", "xccl", "kernels", "quant", "serving"]
TIMEOUT_S = float(os.environ.get("ROBUSTNESS_TIMEOUT_S", "180"))
_CONTEXT = None


@dataclass
class Outcome:
    kind: str                  # "passed", "raised", "crashed", "hung"
    error: str = ""            # the exception's class name (raised) or the exit code (crashed)
    message: str = ""
    library: bool = False      # raised one of the library's own errors (ascend_emu.EmulatorError, quant.QuantError)


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(conn, case, args) -> None:
    from ascend_emu.errors import EmulatorError
    from quant.errors import QuantError
    try:
        case(*args)
        conn.send(Outcome("passed"))
    except BaseException as e:                 # noqa: BLE001 - everything is reported to the parent
        conn.send(Outcome("raised", type(e).__name__, str(e)[:2000], isinstance(e, (EmulatorError, QuantError))))
    finally:
        conn.close()


def outcome(case, *args, timeout_s: float = TIMEOUT_S) -> Outcome:
    """Run ``case(*args)`` in a child process; at most ``timeout_s`` seconds of wall time."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, case, args), daemon=True)
    p.start()
    child.close()
    try:
        if parent.poll(timeout_s):
            try:
                return parent.recv()
            except EOFError:
                pass
        else:
            p.kill()
            p.join()
            return Outcome("hung", message=f"no answer within {timeout_s:.0f} s")
        p.join(10)
        return Outcome("crashed", str(p.exitcode), "the child died without an answer")
    finally:
        parent.close()
        if p.is_alive():
            p.kill()
        p.join()


def check(case, *args, names: tuple = (), timeout_s: float = TIMEOUT_S) -> Outcome:
    """Assert the suite's rule for one case. Valid arguments (``names`` empty): it passed, i.e. its result equalled
    the reference. An argument made invalid (``names``: how a message may name it): it raised a library error
    naming one of them; accepting it is a failure too (a float id truncated, a NaN routed). Returns the outcome."""
    out = outcome(case, *args, timeout_s=timeout_s)
    assert out.kind in ("passed", "raised"), f"{out.kind}: {out.error} {out.message}"
    if not names:
        assert out.kind == "passed", f"valid arguments raised {out.error}: {out.message}"
    else:
        assert out.kind == "raised", f"accepted an invalid argument ({' / '.join(names)}) without an error"
        assert out.library, f"{out.error} is not a library error: {out.message}"
        assert any(n in out.message for n in names), f"{out.error} names none of {names}: {out.message}"
    return out
