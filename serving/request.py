"""One request: its prompt, sampling parameters, generated tokens, KV placement and modeled-clock timestamps.

A request's token sequence is ``prompt + output``. Its KV lives in one DP group: ``block_table`` holds the group's
block ids for positions ``0 ..``, and positions ``0 .. num_computed - 1`` hold KV of exactly ``tokens[:num_computed]``
(anything written beyond, e.g. rejected MTP drafts or a rolled-back step, is junk that later steps overwrite).
A request needs ``num_tokens - num_computed`` more positions computed before its next token can be sampled: more than
one while it prefills, exactly one when it decodes (the last sampled token is not in the KV yet).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ascend_emu.errors import ArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """Greedy decoding only. ``max_tokens``: output tokens to generate (the EOS token counts and is kept);
    ``eos_token_id``: stop after emitting it unless ``ignore_eos``; ``temperature`` must be 0 (greedy)."""
    max_tokens: int = 16
    temperature: float = 0.0
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature != 0:
            raise ArgumentError(f"temperature={self.temperature}: only greedy decoding (temperature=0) is supported")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ArgumentError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if self.eos_token_id is not None and (not isinstance(self.eos_token_id, int) or self.eos_token_id < 0):
            raise ArgumentError(f"eos_token_id={self.eos_token_id!r} must be None or an int >= 0")


class RequestState(enum.Enum):
    WAITING = "waiting"        # not placed in a group (new, or moved off a dead group)
    RUNNING = "running"        # placed in a group: prefilling or decoding
    HANDOFF = "handoff"        # PD: prefilled, KV on a prefill group, waiting for decode-side blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """``arrival_us``/``ready_us``/``first_token_us``/``finish_us`` are modeled us. ``ready_us``: earliest modeled
    time the request may be scheduled (its arrival, a failure time after a move, or the end of its KV transfer)."""
    rid: int
    prompt: list
    params: SamplingParams
    arrival_us: float = 0.0
    state: RequestState = RequestState.WAITING
    output: list = field(default_factory=list)
    group: int | None = None
    block_table: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)   # chain hashes of the full, computed blocks (table prefix)
    num_computed: int = 0                                # positions whose KV is valid in ``group``
    drafts: list = field(default_factory=list)           # MTP drafts following the last token (verified next step)
    ready_us: float = 0.0
    first_token_us: float | None = None
    finish_us: float | None = None
    finish_reason: str | None = None                     # "length" | "stop"
    num_recomputes: int = 0                              # times the KV was lost (die failure) and rebuilt
    moved: bool = False                                  # re-queued after a die failure (placed before new ones)

    def __post_init__(self):
        if not self.prompt:
            raise ArgumentError(f"request {self.rid}: empty prompt (need at least 1 token)")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt):
            raise ArgumentError(f"request {self.rid}: prompt tokens must be ints >= 0")
        self.prompt = list(self.prompt)
        self.ready_us = max(self.ready_us, self.arrival_us)

    @property
    def tokens(self) -> list:
        """``prompt + output`` (a new list)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def num_remaining(self) -> int:
        """Output tokens still allowed by ``max_tokens``."""
        return self.params.max_tokens - len(self.output)

    @property
    def max_positions(self) -> int:
        """KV positions the request can ever hold: the last output token is never fed back."""
        return len(self.prompt) + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def append(self, new_tokens: list, now_us: float) -> int:
        """Append sampled tokens (stopping at ``max_tokens`` or EOS); stamp times at ``now_us``. Returns how many
        were kept."""
        kept = 0
        for t in new_tokens:
            if self.num_remaining <= 0 or self.finish_reason:
                break
            self.output.append(int(t))
            kept += 1
            if self.first_token_us is None:
                self.first_token_us = now_us
            eos = self.params.eos_token_id
            if eos is not None and not self.params.ignore_eos and t == eos:
                self.finish_reason = "stop"
        if self.finish_reason is None and self.num_remaining <= 0:
            self.finish_reason = "length"
        if self.finish_reason:
            self.finish_us = now_us
        return kept

    def lose_kv(self, now_us: float) -> None:
        """The group holding this request's KV died: forget the placement (tokens are kept) and wait again."""
        self.state = RequestState.WAITING
        self.group = None
        self.block_table = []
        self.block_hashes = []
        self.num_computed = 0
        self.drafts = []
        self.ready_us = max(self.ready_us, now_us)
        self.num_recomputes += 1
        self.moved = True
