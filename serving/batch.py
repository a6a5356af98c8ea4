"""What the engine hands a model runner each step, and what it gets back (the seam between scheduling and execution).

One step is lock-step across DP attention groups: every group gets a (possibly empty) list of sequences, so the
expert-parallel MoE layers see every group (idle groups join with empty batches).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ascend_emu.errors import EmulatorError


@dataclass
class SeqWork:
    """One sequence's work in a step. ``tokens``: token ids to run now (a prompt chunk, or the last sampled token
    followed by MTP draft tokens); they take positions ``start_pos .. start_pos + len(tokens) - 1``.
    ``block_table``: the group's KV block ids holding positions ``0 .. start_pos + len(tokens) - 1``
    (``block_size`` positions per block). ``want``: how many positions at the end of ``tokens`` need a next-token
    prediction (1 for a prefill's last chunk or plain decode, 1 + drafts with MTP, 0 for a non-final prefill chunk;
    runners with an MTP head refuse 0: the head needs a prompt's every position in one step)."""
    rid: int
    tokens: list
    start_pos: int
    block_table: list
    want: int = 1


@dataclass
class StepBatch:
    """``groups[g]``: the sequences of DP group ``g`` this step (empty list: the group idles but joins the MoE)."""
    groups: list
    step: int = 0
    prefill: bool = False          # True when the step runs on the prefill side of a PD-disaggregated pod


@dataclass
class StepOutput:
    """``tokens[rid]``: greedy next-token ids for the last ``want`` positions of the sequence's tokens.
    ``drafts[rid]``: MTP draft tokens proposed after the last *accepted* position (the engine's greedy rule: drafts
    are accepted up to the first mismatch with ``tokens``); empty without MTP.
    ``modeled_us``: modeled device time of the step; ``breakdown``: modeled us per op name; ``per_layer``: modeled
    us per "layer{i}.{op}"; ``timeline``: (stream, name, start_us, end_us) per op within the step."""
    tokens: dict
    drafts: dict = field(default_factory=dict)
    modeled_us: float = 0.0
    breakdown: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)


class DieFailure(EmulatorError):
    """A die died during a step: the step's outputs are void; ``group`` is the DP group it served (or None)."""

    def __init__(self, die: int, group: int | None, message: str = ""):
        self.die, self.group = die, group
        super().__init__(message or f"die {die} (DP group {group}) failed during the step")


class Runner(Protocol):
    """Executes steps. ``num_groups`` DP groups, each with a KV cache of ``num_blocks`` blocks of ``block_size``."""
    num_groups: int
    num_blocks: int
    block_size: int

    def execute(self, batch: StepBatch) -> StepOutput: ...

    def copy_blocks(self, src_group: int, src_blocks: list, dst_group: int, dst_blocks: list) -> float:
        """Copy KV blocks between groups (PD transfer); returns modeled us."""
        ...

    def drop_group(self, group: int) -> None:
        """Forget a dead group (its KV is lost; EPLB shrinks the expert placement onto the survivors). Later batches
        still have ``num_groups`` entries; a dropped group's entry is always an empty list and is skipped."""
        ...
