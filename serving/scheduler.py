"""One side's scheduler: owns the queues and per-group block pools of a set of DP groups and says what runs next.

Used once for a colocated pod, or twice with prefill/decode disaggregation (a prefill side that only builds KV and a
decode side fed by KV transfers). Each step, per DP group and within ``token_budget`` tokens: decodes first (the last
sampled token plus MTP drafts), then prefill chunks in admission order (chunked prefill). A request is placed in a
group only if the group is below ``max_batch`` sequences and can reserve blocks for everything the request may ever
hold there (prompt + ``max_tokens`` on a decoding side, the prompt on a prefill side), so a placed request never runs
out of KV and nothing is ever preempted; requests that fit nowhere wait (first come, first served).

Group choice (``policy``): ``"kv"`` picks the group with the lowest projected KV usage (held + reserved + this
request's new blocks, so a group already caching the request's prefix is favoured); ``"round_robin"`` takes the next
group in cyclic order that fits.
"""
from __future__ import annotations

import bisect
import math

from ascend_emu.errors import ArgumentError, CapacityError

from .batch import SeqWork
from .kv_cache import BlockPool
from .request import Request, RequestState

POLICIES = ("kv", "round_robin")


def pd_source_rank(decode_dp_rank: int, decode_tp_rank: int, *, prefill_tp: int, decode_tp: int,
                   decode_dp: int) -> int:
    """Prefill rank that sends its KV to a decode rank (balanced PD mapping): ``ratio = prefill_tp / decode_tp``,
    ``group = decode_dp_rank // (decode_dp / ratio)``, ``source = group * decode_tp + decode_tp_rank``."""
    for name, v in (("prefill_tp", prefill_tp), ("decode_tp", decode_tp), ("decode_dp", decode_dp)):
        if not isinstance(v, int) or v < 1:
            raise ArgumentError(f"{name}={v!r} must be an int >= 1")
    if prefill_tp % decode_tp:
        raise ArgumentError(f"prefill_tp={prefill_tp} must be a multiple of decode_tp={decode_tp}")
    ratio = prefill_tp // decode_tp
    if decode_dp % ratio:
        raise ArgumentError(f"decode_dp={decode_dp} must be a multiple of prefill_tp/decode_tp={ratio}")
    if not 0 <= decode_dp_rank < decode_dp:
        raise ArgumentError(f"decode_dp_rank={decode_dp_rank} out of range 0..{decode_dp - 1}")
    if not 0 <= decode_tp_rank < decode_tp:
        raise ArgumentError(f"decode_tp_rank={decode_tp_rank} out of range 0..{decode_tp - 1}")
    group = decode_dp_rank // (decode_dp // ratio)
    return group * decode_tp + decode_tp_rank


class Scheduler:
    """Queues and block pools of the DP groups ``groups`` (ids in the runner's ``0 .. num_groups - 1``).
    ``prefill_only``: the side hands requests off once prefilled (PD prefill side) and reserves prompt blocks only.
    ``chunked_prefill=False``: a prefill runs whole in one step (the MTP head needs every position's hidden state)."""

    def __init__(self, groups, *, num_groups: int, num_blocks: int, block_size: int, max_batch: int,
                 token_budget: int, policy: str = "kv", prefill_only: bool = False, prefix_cache: bool = True,
                 mtp: int = 0, chunked_prefill: bool = True):
        if policy not in POLICIES:
            raise ArgumentError(f"policy={policy!r}: use one of {POLICIES}")
        if not groups:
            raise ArgumentError("a scheduler needs at least one DP group")
        self.alive = list(groups)
        self.num_groups = num_groups
        self.block_size = block_size
        self.max_batch, self.token_budget = max_batch, token_budget
        self.policy, self.prefill_only = policy, prefill_only
        self.prefix_cache, self.mtp, self.chunked_prefill = prefix_cache, mtp, chunked_prefill
        self.pools = {g: BlockPool(num_blocks, block_size) for g in self.alive}
        self.running: dict[int, list] = {g: [] for g in self.alive}
        self.waiting: list = []          # ordered by (moved first, arrival, rid)
        self._rr = 0

    # ---- queues -------------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request for placement; requests moved off a dead group go ahead of new ones."""
        req.state = RequestState.WAITING
        bisect.insort(self.waiting, req, key=lambda r: (not r.moved, r.arrival_us, r.rid))

    def reserve_positions(self, req: Request) -> int:
        """KV positions to reserve for ``req`` on this side."""
        return req.num_tokens if self.prefill_only else req.max_positions

    def _outstanding(self, g: int) -> int:
        """Blocks promised to group ``g``'s running requests but not allocated yet."""
        pool = self.pools[g]
        return sum(max(0, pool.blocks_for(self.reserve_positions(r)) - len(r.block_table)) for r in self.running[g])

    # ---- placement ----------------------------------------------------------------------------------------------
    def _fit(self, req: Request, g: int):
        """(projected blocks in use after placing, prefix hits) if ``req`` fits in group ``g``, else None."""
        pool = self.pools[g]
        if len(self.running[g]) >= self.max_batch:
            return None
        hits, hashes = ([], [])
        if self.prefix_cache:
            hits, hashes = pool.match_prefix(req.tokens, max_blocks=(req.num_tokens - 1) // self.block_size)
        need = pool.blocks_for(self.reserve_positions(req)) - sum(1 for b in hits if pool.ref_count(b) > 0)
        outstanding = self._outstanding(g)
        if pool.num_free - outstanding < need:
            return None
        return pool.num_used + outstanding + need, (hits, hashes)

    def choose_group(self, req: Request):
        """(group, (prefix blocks, hashes)) by the policy, or None when no group fits. Changes nothing."""
        n = len(self.alive)
        if self.policy == "round_robin":
            for i in range(n):
                g = self.alive[(self._rr + i) % n]
                fit = self._fit(req, g)
                if fit:
                    return g, fit[1]
            return None
        best = None
        for g in self.alive:
            fit = self._fit(req, g)
            if fit and (best is None or fit[0] < best[0]):
                best = (fit[0], g, fit[1])
        return None if best is None else (best[1], best[2])

    def place(self, req: Request, g: int, prefix) -> None:
        """Put ``req`` in group ``g`` with its cached prefix ``(blocks, hashes)`` (references taken here)."""
        hits, hashes = prefix
        self.pools[g].acquire(hits)
        req.state, req.group = RequestState.RUNNING, g
        req.block_table, req.block_hashes = list(hits), list(hashes)
        req.num_computed = len(hits) * self.block_size
        self.running[g].append(req)
        self._rr = (self.alive.index(g) + 1) % len(self.alive)

    def admit_waiting(self, now_us: float) -> list:
        """Place waiting requests that are ready by ``now_us``, in order, stopping at the first that fits nowhere."""
        placed = []
        for req in list(self.waiting):
            if req.ready_us > now_us:
                continue
            choice = self.choose_group(req)
            if choice is None:
                break
            self.waiting.remove(req)
            self.place(req, *choice)
            placed.append(req)
        return placed

    def next_time(self, now_us: float) -> float:
        """Earliest modeled us >= ``now_us`` at which this side has a step to run (``math.inf``: none without an
        outside event such as a finished request or a KV transfer)."""
        t = math.inf
        ready = [r.ready_us for g in self.alive for r in self.running[g]]
        if ready:
            t = max(now_us, min(ready))
        head = next((r for r in self.waiting if r.ready_us <= now_us), None)
        if head is not None:
            if self.choose_group(head) is not None:
                t = min(t, now_us)
        elif self.waiting:
            first = min(self.waiting, key=lambda r: (r.ready_us, r.rid))
            if self.choose_group(first) is not None:
                t = min(t, first.ready_us)
        return t

    # ---- one step -----------------------------------------------------------------------------------------------
    def plan(self, now_us: float):
        """Admit ready requests, then build this step's work. Returns (per-group SeqWork lists for all
        ``num_groups`` groups, [(request, work, is_decode)]). Allocates the blocks the work writes into."""
        self.admit_waiting(now_us)
        groups = [[] for _ in range(self.num_groups)]
        items = []
        for g in self.alive:
            budget = self.token_budget
            runnable = [r for r in self.running[g] if r.ready_us <= now_us]
            decodes = [r for r in runnable if r.num_tokens - r.num_computed == 1]
            prefills = [r for r in runnable if r.num_tokens - r.num_computed > 1]
            for r in decodes:
                k = max(0, min(self.mtp, len(r.drafts), r.num_remaining - 1))
                work = self._work(r, [r.last_token] + r.drafts[:k], want=1 + k)
                budget -= len(work.tokens)
                groups[g].append(work)
                items.append((r, work, bool(r.output)))
            for r in prefills:
                left = r.num_tokens - r.num_computed
                if not self.chunked_prefill and left > budget:
                    if left > self.token_budget:
                        raise CapacityError(f"request {r.rid}: {left} tokens to prefill exceed token_budget="
                                            f"{self.token_budget} and chunked prefill is off")
                    break                  # whole prefills only: wait for a step with room (FCFS)
                if budget <= 0:
                    break
                n = min(budget, left)
                final = r.num_computed + n == r.num_tokens
                work = self._work(r, r.tokens[r.num_computed:r.num_computed + n], want=1 if final else 0)
                budget -= n
                groups[g].append(work)
                items.append((r, work, False))
        return groups, items

    def _work(self, r: Request, tokens: list, want: int) -> SeqWork:
        pool = self.pools[r.group]
        extra = pool.blocks_for(r.num_computed + len(tokens)) - len(r.block_table)
        if extra > 0:
            r.block_table += pool.allocate(extra)   # covered by the reservation made at placement
        return SeqWork(rid=r.rid, tokens=list(tokens), start_pos=r.num_computed, block_table=list(r.block_table),
                       want=want)

    def commit_full_blocks(self, req: Request) -> None:
        """Register (for prefix reuse) the request's blocks that became full of computed positions."""
        if not self.prefix_cache:
            return
        pool, bs = self.pools[req.group], self.block_size
        tokens = None
        for i in range(len(req.block_hashes), req.num_computed // bs):
            tokens = tokens or req.tokens
            parent = req.block_hashes[-1] if req.block_hashes else -1
            req.block_hashes.append(pool.commit(req.block_table[i], parent, tokens[i * bs:(i + 1) * bs]))

    def release(self, req: Request) -> None:
        """Take a running request out of its group and free its blocks (finished)."""
        self.detach(req)
        self.pools[req.group].free(req.block_table)

    def detach(self, req: Request) -> None:
        """Take a running request out of its group's batch; its blocks stay held (PD handoff)."""
        self.running[req.group].remove(req)

    def drop_group(self, g: int, now_us: float) -> list:
        """Forget dead group ``g``; its running requests lose their KV and are re-queued (returned)."""
        if g not in self.alive:
            raise ArgumentError(f"group {g} is not a live group of this side (alive: {self.alive})")
        moved = self.running.pop(g)
        self.alive.remove(g)
        del self.pools[g]
        self._rr = 0
        for r in moved:
            r.lose_kv(now_us)
        return moved

    def kv_usage(self) -> dict:
        """Per live group: fraction of blocks held."""
        return {g: self.pools[g].usage for g in self.alive}
