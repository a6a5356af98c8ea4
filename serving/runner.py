"""The emulated model runner: one decode/prefill step of the mini model on an emulated pod, every op a kernel.

Layout: DP group ``g`` runs on die ``g`` (attention data parallel, one latent KV cache per group), and the same
dies form the expert-parallel group of every MoE layer (``P = dies x slots`` physical expert slots holding the
``E`` logical experts plus redundant replicas, placed by ``eplb``). Per layer and step:

    attention stream (per die):  MLAProlog -> decode attention (BSND, S = tokens per sequence) -> W_uv (grouped
                                 GEMM, one group per head) -> wo
    MoE stream (all dies):       router GEMM (fp32 logits) -> gating top-k -> logical->physical replica mapping ->
                                 FusedDispatch (INT8) -> grouped GEMM gate_up + SwiGLU -> dynamic quant ->
                                 grouped GEMM down -> FusedCombine (+ shared expert, bf16 grouped GEMM)

A step runs on one pod (``serving.step.StepPod``): every op is a kernel launch queued through its host function's
``stream=`` / ``after=``; an op's modeled time runs from its queueing (launch overhead included) to its last
launch's end (the slowest die's for per-die ops). With ``microbatches=2`` each group's sequences split in two; the
attention ops run on the attention stream of every die (``attn_cores`` AICs + their AIVs) and the MoE ops on the MoE
stream (the rest) of the same pod, so the two streams contend for HBM, L2 and ports; attention of microbatch i
overlaps the MoE of microbatch i-1 (attention(l, m) after MoE(l-1, m), MoE(l, m) after attention(l, m)).
Embedding lookup, RMSNorm, residual adds, the routing's replica mapping and argmax are host glue (torch, the same
code as the reference): it runs at the modeled time its inputs are ready and takes no modeled time.

MTP (``mtp=True``): after the main model, the runner applies the engine's greedy rule to find each sequence's last
accepted position, runs the MTP layer (its own latent cache, ``cache_layers - 1``) over the accepted positions with
the token that follows each, and drafts one token from the last; a prompt must be prefilled in one step.

Faults: ``inject_failure(step, die, at_us)`` kills ``die`` ``at_us`` modeled us after the first MoE layer's
dispatch of ``step`` is queued (its first microbatch); the surviving dies then wait on the dead rank's status records
or returned rows, the bounded poll raises, and the runner reports it as ``DieFailure``. Injections accumulate
(several dies, several steps); dies killed in one step are reported one ``DieFailure`` per ``execute`` call, the
first in that step and each other one at the start of a following call (a death is permanent: the retried step
cannot use the die). A die scheduled to die after its step's exchange finished is dead by the end of the step all
the same.
``drop_group`` shrinks the expert placement onto the survivors (``eplb.shrink``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import eplb
from ascend_emu import HardwareProfile, Pod
from ascend_emu.errors import ArgumentError, CapacityError, DeadlockError, EmulatorError, FaultError
from ascend_emu.profile import load_profile
from kernels import (MoeGroup, dynamic_quant, grouped_matmul, mla_decode_attention, mla_prolog, moe_distribute_combine,
                     moe_distribute_dispatch, moe_gating_top_k)
from ascend_emu.arguments import check_int
from kernels.ranks import Ranks, to_torch

from .batch import DieFailure, SeqWork, StepBatch, StepOutput
from .model import BF16, ModelWeights, greedy, mtp_input, rms_norm, rope_tables
from .step import StepPod

ATTN_OPS = ("prolog", "attention", "o_proj")
MOE_OPS = ("router", "gating", "dispatch", "gmm_gate_up", "quant", "gmm_down", "shared", "combine")


@dataclass
class _Rows:
    """One group's rows in a (micro)batch: sequences, token ids, positions, cache slots."""
    seqs: list
    tokens: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    spans: list            # (row0, n) per sequence


@dataclass
class _Microbatch:
    """One microbatch of the step: its rows per group, the hidden states per group (replaced by each part's
    residual glue) and its last part so far."""
    index: object
    rows: list
    xs: list
    last: object = None


@dataclass
class _Step:
    """One step being built: its pod, microbatches, injected failures ((at_us, die), fired at the first MoE
    layer's exchange: ``fail_layer``), the routing per (layer, microbatch, group) (recorded numerically, given
    timing-only), the routing weights, and the output being filled."""
    pod: StepPod
    microbatches: list
    fail: list
    routing: dict
    out: StepOutput
    routing_weights: dict = field(default_factory=dict)
    fail_layer: object = None


def _host(value, shape, dtype):
    """A kernel output on the host, or (timing-only: None) zeros of its shape, for the glue that follows."""
    return value if value is not None else torch.zeros(shape, dtype=dtype)


def _host_ranks(values, shapes: list, dtype) -> list:
    """Per-rank kernel outputs on the host, or (timing-only: None) zeros of each rank's shape."""
    return list(values) if values is not None else [torch.zeros(sh, dtype=dtype) for sh in shapes]


def pipeline_us(parts: dict, layers: list, mbs: int, starts: dict | None = None) -> float:
    """The runner's schedule on paper, from part durations alone (no contention; the runner itself now runs it on
    one pod, ``serving.step``). Finish time of a two-stream schedule: ``parts[(layer, mb, "attn"|"moe")]``
    durations; per stream, work runs in (layer, mb) order; moe(l, m) after attn(l, m); attn(l, m) after moe(l-1, m).
    ``starts`` (optional) receives each part's start time."""
    free = {"attn": 0.0, "moe": 0.0}
    done = {}
    starts = {} if starts is None else starts
    for li, layer in enumerate(layers):
        for m in range(mbs):
            prev = done.get((layers[li - 1], m, "moe"), 0.0) if li else 0.0
            starts[(layer, m, "attn")] = max(free["attn"], prev)
            a = max(free["attn"], prev) + parts.get((layer, m, "attn"), 0.0)
            free["attn"] = done[(layer, m, "attn")] = a
        for m in range(mbs):
            starts[(layer, m, "moe")] = max(free["moe"], done[(layer, m, "attn")])
            b = max(free["moe"], done[(layer, m, "attn")]) + parts.get((layer, m, "moe"), 0.0)
            free["moe"] = done[(layer, m, "moe")] = b
    return max(free.values())


class EmulatedRunner:
    """Runs ``StepBatch``es of the model in ``weights`` on ``groups`` emulated dies (numeric mode).

    ``block_size`` 16 or 128 positions per KV block, ``num_blocks`` per group. ``slots``: expert slots per die
    (default: enough that the experts survive the loss of one die). ``rebalance_every``: steps between EPLB
    rebalances from the collected loads (0: never). ``microbatches`` 1 or 2; ``attn_cores``: AICs of the attention
    stream when split (the MoE stream gets the rest). ``launch_mode``: "graph" (default: a serving step runs as a
    captured graph, as deployments do, 2 us per kernel) or "single-op" (15 us host dispatch per kernel).
    ``profile``: the hardware (a HardwareProfile, preset name or TOML file; default cloudmatrix384)."""

    def __init__(self, weights: ModelWeights, *, groups: int = 1, block_size: int = 16, num_blocks: int = 64,
                 microbatches: int = 1, attn_cores: int = 16, slots: int | None = None, rebalance_every: int = 0,
                 mtp: bool = False, launch_mode: str = "graph", profile: HardwareProfile | None = None):
        c = weights.config
        check_int(groups, "groups", 1)
        check_int(num_blocks, "num_blocks", 1)
        check_int(rebalance_every, "rebalance_every", 0)
        if slots is not None:
            check_int(slots, "slots", 1)
        if block_size not in (16, 128):
            raise ArgumentError(f"block_size={block_size}: use 16 or 128")
        if microbatches not in (1, 2):
            raise ArgumentError(f"microbatches={microbatches}: use 1 or 2")
        check_int(attn_cores, "attn_cores", 1, 23)                 # the MoE stream needs the rest of the 24
        if launch_mode not in ("graph", "single-op"):
            raise ArgumentError(f"launch_mode={launch_mode!r}: use 'graph' or 'single-op'")
        if mtp and not weights.mtp:
            raise ArgumentError("mtp=True but the model has no MTP head (num_nextn_predict_layers=0)")
        self.w, self.c = weights, c
        self.num_groups, self.block_size, self.num_blocks = groups, block_size, num_blocks
        self.microbatches, self.attn_cores, self.mtp = microbatches, attn_cores, mtp
        self.launch_mode = launch_mode
        self.profile = load_profile(profile, groups)      # one die per DP group
        self.alive = [True] * groups
        e = c.n_routed_experts
        self.slots = slots or (-(-e // max(groups - 1, 1)) if groups > 1 else e)
        if self.slots * groups < e:
            raise ArgumentError(f"slots={self.slots} x {groups} dies < {e} experts")
        self.moe_layers = [i for i in range(c.num_hidden_layers) if c.is_moe(i)]
        self.loads = np.zeros((len(self.moe_layers), e), np.int64)
        self.rebalance_every, self.steps, self.rebalances = rebalance_every, 0, 0
        self._place(np.ones((len(self.moe_layers), e)))
        shape = (num_blocks, block_size, 1)
        self.kv = [[torch.zeros(*shape, c.kv_lora_rank, dtype=BF16) for _ in range(weights.cache_layers)]
                   for _ in range(groups)]
        self.kr = [[torch.zeros(*shape, c.qk_rope_head_dim, dtype=BF16) for _ in range(weights.cache_layers)]
                   for _ in range(groups)]
        self._failures: list = []        # injected (step, die, at_us) still to fire
        self._killed: list = []          # dies an injection killed whose failure is not reported yet
        self.transfer_us = 0.0
        self.last_routing: dict = {}     # the last step's routing, {(layer, microbatch, group): expert ids [T, K]}

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows (the engine checks prompts against it)."""
        return self.c.vocab_size

    def _pod(self) -> Pod:
        """A fresh pod (a KV transfer's), launching in the runner's mode."""
        return Pod(self.profile, trace=False, launch_mode=self.launch_mode)

    # ------------------------------------------------------------------------------------------- placement
    def _place(self, loads, failed=()):
        dies = self.num_groups
        if failed or hasattr(self, "phy2log"):
            if failed:
                phy2log, _, _ = eplb.shrink(loads, self.phy2log, failed, dies)
            else:
                alive = [d for d in range(dies) if self.alive[d]]
                keep = np.concatenate([np.arange(d * self.slots, (d + 1) * self.slots) for d in alive])
                sub, _, _ = eplb.rebalance_experts(loads, len(keep), 1, 1, len(alive), locality="none",
                                                   previous=self.phy2log[:, keep])
                phy2log = np.full_like(self.phy2log, -1)
                phy2log[:, keep] = sub
        else:
            phy2log, _, _ = eplb.rebalance_experts(loads, self.slots * dies, self.c.n_group, 1, dies,
                                                   locality="none")
        self.phy2log = np.asarray(phy2log, np.int64)

    def _slot_maps(self, li: int):
        """For MoE layer index ``li`` over the alive dies: (log2phy [E, X] in alive-slot numbering, logcnt [E],
        logical expert of each alive slot)."""
        alive = [d for d in range(self.num_groups) if self.alive[d]]
        keep = np.concatenate([np.arange(d * self.slots, (d + 1) * self.slots) for d in alive])
        p2l = self.phy2log[li, keep]
        log2phy, logcnt = eplb.inverse_map(p2l[None], self.c.n_routed_experts)
        return log2phy[0], logcnt[0], p2l

    # ------------------------------------------------------------------------------------------- faults / PD
    def inject_failure(self, step: int, die: int, at_us: float = 1.0) -> None:
        """Kill ``die`` ``at_us`` modeled us after the first MoE layer's dispatch is queued in step number ``step``
        (0-based count of ``execute`` calls, a step not run yet); the step then raises ``DieFailure``. Call it once
        per failure: injections add up (each (step, die) once)."""
        step, die = check_int(step, "step", 0), check_int(die, "die", 0, self.num_groups - 1)
        if step < self.steps:
            raise ArgumentError(f"step={step} has already run ({self.steps} steps so far): a failure can only be "
                                f"injected into a coming step")
        if not (isinstance(at_us, (int, float, np.integer, np.floating)) and 0 <= at_us < np.inf):
            raise ArgumentError(f"at_us={at_us!r}: a modeled time >= 0 within the step's MoE exchange")
        if not self.alive[die] or die in self._killed:
            raise ArgumentError(f"die={die} has already failed")
        if any(d == die for _, d, _ in self._failures):
            raise ArgumentError(f"die={die} already has a failure injected (a die dies once)")
        if not self.moe_layers:
            raise ArgumentError("this model has no MoE layer: an injected failure would never fire")
        self._failures.append((step, die, float(at_us)))

    def drop_group(self, group: int) -> None:
        if not self.alive[group]:
            return
        self.alive[group] = False
        if not any(self.alive):
            raise EmulatorError("every die of the pod has failed")
        self._place(np.maximum(self.loads, 1), failed=[group])
        self.kv[group] = self.kr[group] = None

    def copy_blocks(self, src_group: int, src_blocks: list, dst_group: int, dst_blocks: list) -> float:
        """Move the latent KV of ``src_blocks`` (every cache layer) from die ``src_group`` to ``dst_blocks`` on die
        ``dst_group`` with XCCL send/recv (8 lanes, mtu path); returns the modeled us of the transfer."""
        import xccl
        if len(src_blocks) != len(dst_blocks):
            raise ArgumentError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
        if not src_blocks:
            return 0.0
        if src_group == dst_group:
            for L in range(self.w.cache_layers):
                self.kv[dst_group][L][dst_blocks] = self.kv[src_group][L][src_blocks]
                self.kr[dst_group][L][dst_blocks] = self.kr[src_group][L][src_blocks]
            return 0.0
        hckv = self.c.kv_lora_rank
        packed = torch.cat([torch.cat([self.kv[src_group][L][src_blocks], self.kr[src_group][L][src_blocks]], -1)
                            for L in range(self.w.cache_layers)])
        pod = self._pod()
        comm = xccl.Communicator(pod, dies=[src_group, dst_group])
        src = pod.to_gm(src_group, packed, name="kv_send")
        dst = pod.alloc(dst_group, tuple(packed.shape), "bf16", name="kv_recv")
        xccl.send(comm, src, dst_group, event_id=1, cores=8)
        run = xccl.recv(comm, dst, src_group, event_id=1, cores=8).wait()
        got = to_torch(dst.numpy()).reshape(packed.shape).chunk(self.w.cache_layers)
        for L, blk in enumerate(got):
            self.kv[dst_group][L][dst_blocks] = blk[..., :hckv]
            self.kr[dst_group][L][dst_blocks] = blk[..., hckv:]
        self.transfer_us += run.modeled_us
        return run.modeled_us

    # ------------------------------------------------------------------------------------------- one step
    def _rows(self, seqs: list) -> _Rows:
        toks, pos, slots, spans = [], [], [], []
        bs = self.block_size
        for s in seqs:
            n = len(s.tokens)
            p = torch.arange(s.start_pos, s.start_pos + n)
            need = -(-(s.start_pos + n) // bs)
            if len(s.block_table) < need:
                raise CapacityError(f"request {s.rid}: block_table has {len(s.block_table)} blocks, positions up "
                                    f"to {s.start_pos + n - 1} need {need} of {bs}")
            bt = torch.as_tensor(s.block_table, dtype=torch.long)
            if len(bt) and (bt.min() < 0 or bt.max() >= self.num_blocks):
                raise ArgumentError(f"request {s.rid}: block ids must be in 0..{self.num_blocks - 1}")
            spans.append((len(toks), n))
            toks += list(s.tokens)
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
        cat = (lambda xs: torch.cat(xs)) if seqs else (lambda xs: torch.zeros(0, dtype=torch.long))
        return _Rows(list(seqs), torch.as_tensor(toks, dtype=torch.long), cat(pos), cat(slots), spans)

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step: prepare (rows, embeddings, the step's pod) -> layers -> head (lm_head, MTP drafts) ->
        finish (run the pod, figures, EPLB)."""
        step = self._prepare(batch)
        for layer in range(self.c.num_hidden_layers):
            self._layers(step, layer)
        self._head(step)
        return self._finish(step)

    def time_step(self, batch: StepBatch, routing: dict) -> StepOutput:
        """The same step timing-only: phantom GM tensors, no outputs (``tokens`` empty), the modeled figures of
        ``execute``. ``routing``: the control data a numeric run decides: {(layer, microbatch, group): expert ids
        [T, K]} as ``execute`` records it in ``last_routing``. Not a serving step: the runner's state (step count,
        caches, loads, injected failures) is left as it is. Without MTP (its accepted drafts are control data too)."""
        if self.mtp:
            raise ArgumentError("time_step: a runner with mtp=True drafts from the step's own tokens; time steps "
                                "without MTP")
        step = self._prepare(batch, numeric=False, routing=routing)
        for layer in range(self.c.num_hidden_layers):
            self._layers(step, layer)
        self._head(step)
        return self._finish(step)

    # ------------------------------------------------------------------------------------------- phases
    def _prepare(self, batch: StepBatch, numeric: bool = True, routing: dict | None = None) -> _Step:
        if len(batch.groups) != self.num_groups:
            raise ArgumentError(f"batch has {len(batch.groups)} groups; the runner has {self.num_groups}")
        for g, seqs in enumerate(batch.groups):
            if seqs and not self.alive[g]:
                raise ArgumentError(f"group {g} is dropped (its die failed) but has {len(seqs)} sequences")
            for s in seqs:
                if self.mtp and s.want == 0:
                    raise ArgumentError(f"request {s.rid}: chunked prefill (want=0) is not supported with MTP")
        fail = []
        if numeric:              # a timing-only run is not one of the serving steps: no failure, no EPLB count
            number = self.steps
            self.steps += 1
            dead = [d for d in self._killed if self.alive[d]]
            self._killed = []
            if dead:             # killed with another die in an earlier step: the retried step cannot use it
                self._killed = dead[1:]
                raise DieFailure(dead[0], dead[0], f"die {dead[0]} failed in an earlier step, with another die")
            fail = sorted((t, d) for st, d, t in self._failures if st == number and self.alive[d])  # (at_us, die)
            self._failures = [f for f in self._failures if f[0] != number]
        mbs = self.microbatches
        split = [[seqs[:len(seqs) // 2], seqs[len(seqs) // 2:]] if mbs == 2 else [seqs] for seqs in batch.groups]
        microbatches = []
        for m in range(mbs):
            rows = [self._rows(split[g][m]) for g in range(self.num_groups)]
            microbatches.append(_Microbatch(m, rows, [self.w.embed[r.tokens] for r in rows]))
        pod = StepPod(self.profile, microbatches=mbs, attn_cores=self.attn_cores, launch_mode=self.launch_mode,
                      numeric=numeric)
        return _Step(pod, microbatches, fail, routing if routing is not None else {}, StepOutput(tokens={}))

    def _layers(self, step: _Step, layer: int) -> None:
        """Add layer ``layer``'s parts: per microbatch its attention, then its MoE (or dense FFN); attention(l, m)
        after the FFN part of (l - 1, m), the FFN part after attention(l, m)."""
        layer_weights = self.w.layers[layer]
        for mb in step.microbatches:
            mb.last = step.pod.add((layer, mb.index), "attn", self._attention(step, layer, layer_weights.attn, mb),
                                   after=[mb.last])
        for mb in step.microbatches:
            if layer_weights.dense is not None:
                body = self._dense_part(step, layer, layer_weights, mb)
            else:
                body = self._moe(step, layer, layer_weights, mb)
            mb.last = step.pod.add((layer, mb.index), "moe", body, after=[mb.last])

    def _head(self, step: _Step) -> None:
        """Add each microbatch's head (final norm + lm_head, greedy tokens, MTP drafts) after its last layer; the
        heads run on the attention lane."""
        for mb in step.microbatches:
            mb.last = step.pod.add(("head", mb.index), "attn", self._head_part(step, mb), after=[mb.last],
                                   label="head")

    def _finish(self, step: _Step) -> StepOutput:
        """Run the step's pod (the whole schedule), report a killed die as DieFailure, fill the modeled figures."""
        pod, fail = step.pod, step.fail

        def failed(what, cause=None):
            """The step's first killed die as a DieFailure; the others are reported by the next calls."""
            first, *rest = [d for _, d in fail]
            self._killed += rest
            return DieFailure(first, first, f"die {first} failed during MoE layer {step.fail_layer} {what}"
                              + (f": {cause}" if cause is not None else ""))
        try:
            run = pod.run()
        except (DeadlockError, FaultError) as e:
            if not fail:
                raise DieFailure(None, None, f"the step's MoE exchange stalled: {e}") from e
            raise failed("exchange", e) from e
        except EmulatorError as e:
            if not fail:
                raise
            raise failed("exchange", e) from e        # a killed die's garbage met a check downstream
        if fail:                 # killed after its exchange finished: dead all the same by the end of the step
            raise failed("(after its exchange)")
        out = step.out
        out.modeled_us = run.modeled_us
        for rec in pod.records():
            us = rec.end_us - rec.start_us
            out.breakdown[rec.op] = out.breakdown.get(rec.op, 0.0) + us
            layer, mb = rec.key
            if layer != "head":
                name = f"layer{layer}.{rec.op}"
                out.per_layer[name] = out.per_layer.get(name, 0.0) + us
                out.timeline.append((rec.lane, f"L{layer}.mb{mb}.{rec.op}", rec.start_us, rec.end_us))
        for part in pod.parts:
            if part.key[0] == "head" and part.records:
                out.timeline.append(("head", "lm_head" + ("+mtp" if self.mtp else ""), part.records[0].start_us,
                                     part.records[-1].end_us))
        out.timeline.sort(key=lambda item: item[2])
        if pod.numeric:
            self.last_routing = step.routing
            self._collect_and_rebalance()
        return out

    # ------------------------------------------------------------------------------------------- attention
    def _attention(self, step: _Step, layer, a, mb: _Microbatch, cache_layer: int | None = None):
        """Residual attention block for every group (a part): x + wo(W_uv(attn(prolog(RMSNorm(x)))))."""
        c, pod, numeric = self.c, step.pod, step.pod.numeric
        cache = layer if cache_layer is None else cache_layer
        aic = pod.aic("attn")
        xs, rows = mb.xs, mb.rows
        prologs = {}
        for g, (x, r) in enumerate(zip(xs, rows)):
            if not len(r.tokens):
                continue
            hidden = rms_norm(x, a.norm, c.rms_norm_eps)
            sin, cos = rope_tables(r.pos, c.qk_rope_head_dim, c.rope_theta)
            prologs[g] = mla_prolog(hidden, a.weight_dq, a.weight_uq_qr, a.weight_uk, a.weight_dkv_kr, a.gamma_cq,
                                    a.gamma_ckv, sin, cos, self.kv[g][cache],
                                    self.kr[g][cache], cache_index=r.slots,
                                    rmsnorm_epsilon_cq=c.rms_norm_eps, rmsnorm_epsilon_ckv=c.rms_norm_eps, aic=aic,
                                    numeric=numeric, stream=pod.streams("attn", [g])[0])
        if not prologs:
            return
        done = yield "prolog", list(prologs.values())
        prolog = dict(zip(prologs, done))
        calls = []            # (group, rows of the call, pending): one attention call per query length S
        for g in prologs:
            r, p = rows[g], prolog[g]
            query = _host(p.query, (len(r.tokens), c.num_attention_heads, c.kv_lora_rank), BF16)
            query_rope = _host(p.query_rope, (len(r.tokens), c.num_attention_heads, c.qk_rope_head_dim), BF16)
            by_length = {}
            for s, span in zip(r.seqs, r.spans):
                by_length.setdefault(span[1], []).append((s, span))
            for length, items in sorted(by_length.items()):
                blocks = max(-(-(s.start_pos + length) // self.block_size) for s, _ in items)
                table = torch.zeros(len(items), blocks, dtype=torch.int32)
                for b, (s, _) in enumerate(items):
                    need = -(-(s.start_pos + length) // self.block_size)
                    table[b, :need] = torch.as_tensor(s.block_table[:need], dtype=torch.int32)
                selected = torch.cat([torch.arange(r0, r0 + n) for _, (r0, n) in items])
                q = query[selected].reshape(len(items), length, c.num_attention_heads, -1)
                q_rope = query_rope[selected].reshape(len(items), length, c.num_attention_heads, -1)
                calls.append((g, selected, mla_decode_attention(
                    q, q_rope, self.kv[g][cache], self.kr[g][cache],
                    table, [s.start_pos + length for s, _ in items], softmax_scale=c.softmax_scale, tiling="batch",
                    aic=aic, numeric=numeric, stream=pod.streams("attn", [g])[0])))
        done = yield "attention", [pending for _, _, pending in calls]
        outs = {g: torch.empty(len(rows[g].tokens), c.num_attention_heads, c.kv_lora_rank, dtype=BF16)
                for g in prologs}
        for (g, selected, _), res in zip(calls, done):
            out = _host(res.attention_out, (len(selected), c.num_attention_heads, c.kv_lora_rank), BF16)
            outs[g][selected] = out.reshape(-1, c.num_attention_heads, c.kv_lora_rank)
        # W_uv: one group per head over head-major rows, then wo
        active = list(prologs)
        n = c.num_attention_heads
        head_major = [outs[g].transpose(0, 1).reshape(-1, c.kv_lora_rank).contiguous() for g in active]
        group_list = [[len(rows[g].tokens) * (i + 1) for i in range(n)] for g in active]
        v_up = yield "o_proj", grouped_matmul(Ranks(head_major), a.weight_uv, group_list=Ranks(group_list),
                                              dies=active, numeric=numeric, stream=pod.streams("attn", active))
        values = [None] * len(xs)
        for g, y in zip(active, v_up.y if numeric else [None] * len(active)):
            y = _host(y, (n * len(rows[g].tokens), c.v_head_dim), BF16)
            values[g] = y.reshape(n, -1, c.v_head_dim).transpose(0, 1).reshape(-1, n * c.v_head_dim).contiguous()
        o = yield from self._gemm_groups(step, "o_proj", "attn", values, a.wo, BF16, int8=a.wo_int8)
        mb.xs = [x + o[g] if g in prologs else x for g, x in enumerate(xs)]

    # ------------------------------------------------------------------------------------------- FFN / MoE
    def _gemm_groups(self, step: _Step, op: str, lane: str, hs: list, w: torch.Tensor, out_dtype, *,
                     rms_norm_gamma=None, swiglu=False, int8=None):
        """One GEMM [T_g, K] x w [K, N] on every group with rows, on ``lane``; returns the per-group outputs.
        ``int8`` (an ``Int8Linear``): W8A8 instead: dynamic_quant, then the int8 grouped GEMM."""
        numeric = step.pod.numeric
        active = [g for g, h in enumerate(hs) if h is not None and len(h)]
        outs = [None] * len(hs)
        if not active:
            return outs
        xs = [rms_norm(hs[g], rms_norm_gamma, self.c.rms_norm_eps) if rms_norm_gamma is not None else hs[g]
              for g in active]
        streams = step.pod.streams(lane, active)
        group_list = Ranks([len(x)] for x in xs)
        if int8 is not None:
            q = yield op, dynamic_quant(xs, dies=active, numeric=numeric, stream=streams)
            y = _host_ranks(q.y, [(len(x), x.shape[1]) for x in xs], torch.int8)
            scale = _host_ranks(q.scale, [(len(x),) for x in xs], torch.float32)
            r = yield op, grouped_matmul(Ranks(y), int8.weight[None], scale=int8.scale[None],
                                         per_token_scale=Ranks(scale), group_list=group_list, dies=active,
                                         swiglu=swiglu, numeric=numeric, stream=streams)
            n_out = int8.weight.shape[-1]
        else:
            r = yield op, grouped_matmul(Ranks(xs), w[None], group_list=group_list, dies=active,
                                         output_dtype=out_dtype, swiglu=swiglu, numeric=numeric, stream=streams)
            n_out = w.shape[-1]
        dtype = BF16 if int8 is not None else out_dtype
        ys = _host_ranks(r.y, [(len(x), n_out // 2 if swiglu else n_out) for x in xs], dtype)
        for g, y in zip(active, ys):
            outs[g] = y
        return outs

    def _ffn(self, step: _Step, op: str, lane: str, f, hs: list):
        gate_up = yield from self._gemm_groups(step, op, lane, hs, f.w13, BF16, swiglu=True, int8=f.w13_int8)
        return (yield from self._gemm_groups(step, op, lane, gate_up, f.w2, BF16, int8=f.w2_int8))

    def _dense(self, step: _Step, lane: str, f, hs: list):
        ys = yield from self._ffn(step, "dense_ffn", lane, f, hs)
        return [y if y is not None else self._empty(step, self.c.hidden_size) for y in ys]

    def _dense_part(self, step: _Step, layer: int, layer_weights, mb: _Microbatch):
        """Residual dense FFN block of every group (a part)."""
        hs = [rms_norm(x, layer_weights.ffn_norm, self.c.rms_norm_eps) for x in mb.xs]
        ys = yield from self._dense(step, "moe", layer_weights.dense, hs)
        mb.xs = [x + y for x, y in zip(mb.xs, ys)]

    def _empty(self, step: _Step, *shape, dtype=BF16):
        return torch.zeros(0, *shape, dtype=dtype)

    def _moe(self, step: _Step, layer: int, layer_weights, mb: _Microbatch):
        """Residual MoE block of every group (a part): router -> gating -> replica mapping (host) -> dispatch ->
        routed experts -> shared expert -> combine."""
        c, pod = self.c, step.pod
        numeric = pod.numeric
        li = self.moe_layers.index(layer)
        m = layer_weights.moe
        hs = [rms_norm(x, layer_weights.ffn_norm, c.rms_norm_eps) for x in mb.xs]
        alive = [d for d in range(self.num_groups) if self.alive[d]]
        k = c.num_experts_per_tok
        ids = yield from self._route(step, layer, li, m, hs, mb, alive)
        phys, p2l = self._replicas(li, ids, alive)
        max_bs = max(1, max(len(ids[g]) for g in alive))
        moe_streams = pod.streams("moe", alive)
        group = MoeGroup(pod.pod, alive, max_bs=max_bs, hidden=c.hidden_size, topk=k, num_experts=len(p2l),
                         cores=2 * pod.aic("moe"), phantom=not numeric, streams=dict(zip(alive, moe_streams)))
        x_in = [hs[g] if hs[g] is not None else self._empty(step, c.hidden_size) for g in alive]
        if step.fail and step.fail_layer is None:    # the step's injected failures: from the first exchange on
            step.fail_layer = layer
            for at_us, die in step.fail:
                pod.pod.kill_die(die, at_us=pod.pod.now_us + at_us)
        d = yield "dispatch", moe_distribute_dispatch(x_in if numeric else [None] * len(alive), phys, group,
                                                      numeric=numeric, stream=moe_streams)
        ys = yield from self._experts(step, m, d, p2l, alive)
        shared = yield from self._ffn(step, "shared", "moe", m.shared,
                                      [h if h is not None and len(h) else None for h in hs])
        shared = [shared[g] if shared[g] is not None else self._empty(step, c.hidden_size) for g in alive]
        if not numeric:          # what the combine reads, as phantom GM (a timing-only combine takes GM rows)
            shared = [pod.pod.alloc(g, tuple(x.shape), "bf16", phantom=True) for g, x in zip(alive, shared)]
        outs, _ = yield "combine", moe_distribute_combine(
            [ys[r] for r in range(len(alive))], d, [step.routing_weights[(layer, mb.index, g)] for g in alive], group,
            shared_expert_x=shared, numeric=numeric, stream=moe_streams)
        res = []
        for g in range(len(hs)):
            o = outs[alive.index(g)] if g in alive and numeric else None
            if g in alive and not numeric:
                res.append(torch.zeros(len(ids[g]), c.hidden_size, dtype=BF16))
            else:
                res.append(to_torch(o) if o is not None and len(o) else self._empty(step, c.hidden_size))
        mb.xs = [x + y for x, y in zip(mb.xs, res)]

    def _route(self, step: _Step, layer: int, li: int, m, hs: list, mb: _Microbatch, alive: list):
        """Router GEMM and gating top-k: {group: expert ids [T, K]} (timing-only: the recorded routing); counts
        the loads for EPLB and keeps the routing and weights in ``step``."""
        c = self.c
        numeric = step.pod.numeric
        k = c.num_experts_per_tok
        logits = yield from self._gemm_groups(step, "router", "moe", hs, m.router, torch.float32)
        active = [g for g in alive if logits[g] is not None]
        ids = {g: torch.zeros(0, k, dtype=torch.int32) for g in alive}
        for g in alive:
            step.routing_weights[(layer, mb.index, g)] = np.zeros((0, k), np.float32)
        if not active:
            return ids
        gating = yield "gating", moe_gating_top_k(
            [logits[g] for g in active], k, bias=m.bias, k_group=c.topk_group, group_count=c.n_group,
            group_select_mode=1, routed_scaling_factor=c.routed_scaling_factor, dies=active, numeric=numeric,
            stream=step.pod.streams("moe", active))
        for i, g in enumerate(active):
            if numeric:
                ids[g] = gating.expert_idx[i]
                step.routing[(layer, mb.index, g)] = ids[g].numpy().copy()
                step.routing_weights[(layer, mb.index, g)] = gating.y[i].numpy()
            else:
                ids[g] = torch.as_tensor(step.routing[(layer, mb.index, g)])
                step.routing_weights[(layer, mb.index, g)] = np.zeros(tuple(ids[g].shape), np.float32)
            if numeric:
                self.loads[li] += np.bincount(ids[g].reshape(-1).numpy(), minlength=c.n_routed_experts)
        return ids

    def _replicas(self, li: int, ids: dict, alive: list):
        """Logical -> physical replica per routed row: rotate over replicas by arrival order (eplb.map_experts,
        by="rank"); returns (physical ids per alive group, logical expert of each alive slot)."""
        k = self.c.num_experts_per_tok
        log2phy, logcnt, p2l = self._slot_maps(li)
        phys = []
        for g in alive:
            if len(ids[g]):
                table = eplb.rotation_table(log2phy, logcnt, len(ids[g]) * k)
                phys.append(eplb.map_experts(table, ids[g].numpy(), by="rank"))
            else:
                phys.append(np.zeros((0, k), np.int32))
        return phys, p2l

    def _experts(self, step: _Step, m, d, p2l, alive: list):
        """The routed experts on every rank with received rows: gate_up + SwiGLU, dynamic quant, down (int8
        grouped GEMMs, one group per local slot); returns {rank: rows [received, H] bf16}."""
        c, pod = self.c, step.pod
        numeric = pod.numeric
        ys = {r: self._empty(step, c.hidden_size) for r in range(len(alive))}
        rows = [int(np.asarray(d.expert_token_nums[r]).sum()) for r in range(len(alive))]
        ranks = [r for r in range(len(alive)) if rows[r]]
        if not ranks:
            return ys
        slot_e = [p2l[r * self.slots:(r + 1) * self.slots] for r in ranks]
        x8 = [torch.from_numpy(np.ascontiguousarray(d.expand_x[r])) if numeric
              else torch.zeros(rows[r], c.hidden_size, dtype=torch.int8) for r in ranks]
        xs8 = [torch.from_numpy(np.ascontiguousarray(d.dynamic_scales[r])) if numeric
               else torch.zeros(rows[r], dtype=torch.float32) for r in ranks]
        group_list = [torch.as_tensor(d.expert_token_nums[r], dtype=torch.int64) for r in ranks]
        dies = [alive[r] for r in ranks]
        streams = pod.streams("moe", dies)
        inter = m.w13.shape[-1] // 2
        gate_up = yield "gmm_gate_up", grouped_matmul(
            Ranks(x8), Ranks(m.w13[se] for se in slot_e), scale=Ranks(m.s13[se] for se in slot_e),
            per_token_scale=Ranks(xs8), group_list=Ranks(group_list), group_list_type=1, swiglu=True, dies=dies,
            numeric=numeric, stream=streams)
        hidden = _host_ranks(gate_up.y, [(rows[r], inter) for r in ranks], BF16)
        q = yield "quant", dynamic_quant(list(hidden), dies=dies, numeric=numeric, stream=streams)
        down = yield "gmm_down", grouped_matmul(
            Ranks(_host_ranks(q.y, [(rows[r], inter) for r in ranks], torch.int8)),
            Ranks(m.w2[se] for se in slot_e), scale=Ranks(m.s2[se] for se in slot_e),
            per_token_scale=Ranks(_host_ranks(q.scale, [(rows[r],) for r in ranks], torch.float32)),
            group_list=Ranks(group_list), group_list_type=1, dies=dies, numeric=numeric, stream=streams)
        for r, y in zip(ranks, _host_ranks(down.y, [(rows[r], c.hidden_size) for r in ranks], BF16)):
            ys[r] = y
        return ys

    # ------------------------------------------------------------------------------------------- head / MTP
    def _head_part(self, step: _Step, mb: _Microbatch):
        """Final norm + lm_head on each sequence's wanted positions, greedy tokens; with MTP, the drafts."""
        rows = mb.rows
        want_rows = [[r0 + n - s.want + j for s, (r0, n) in zip(rows[g].seqs, rows[g].spans) for j in range(s.want)]
                     for g in range(self.num_groups)]
        hs = [mb.xs[g][want_rows[g]] for g in range(self.num_groups)]
        logits = yield from self._gemm_groups(step, "lm_head", "attn", hs, self.w.lm_head, torch.float32,
                                              rms_norm_gamma=self.w.norm)
        if not step.pod.numeric:
            return
        preds = {}
        for g in range(self.num_groups):
            p = greedy(logits[g]) if logits[g] is not None else []
            i = 0
            for s in rows[g].seqs:
                preds[s.rid] = [int(t) for t in p[i:i + s.want]]
                i += s.want
        step.out.tokens.update(preds)
        if self.mtp:
            drafts = yield from self._mtp(step, mb, preds)
            step.out.drafts.update(drafts)

    def _mtp(self, step: _Step, mb: _Microbatch, preds: dict):
        """Draft one token per sequence with the MTP head at its last accepted position: the head runs over every
        accepted position (main hidden state + the token that follows it) to fill its own latent cache."""
        c = self.c
        mw = self.w.mtp[0]
        sub_rows, hs, embs = [], [], []
        for g, r in enumerate(mb.rows):
            seqs, sel, nxt = [], [], []
            for s, (r0, n) in zip(r.seqs, r.spans):
                p = preds[s.rid]
                acc = 0                                   # drafts accepted this step (the engine's rule)
                while acc < s.want - 1 and s.tokens[n - s.want + 1 + acc] == p[acc]:
                    acc += 1
                last = n - s.want + acc                   # row offset of the final accepted position
                sel += list(range(r0, r0 + last + 1))
                nxt += list(s.tokens[1:last + 1]) + [p[acc]]
                seqs.append(SeqWork(s.rid, list(s.tokens[:last + 1]), s.start_pos, s.block_table, want=1))
            sub_rows.append(self._rows(seqs))
            hs.append(mb.xs[g][sel] if sel else torch.zeros(0, c.hidden_size, dtype=BF16))
            embs.append(self.w.embed[torch.as_tensor(nxt, dtype=torch.long)] if nxt else None)
        x_in = [mtp_input(mw, h, e, c.rms_norm_eps) if e is not None else h for h, e in zip(hs, embs)]
        sub = _Microbatch(("mtp", mb.index), sub_rows, x_in)
        yield from self._attention(step, "mtp", mw.layer.attn, sub, cache_layer=len(self.w.layers))
        hn = [rms_norm(x, mw.layer.ffn_norm, c.rms_norm_eps) for x in sub.xs]
        ys = yield from self._dense(step, "moe", mw.layer.dense, hn)
        x_out = [x + y for x, y in zip(sub.xs, ys)]
        last = [x[[r0 + n - 1 for r0, n in r.spans]] if r.seqs else None for x, r in zip(x_out, sub_rows)]
        logits = yield from self._gemm_groups(step, "lm_head", "attn", last, self.w.lm_head, torch.float32,
                                              rms_norm_gamma=self.w.norm)
        drafts = {}
        for g, r in enumerate(sub_rows):
            if r.seqs:
                p = greedy(logits[g])
                for i, s in enumerate(r.seqs):
                    drafts[s.rid] = [int(p[i])]
        return drafts

    # ------------------------------------------------------------------------------------------- EPLB
    def _collect_and_rebalance(self):
        if self.rebalance_every and self.steps % self.rebalance_every == 0 and self.loads.sum():
            self._place(np.maximum(self.loads, 1))
            self.loads[:] = 0
            self.rebalances += 1

