"""A deterministic fake model runner for the engine tests (not a model: a hash of the token history).

The next token after positions ``0 .. p`` is a hash of the tokens the fake actually finds at those positions in its
per-group KV blocks (through the sequence's block table), so a wrong block table, a lost or overwritten block or a bad
prefix reuse yields different tokens (or an error for a never-written position) and the tests see it.
"""
from __future__ import annotations

import hashlib
from array import array

from serving.batch import DieFailure, StepOutput

VOCAB = 1000


def _h(history, salt: int = 0) -> int:
    data = array("q", history).tobytes() + salt.to_bytes(2, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def next_token(history) -> int:
    """The fake model's greedy next token after ``history``."""
    return _h(history) % VOCAB


def reference(prompt, max_tokens: int, eos: int | None = None) -> list:
    """Plain greedy decoding of the fake model, without any engine."""
    hist, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(hist)
        out.append(t)
        hist.append(t)
        if t == eos:
            break
    return out


class FakeRunner:
    """``num_groups`` DP groups, each with ``num_blocks`` KV blocks of ``block_size`` token slots.
    ``num_drafts``: MTP drafts proposed after each sequence's last accepted position, each right with probability
    ``draft_accuracy`` (decided by a hash, so runs repeat). Step time: ``step_us + token_us * max tokens in a group``;
    copies: ``copy_us_per_block`` per block. ``failures``: [(from_call, group)]: the first ``execute`` call with index
    >= from_call that gives ``group`` work raises DieFailure for it (after writing the other groups' KV when
    ``write_before_fail``, to show partial writes of a void step do no harm)."""

    def __init__(self, num_groups: int = 2, num_blocks: int = 64, block_size: int = 16, *, num_drafts: int = 0,
                 draft_accuracy: float = 0.7, step_us: float = 1000.0, token_us: float = 0.0,
                 copy_us_per_block: float = 10.0, failures=(), write_before_fail: bool = True):
        self.num_groups, self.num_blocks, self.block_size = num_groups, num_blocks, block_size
        self.num_drafts, self.draft_accuracy = num_drafts, draft_accuracy
        self.step_us, self.token_us, self.copy_us_per_block = step_us, token_us, copy_us_per_block
        self.failures = list(failures)
        self.write_before_fail = write_before_fail
        self.kv = [[[None] * block_size for _ in range(num_blocks)] for _ in range(num_groups)]
        self.dropped: set = set()
        self.calls: list = []            # every batch passed to execute (failed ones included)
        self.copies: list = []           # (src_group, src_blocks, dst_group, dst_blocks)
        self.verified: list = []         # (drafts sent, drafts equal to the true continuation, prefix) per sequence

    # ---- KV access ----------------------------------------------------------------------------------------------
    def _write(self, g, work):
        bs = self.block_size
        if len(work.block_table) * bs < work.start_pos + len(work.tokens):
            raise AssertionError(f"rid {work.rid}: block table of {len(work.block_table)} blocks cannot hold "
                                 f"positions up to {work.start_pos + len(work.tokens) - 1}")
        for i, t in enumerate(work.tokens):
            p = work.start_pos + i
            self.kv[g][work.block_table[p // bs]][p % bs] = t

    def _read(self, g, table, n) -> list:
        bs, out = self.block_size, []
        for p in range(n):
            t = self.kv[g][table[p // bs]][p % bs]
            if t is None:
                raise AssertionError(f"group {g}: position {p} (block {table[p // bs]}) was never written")
            out.append(t)
        return out

    # ---- Runner protocol ----------------------------------------------------------------------------------------
    def execute(self, batch):
        call = len(self.calls)
        self.calls.append(batch)
        if len(batch.groups) != self.num_groups:
            raise AssertionError(f"batch has {len(batch.groups)} groups, runner has {self.num_groups}")
        for g, works in enumerate(batch.groups):
            if works and g in self.dropped:
                raise AssertionError(f"work sent to dropped group {g}")
        fail = next(((i, g) for i, (c, g) in enumerate(self.failures) if call >= c and batch.groups[g]), None)
        if fail is not None:
            del self.failures[fail[0]]
            if self.write_before_fail:
                for g, works in enumerate(batch.groups):
                    if g != fail[1]:
                        for w in works:
                            self._write(g, w)
            raise DieFailure(die=2 * fail[1], group=fail[1])
        tokens, drafts = {}, {}
        for g, works in enumerate(batch.groups):
            for w in works:
                self._write(g, w)
            for w in works:
                end = w.start_pos + len(w.tokens)
                hist = self._read(g, w.block_table, end)
                if w.want > 1:
                    self._log_drafts(hist, w)
                out = tokens[w.rid] = [next_token(hist[:p + 1]) for p in range(end - w.want, end)]
                if self.num_drafts and w.want:
                    # draft after the last accepted position (the engine's greedy rule), like the real runner
                    acc, sent = 0, w.tokens[len(w.tokens) - (w.want - 1):] if w.want > 1 else []
                    while acc < len(sent) and sent[acc] == out[acc]:
                        acc += 1
                    drafts[w.rid] = self._propose(hist[:end - w.want + 1 + acc] + [out[acc]])
        busiest = max(sum(len(w.tokens) for w in works) for works in batch.groups)
        return StepOutput(tokens=tokens, drafts=drafts, modeled_us=self.step_us + self.token_us * busiest)

    def copy_blocks(self, src_group, src_blocks, dst_group, dst_blocks) -> float:
        if len(src_blocks) != len(dst_blocks):
            raise AssertionError(f"copy of {len(src_blocks)} blocks into {len(dst_blocks)}")
        if src_group in self.dropped or dst_group in self.dropped:
            raise AssertionError(f"copy {src_group}->{dst_group} touches a dropped group")
        for s, d in zip(src_blocks, dst_blocks):
            self.kv[dst_group][d] = list(self.kv[src_group][s])
        self.copies.append((src_group, list(src_blocks), dst_group, list(dst_blocks)))
        return self.copy_us_per_block * len(src_blocks)

    def drop_group(self, group) -> None:
        self.dropped.add(group)
        self.kv[group] = None

    # ---- MTP ----------------------------------------------------------------------------------------------------
    def _right(self, hist) -> bool:
        return _h(hist, salt=1) % 1000 < self.draft_accuracy * 1000

    def _propose(self, hist) -> list:
        out, h = [], list(hist)
        for _ in range(self.num_drafts):
            t = next_token(h)
            d = t if self._right(h) else (t + 1) % VOCAB
            out.append(d)
            h.append(d)
        return out

    def _log_drafts(self, hist, w):
        """Independent check of the engine's acceptance: sent drafts vs the true continuation."""
        base = w.start_pos + 1            # hist[base:] are the drafts, hist[:base] the verified history
        sent = hist[base:]
        prefix = 0
        while prefix < len(sent) and sent[prefix] == next_token(hist[:base + prefix]):
            prefix += 1
        self.verified.append((len(sent), prefix))
