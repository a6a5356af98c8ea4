"""The serving loop: requests in, lock-step DP steps through a model runner, tokens and modeled-clock metrics out.

Clocks (modeled us, from 0). Colocated: one clock; a step starts when the previous one ends (or, when idle, at the
next arrival) and every token it samples is stamped at its end. Prefill/decode disaggregated (``pd=PDConfig(...)``):
one clock per side on the same timeline; the engine always runs the side whose next step starts earliest (ties: the
decode side). A prefill step samples the first token; the request then waits (holding its prefill blocks) until the
decode side, at a decode-clock time >= that, finds a group with room: blocks are allocated there first (none free:
back-pressure, the request keeps waiting, first come first served, never dropped), the KV is copied with
``runner.copy_blocks`` and the request joins decode steps from ``decode clock + copy us`` (the copy overlaps other
requests' decode steps). Modeled as: the prefill blocks are freed when the copy is issued.

MTP (``mtp=k``): a decoding sequence runs ``[last token] + drafts`` (up to ``k`` drafts from the previous step);
drafts are accepted up to the first mismatch with the target tokens, then the target token at that position is
appended. KV positions of rejected drafts are not freed: ``num_computed`` is rewound and the next step overwrites them.
The drafts a step returns must follow the last *accepted* position (the runner applies the same greedy rule, as
``serving.runner`` does), so they are used next step whatever was rejected.

Faults: ``runner.execute`` may raise ``DieFailure``; nothing of that step is applied (KV written beyond each
request's ``num_computed`` is junk by definition), the group is dropped, its requests re-queued with their tokens
(moved first) and later recomputed by prefilling prompt + generated tokens on a survivor (on the prefill side with
PD), and the step is planned again and re-executed. The failed attempt's time is not modeled (not charged).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ascend_emu.errors import ArgumentError, CapacityError, DeadlockError, EmulatorError, FaultError

from .batch import DieFailure, StepBatch
from .request import Request, RequestState, SamplingParams
from .scheduler import Scheduler

MAX_UNOWNED_FAILURES = 8        # consecutive DieFailure(group=None) before giving up


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation: DP group ids (runner numbering) of each side; disjoint, non-empty."""
    prefill_groups: tuple
    decode_groups: tuple

    def __post_init__(self):
        object.__setattr__(self, "prefill_groups", tuple(self.prefill_groups))
        object.__setattr__(self, "decode_groups", tuple(self.decode_groups))
        if not self.prefill_groups or not self.decode_groups:
            raise ArgumentError(f"PDConfig needs prefill and decode groups, got {self.prefill_groups} and "
                                f"{self.decode_groups}")
        both = set(self.prefill_groups) & set(self.decode_groups)
        if both:
            raise ArgumentError(f"PDConfig: groups {sorted(both)} are on both sides")
        for side in (self.prefill_groups, self.decode_groups):
            if len(set(side)) != len(side):
                raise ArgumentError(f"PDConfig: repeated group in {side}")


@dataclass
class RequestResult:
    """One finished request. Times in modeled us; ``ttft_ms`` = first token - arrival; ``tpot_ms`` = (finish -
    first token) / (output tokens - 1), None for a single output token."""
    rid: int
    prompt_len: int
    output_tokens: list
    finish_reason: str
    arrival_us: float
    first_token_us: float
    finish_us: float
    ttft_ms: float
    tpot_ms: float | None
    num_recomputes: int


@dataclass
class Metrics:
    """``tokens_per_s``: output tokens / (last finish - first arrival) on the modeled clock. MTP: ``acceptance_rate``
    = accepted / verified drafts (None: no drafts verified); ``tokens_per_step`` = tokens emitted per decoding
    sequence per step. ``mean_kv_spread``: mean over steps of (max - min) KV usage fraction across a side's groups.
    Request-level fields cover the requests asked for; acceptance_rate, tokens_per_step, num_steps, num_failures,
    num_backpressured and mean_kv_spread count everything the engine has run."""
    num_requests: int
    num_output_tokens: int
    makespan_us: float
    tokens_per_s: float | None
    mean_ttft_ms: float | None
    mean_tpot_ms: float | None
    acceptance_rate: float | None
    tokens_per_step: float | None
    num_steps: int
    num_failures: int
    num_backpressured: int
    mean_kv_spread: float


@dataclass
class Results:
    requests: list
    metrics: Metrics


@dataclass
class StepRecord:
    """One executed step: ``group_tokens[g]`` tokens run by group g; ``kv_usage``: live group -> fraction held after
    the step."""
    step: int
    side: str
    start_us: float
    modeled_us: float
    group_tokens: list
    kv_usage: dict


@dataclass
class TransferRecord:
    """A PD KV transfer: handed off at ``ready_us`` (end of prefill), issued at ``start_us`` (decode clock)."""
    rid: int
    src_group: int
    dst_group: int
    num_blocks: int
    ready_us: float
    start_us: float
    copy_us: float


class _Side:
    def __init__(self, name: str, sched: Scheduler, prefill: bool):
        self.name, self.sched, self.prefill = name, sched, prefill
        self.clock_us = 0.0


class Engine:
    """Serve requests on ``runner`` (see ``serving.batch.Runner``). ``max_batch``: sequences per DP group;
    ``token_budget``: tokens per DP group per step (must cover ``max_batch * (1 + mtp)`` decode tokens);
    ``policy``: ``"kv"`` or ``"round_robin"`` DP group choice; ``pd``: ``PDConfig`` or None (colocated);
    ``mtp``: draft tokens verified per decode step; ``chunked_prefill``: split prompts across steps (None: only
    without MTP, whose head needs every position of a prompt in one step); ``prefix_cache``: reuse cached full
    blocks; ``max_steps``: guard per ``run`` (None: derived from the work)."""

    def __init__(self, runner, *, max_batch: int = 8, token_budget: int = 512, policy: str = "kv",
                 pd: PDConfig | None = None, mtp: int = 0, chunked_prefill: bool | None = None,
                 prefix_cache: bool = True, max_steps: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ArgumentError(f"max_batch={max_batch!r} must be an int >= 1")
        if not isinstance(mtp, int) or mtp < 0:
            raise ArgumentError(f"mtp={mtp!r} must be an int >= 0")
        if not isinstance(token_budget, int) or token_budget < max_batch * (1 + mtp):
            raise ArgumentError(f"token_budget={token_budget!r} must be an int >= max_batch * (1 + mtp) = "
                                f"{max_batch * (1 + mtp)} (every decode must fit in a step)")
        if pd is not None and not isinstance(pd, PDConfig):
            raise ArgumentError(f"pd={pd!r} must be None or a PDConfig")
        self.runner, self.pd, self.mtp, self.max_steps = runner, pd, mtp, max_steps
        self.token_budget = token_budget
        self.chunked_prefill = (mtp == 0) if chunked_prefill is None else bool(chunked_prefill)
        n = runner.num_groups
        common = dict(num_groups=n, num_blocks=runner.num_blocks, block_size=runner.block_size,
                      max_batch=max_batch, token_budget=token_budget, policy=policy, prefix_cache=prefix_cache,
                      chunked_prefill=self.chunked_prefill)
        if pd is None:
            self._decode = _Side("colocated", Scheduler(range(n), mtp=mtp, **common), prefill=False)
            self._prefill = self._decode
            self._sides = [self._decode]
        else:
            for g in pd.prefill_groups + pd.decode_groups:
                if not isinstance(g, int) or not 0 <= g < n:
                    raise ArgumentError(f"PDConfig group {g!r} out of range 0..{n - 1}")
            self._prefill = _Side("prefill", Scheduler(pd.prefill_groups, prefill_only=True, **common), prefill=True)
            self._decode = _Side("decode", Scheduler(pd.decode_groups, mtp=mtp, **common), prefill=False)
            self._sides = [self._decode, self._prefill]      # ties go to the decode side
        self.requests: dict[int, Request] = {}
        self.trace: list[StepRecord] = []
        self.transfers: list[TransferRecord] = []
        self._handoffs: list[Request] = []                  # PD: prefilled, waiting for decode blocks
        self._backpressured: set = set()
        self._dropped: set = set()
        self._step = 0
        self.num_failures = 0
        self._unowned_failures = 0
        self._drafts_sent = self._drafts_accepted = 0
        self._decode_seq_steps = self._decode_tokens = 0

    @property
    def clock_us(self) -> float:
        """The latest side clock (modeled us)."""
        return max(side.clock_us for side in self._sides)

    # ---- requests -----------------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, *, arrival_us: float = 0.0) -> int:
        """Queue a request arriving at ``arrival_us`` (modeled us); returns its id."""
        req = self._new_request(len(self.requests), prompt, params, arrival_us)
        self.requests[req.rid] = req
        self._prefill.sched.add(req)
        return req.rid

    def _new_request(self, rid: int, prompt, params, arrival_us) -> Request:
        """A checked request (nothing registered yet): prompt ids within the runner's vocabulary, a finite arrival
        time, room in the KV pools and the token budget."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ArgumentError(f"params={params!r} must be a SamplingParams")
        if isinstance(arrival_us, bool) or not isinstance(arrival_us, (int, float)) or not 0 <= arrival_us < math.inf:
            raise ArgumentError(f"request {rid}: arrival_us={arrival_us!r} must be a modeled time >= 0")
        req = Request(rid=rid, prompt=list(prompt), params=params, arrival_us=float(arrival_us))
        vocab = getattr(self.runner, "vocab_size", None)
        bad = [t for t in req.prompt if vocab is not None and t >= vocab]
        if bad:
            raise ArgumentError(f"request {rid}: prompt token {bad[0]} is outside the model's vocabulary "
                                f"0..{vocab - 1}")
        for side in self._sides:
            pool = next(iter(side.sched.pools.values()))
            need = pool.blocks_for(req.max_positions)
            if need > pool.num_blocks:
                raise CapacityError(f"request {req.rid}: prompt {len(req.prompt)} + max_tokens "
                                    f"{params.max_tokens} needs {need} KV blocks of {pool.block_size}, a "
                                    f"{side.name} group has {pool.num_blocks}")
        if not self.chunked_prefill and len(req.prompt) > self.token_budget:
            raise CapacityError(f"request {req.rid}: prompt of {len(req.prompt)} tokens exceeds token_budget="
                                f"{self.token_budget} and chunked prefill is off")
        return req

    def generate(self, prompts, params=None, *, arrival_us=None) -> Results:
        """Add one request per prompt (``params``: one SamplingParams or one per prompt; ``arrival_us``: one
        time per prompt or None for 0), run to completion, return those requests' results in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        times = list(arrival_us) if arrival_us is not None else [0.0] * len(prompts)
        if len(plist) != len(prompts) or len(times) != len(prompts):
            raise ArgumentError(f"{len(prompts)} prompts but {len(plist)} params and {len(times)} arrival times")
        n0 = len(self.requests)
        for i, (p, sp, t) in enumerate(zip(prompts, plist, times)):      # all checked before any is queued
            self._new_request(n0 + i, p, sp, t)
        rids = [self.add_request(p, sp, arrival_us=t) for p, sp, t in zip(prompts, plist, times)]
        self.run()
        return self.results(rids)

    def run(self) -> Results:
        """Step until every request has finished; results of all requests."""
        pending = [r for r in self.requests.values() if not r.is_finished]
        work = sum(r.num_tokens + r.num_remaining for r in pending)
        limit = self.max_steps or work * (self.runner.num_groups + 1) + 100
        first = self._step
        while any(not r.is_finished for r in pending):
            if self._step - first >= limit:
                raise DeadlockError(f"engine still busy after {limit} steps (max_steps): " + self._stuck(),
                                    blocked=[f"request {r.rid}" for r in pending if not r.is_finished])
            self.step()
        return self.results()

    # ---- one step -----------------------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one lock-step step on the side whose next step starts earliest (re-executed on the survivors after a
        die failure). Returns the requests finished by it ([] when there is nothing to do)."""
        for _ in range(10_000):
            side, start = self._next_side()
            if side is None:
                if any(not r.is_finished for r in self.requests.values()):
                    raise DeadlockError("no side can make progress: " + self._stuck())
                return []
            side.clock_us = max(side.clock_us, start)
            if self.pd is not None and side is self._decode:
                self._transfer_handoffs(side.clock_us)
            groups, items = side.sched.plan(side.clock_us)
            if not items:
                continue            # e.g. only just-transferred requests, ready after their copy
            batch = StepBatch(groups=groups, step=self._step, prefill=side.prefill)
            try:
                out = self.runner.execute(batch)
            except DieFailure as failure:
                self._on_failure(side, failure)
                continue
            self._unowned_failures = 0
            return self._apply(side, groups, items, out)
        raise DeadlockError("10000 attempts formed no step: " + self._stuck())

    def _next_side(self):
        best, best_t = None, math.inf
        for side in self._sides:
            t = side.sched.next_time(side.clock_us)
            if side is self._decode and self.pd is not None and self._handoffs:
                head = self._handoffs[0]
                if self._decode.sched.choose_group(head) is not None:
                    t = min(t, max(side.clock_us, head.ready_us))
            if t < best_t:
                best, best_t = side, t
        return best, best_t

    def _apply(self, side: _Side, groups, items, out) -> list:
        end = side.clock_us + float(out.modeled_us)
        sched, finished = side.sched, []
        for req, work, is_decode in items:
            if work.want == 0:
                req.num_computed += len(work.tokens)
                sched.commit_full_blocks(req)
                continue
            targets = out.tokens.get(req.rid)
            if targets is None or len(targets) != work.want:
                raise EmulatorError(f"runner returned {None if targets is None else len(targets)} tokens for "
                                    f"request {req.rid}, step {self._step}; want={work.want}")
            targets = [int(t) for t in targets]
            k = work.want - 1                   # drafts sent (decode with MTP); 0 for prefill and plain decode
            drafts = work.tokens[len(work.tokens) - k:] if k else []
            accepted = 0
            while accepted < k and drafts[accepted] == targets[accepted]:
                accepted += 1
            req.num_computed = work.start_pos + len(work.tokens) - (k - accepted)   # rejected drafts: rewound
            kept = req.append(list(drafts[:accepted]) + [targets[accepted]], end)
            req.num_computed = min(req.num_computed, req.num_tokens)
            sched.commit_full_blocks(req)
            req.drafts = [int(t) for t in out.drafts.get(req.rid, [])]
            self._drafts_sent += k
            self._drafts_accepted += accepted
            if is_decode:
                self._decode_seq_steps += 1
                self._decode_tokens += kept
            if req.finish_reason:
                sched.release(req)
                req.state = RequestState.FINISHED
                finished.append(req)
            elif side.prefill:
                sched.detach(req)
                req.state, req.ready_us = RequestState.HANDOFF, end
                self._handoffs.append(req)
        self._handoffs.sort(key=lambda r: (r.ready_us, r.rid))
        self.trace.append(StepRecord(self._step, side.name, side.clock_us, float(out.modeled_us),
                                     [sum(len(w.tokens) for w in ws) for ws in groups], sched.kv_usage()))
        side.clock_us = end
        self._step += 1
        return finished

    # ---- PD transfer --------------------------------------------------------------------------------------------
    def _transfer_handoffs(self, now_us: float) -> None:
        """Move prefilled requests to decode groups, first come first served, while blocks allow."""
        dec, pre = self._decode.sched, self._prefill.sched
        while self._handoffs and self._handoffs[0].ready_us <= now_us:
            req = self._handoffs[0]
            choice = dec.choose_group(req)
            if choice is None:        # back-pressure: every ready handoff keeps waiting, in order
                self._backpressured.update(r.rid for r in self._handoffs if r.ready_us <= now_us)
                return
            self._handoffs.pop(0)
            src_group, src_blocks, num_positions = req.group, req.block_table, req.num_computed
            g, prefix = choice
            dec.place(req, g, prefix)
            pool, num_hit = dec.pools[g], len(req.block_table)
            new = pool.allocate(pool.blocks_for(num_positions) - num_hit)
            req.block_table += new
            req.num_computed = num_positions
            copy_us = float(self.runner.copy_blocks(src_group, src_blocks[num_hit:num_hit + len(new)], g, new)
                            ) if new else 0.0
            pre.pools[src_group].free(src_blocks)
            dec.commit_full_blocks(req)
            self.transfers.append(TransferRecord(req.rid, src_group, g, len(new), req.ready_us, now_us, copy_us))
            req.ready_us = now_us + copy_us

    # ---- faults -------------------------------------------------------------------------------------------------
    def _on_failure(self, side: _Side, failure: DieFailure) -> None:
        """Roll back (nothing of the step was applied), drop the dead group, re-queue its requests."""
        self.num_failures += 1
        g, now = failure.group, side.clock_us
        if g is None:
            self._unowned_failures += 1
            if self._unowned_failures > MAX_UNOWNED_FAILURES:
                raise FaultError(f"{self._unowned_failures} die failures in a row without a DP group "
                                 f"(last: die {failure.die}) at step {self._step}") from failure
            return
        owner = next((s for s in self._sides if g in s.sched.alive), None)
        if g in self._dropped or not 0 <= g < self.runner.num_groups:
            raise FaultError(f"die {failure.die} failed in DP group {g}, which is not a live group") from failure
        self.runner.drop_group(g)
        self._dropped.add(g)
        if owner is None:             # PD: a group on neither side (it only served the MoE): nothing to move
            return
        moved = owner.sched.drop_group(g, now)
        if owner is self._prefill and self.pd is not None:
            lost = [r for r in self._handoffs if r.group == g]
            self._handoffs = [r for r in self._handoffs if r.group != g]
            for r in lost:
                r.lose_kv(now)
            moved += lost
        if not owner.sched.alive:
            raise FaultError(f"die {failure.die} took down DP group {g}, the last live {owner.name} group; "
                             f"{len(moved)} requests cannot continue") from failure
        for r in moved:
            self._prefill.sched.add(r)

    # ---- reporting ----------------------------------------------------------------------------------------------
    def _stuck(self) -> str:
        return "; ".join(f"request {r.rid} {r.state.value} in group {r.group}, {r.num_computed}/{r.num_tokens} "
                         f"positions computed, {len(r.output)}/{r.params.max_tokens} tokens"
                         for r in self.requests.values() if not r.is_finished)

    def results(self, rids=None) -> Results:
        """Results of finished requests (``rids``: these, in this order; default all) and their metrics."""
        reqs = [self.requests[i] for i in (rids if rids is not None else sorted(self.requests))]
        out = []
        for r in reqs:
            if not r.is_finished:
                raise ArgumentError(f"request {r.rid} has not finished ({r.state.value})")
            n = len(r.output)
            out.append(RequestResult(r.rid, len(r.prompt), list(r.output), r.finish_reason, r.arrival_us,
                                     r.first_token_us, r.finish_us, (r.first_token_us - r.arrival_us) / 1e3,
                                     (r.finish_us - r.first_token_us) / 1e3 / (n - 1) if n > 1 else None,
                                     r.num_recomputes))
        return Results(out, self._metrics(out))

    def _metrics(self, res: list) -> Metrics:
        num_out = sum(len(r.output_tokens) for r in res)
        makespan = (max(r.finish_us for r in res) - min(r.arrival_us for r in res)) if res else 0.0
        tpots = [r.tpot_ms for r in res if r.tpot_ms is not None]
        spreads = [max(u.values()) - min(u.values()) for u in (s.kv_usage for s in self.trace) if len(u) > 1]
        return Metrics(
            num_requests=len(res), num_output_tokens=num_out, makespan_us=makespan,
            tokens_per_s=num_out / (makespan / 1e6) if makespan > 0 else None,
            mean_ttft_ms=sum(r.ttft_ms for r in res) / len(res) if res else None,
            mean_tpot_ms=sum(tpots) / len(tpots) if tpots else None,
            acceptance_rate=self._drafts_accepted / self._drafts_sent if self._drafts_sent else None,
            tokens_per_step=self._decode_tokens / self._decode_seq_steps if self._decode_seq_steps else None,
            num_steps=self._step, num_failures=self.num_failures, num_backpressured=len(self._backpressured),
            mean_kv_spread=sum(spreads) / len(spreads) if spreads else 0.0)
