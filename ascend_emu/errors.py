"""One exception hierarchy for everything the emulator rejects (DESIGN.md 3.7).

Messages name what failed, the number asked for and the limit, and where: kernel, die, core, pipe and
simulated time when known. Kernel exceptions are wrapped once, at launch, with that location.
"""
from __future__ import annotations


class EmulatorError(Exception):
    """Base of every error the emulator raises on purpose."""

    _located = False      # whether the message already says where it happened (see ``locate``)


class CapacityError(EmulatorError):
    """A buffer, window or arena is asked for more bytes than it has."""


class AlignmentError(EmulatorError):
    """An address, length or shape breaks the alignment a buffer or copy path requires."""


class AddressError(EmulatorError):
    """An address is out of range, on a die that does not exist, or on the wrong die/core."""


class DTypeError(EmulatorError):
    """A dtype or shape that the instruction does not accept."""


class ArgumentError(EmulatorError, ValueError):
    """An option out of its allowed set (a flag id, a comparison, a rounding mode)."""


class ShapeError(DTypeError):
    """Operand shapes that do not fit together."""


class DeadlockError(EmulatorError):
    """A wait that can never be satisfied: names each blocked core and what it waits for."""

    _located = True       # it names every blocked core

    def __init__(self, message: str, blocked: list[str] | None = None):
        super().__init__(message)
        self.blocked = list(blocked or [])


class HazardError(EmulatorError):
    """A data race or synchronisation misuse that would corrupt data or hang real hardware."""


class RaceError(HazardError):
    """What the race sanitizer found in a launch (``Pod(sanitize=True)``): ``races`` lists them (``Race``: kind,
    both accesses, the missing edge)."""

    _located = True       # each race names its accesses

    def __init__(self, message: str, races: list | None = None):
        super().__init__(message)
        self.races = list(races or [])


class NumericError(EmulatorError, ArithmeticError):
    """A data path has no defined result for its operands (an integer division by zero)."""


class FaultError(EmulatorError):
    """An injected failure (a die or link taken down on purpose)."""


class KernelError(EmulatorError):
    """A user kernel raised a non-emulator exception; the original is the __cause__."""

    _located = True       # made with the kernel and core it names


def locate(error: EmulatorError, where: str) -> EmulatorError:
    """Append where an error happened (kernel, die, core, instruction, simulated time) to its message, once."""
    if not error._located:
        error.args = (f"{error.args[0] if error.args else ''} [{where}]",) + error.args[1:]
        error._located = True
    return error


class NotPartitionableError(ArgumentError):
    """A run that ``workers`` > 1 cannot split over processes (a message kind with no codec,
    ``messages.register``); the same run on one worker is fine."""


class WorkerError(EmulatorError):
    """A worker process of a multi-process run died, raised, or went silent past the bound; ``worker`` is its rank
    (None: not known, e.g. a peer left a gloo group) and ``cause`` what it reported (or how it ended)."""

    def __init__(self, worker: int | None, cause: str):
        super().__init__(cause if worker is None else f"worker {worker} {cause}")
        self.worker = worker
        self.cause = cause
