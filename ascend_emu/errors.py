"""One exception hierarchy for everything the emulator rejects (DESIGN.md 3.7).

Messages name what failed, the number asked for and the limit, and where: kernel, die, core, pipe and
simulated time when known. Kernel exceptions are wrapped once, at launch, with that location.
"""
from __future__ import annotations


class EmulatorError(Exception):
    """Base of every error the emulator raises on purpose."""


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

    def __init__(self, message: str, blocked: list[str] | None = None):
        super().__init__(message)
        self.blocked = list(blocked or [])


class HazardError(EmulatorError):
    """A data race or synchronisation misuse that would corrupt data or hang real hardware."""


class FaultError(EmulatorError):
    """An injected failure (a die or link taken down on purpose)."""


class KernelError(EmulatorError):
    """A user kernel raised a non-emulator exception; the original is the __cause__."""
