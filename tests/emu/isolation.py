"""Run test cases in a child process, so a case that crashes the interpreter or hangs fails its test instead of the
whole run.

``Child.call(fn, *args)`` runs the module-level function ``fn(*args)`` in a long-lived child (started with "spawn":
no state shared with pytest's process) and returns ``Outcome``: what ``fn`` returned, or the exception it raised
(its class, whether it is an ``EmulatorError``, its message). A child that dies or runs past ``timeout_s`` makes the
call raise ``Crashed`` / ``Hung`` and is replaced for the next call.
"""
from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass


class Crashed(AssertionError):
    """The child died while running a case (a segfault, an abort, a hard exit)."""


class Hung(AssertionError):
    """The case ran past its timeout."""


@dataclass(frozen=True)
class Outcome:
    value: object = None             # what the case returned (picklable)
    error: str | None = None         # the exception's class name, if it raised
    library: bool = False            # whether that exception is an ascend_emu EmulatorError
    message: str = ""
    trace: str = ""

    def __str__(self):
        return f"returned {self.value!r}" if self.error is None else f"raised {self.error}: {self.message}"


def _serve(conn) -> None:
    from ascend_emu import EmulatorError
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        fn, args = job
        try:
            out = Outcome(value=fn(*args))
        except BaseException as e:  # report everything: the parent decides what is allowed
            out = Outcome(error=type(e).__name__, library=isinstance(e, EmulatorError), message=str(e),
                          trace=traceback.format_exc(limit=-6))
        conn.send(out)


class Child:
    """One worker process for a test module; ``close()`` it at the end."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self._proc = self._conn = None

    def call(self, fn, *args) -> Outcome:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((fn, args))
        if not self._conn.poll(self.timeout_s):
            self._stop()
            raise Hung(f"{fn.__name__}{args!r} ran past {self.timeout_s} s")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.join(5)
            code = self._proc.exitcode
            self._stop()
            raise Crashed(f"{fn.__name__}{args!r} killed the child process (exit code {code})") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._stop()
