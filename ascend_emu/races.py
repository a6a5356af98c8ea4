"""What the race sanitizer reports: a ``Race`` of two accesses (``Access``) and the edge that was missing.

Kinds:
- ``data-race``: two writes of overlapping bytes from different cores that nothing orders (atomics to the same word
  are not a race with each other);
- ``unpublished-read``: a read of another core's write that no flag / atomic / barrier the reader observed orders
  before it (including a read made before the data landed);
- ``slot-reuse``: a write over bytes another core read, with nothing ordering that read before it (the race double
  buffering avoids);
- ``uninitialized-read``: a read of GM or local bytes nothing wrote (GM written by ``to_gm`` / ``host_write`` counts;
  flags, counters and polls may read the zeros a GM allocation starts with);
- ``flag-misuse``: a flag, atomic or cross-core flag that the reader did observe, released by the writer after the
  write in program order but not ordered after it (the missing ``after=``); or a cross-core flag set at kernel end
  that no wait consumed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import RaceError

KINDS = ("data-race", "unpublished-read", "slot-reuse", "uninitialized-read", "flag-misuse")


@dataclass(frozen=True)
class Access:
    """One side of a race: who (kernel, die, core, pipe, instruction), when (modeled us: a read when it sampled, a
    write when it landed) and what (the GM tensor or local tile, bytes ``[byte_lo, byte_hi)`` of its allocation)."""
    kernel: str
    die: int | None
    core: str
    pipe: str
    instruction: str
    time_us: float
    tensor: str
    byte_lo: int
    byte_hi: int
    write: bool

    @property
    def where(self) -> str:
        """"die 1 aiv3" (or "the host")."""
        return "the host" if self.core == "host" else f"die {self.die} {self.core}"

    def __str__(self) -> str:
        who = "host" if self.core == "host" else f"kernel '{self.kernel}' die {self.die} {self.core} {self.pipe}"
        what = "writes" if self.write else "reads"
        return (f"{who} {self.instruction} {what} {self.tensor}[{self.byte_lo}:{self.byte_hi}] at "
                f"{self.time_us:.3f} us")


@dataclass
class Race:
    """A race: its ``kind`` (``KINDS``), the ``first`` access (None for an uninitialised read or an unpaired flag)
    and the ``second`` (the one that found it), the edge that was ``missing``, and how many times the same pair of
    instructions (same kernels, cores, instructions, tensor) raced (``count``)."""
    kind: str
    first: Access | None
    second: Access | None
    missing: str
    count: int = 1

    def __str__(self) -> str:
        parts = [f"{self.kind}:"]
        if self.first is not None:
            parts.append(str(self.first))
        if self.second is not None:
            parts.append(("then " if self.first is not None else "") + str(self.second))
        parts.append(f"-- missing: {self.missing}")
        if self.count > 1:
            parts.append(f"(x{self.count})")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready fields (``ascend-emu ... --sanitize --json``)."""
        return asdict(self)

    @property
    def signature(self) -> tuple:
        """The static identity of the race: kind and both accesses' kernel, core, instruction and tensor."""
        def sig(a):
            return None if a is None else (a.kernel, a.die, a.core, a.instruction, a.tensor)
        return self.kind, sig(self.first), sig(self.second)


def race_error(races: list, where: str) -> RaceError:
    """A RaceError for ``races`` found in ``where`` (a launch, a run)."""
    head = f"{len(races)} race{'s' if len(races) != 1 else ''} in {where}"
    shown = "\n  ".join(str(r) for r in races[:5])
    more = f"\n  ... and {len(races) - 5} more (Pod(sanitize='collect') lists them all)" if len(races) > 5 else ""
    return RaceError(f"{head}:\n  {shown}{more}", races)
