"""The emulated model runner: one decode/prefill step of the mini model on an emulated pod, every op a kernel.

Layout: DP group ``g`` runs on die ``g`` (attention data parallel, one latent KV cache per group), and the same
dies form the expert-parallel group of every MoE layer (``P = dies x slots`` physical expert slots holding the
``E`` logical experts plus redundant replicas, placed by ``eplb``). Per layer and step:

    attention stream (per die):  MLAProlog -> decode attention (BSND, S = tokens per sequence) -> W_uv (grouped
                                 GEMM, one group per head) -> wo
    MoE stream (all dies):       router GEMM (fp32 logits) -> gating top-k -> logical->physical replica mapping ->
                                 FusedDispatch (INT8) -> grouped GEMM gate_up + SwiGLU -> dynamic quant ->
                                 grouped GEMM down -> FusedCombine (+ shared expert, bf16 grouped GEMM)

Each op is one pod run (all dies of the op concurrently); an op's modeled time is that run's ``modeled_us`` (single
-op launch overhead included), the slowest die's for per-die ops. With ``microbatches=2`` each group's sequences
split in two; the attention ops run on ``attn_cores`` AICs (+ their AIVs) and the MoE ops on the rest, and a layer's
time comes from a two-stream schedule: attention of microbatch i overlaps the MoE of microbatch i-1.
modeled as: the two streams' ops run in separate pod runs, so contention between them for HBM and ports is not
seen; embedding lookup, RMSNorm, residual adds and argmax are host glue (torch, the same code as the reference) and
take no modeled time.

MTP (``mtp=True``): after the main model, the runner applies the engine's greedy rule to find each sequence's last
accepted position, runs the MTP layer (its own latent cache, ``cache_layers - 1``) over the accepted positions with
the token that follows each, and drafts one token from the last; a prompt must be prefilled in one step.

Faults: ``inject_failure(step, die, at_us)`` kills ``die`` at modeled time ``at_us`` of the first MoE layer's
dispatch/combine pod of ``step``; the surviving dies then wait on the dead rank's status records or returned rows,
the bounded poll raises, and the runner reports it as ``DieFailure``. Injections accumulate (several dies, several
steps); dies killed in one step are reported one ``DieFailure`` per ``execute`` call, the first in that step and
each other one at the start of a following call (a death is permanent: the retried step cannot use the die).
A die scheduled to die after its step's exchange finished is dead by the end of the step all the same.
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
class _Timer:
    """Modeled us per (layer, microbatch, stream), per op, per (layer, op), and the ops of each part in order."""
    parts: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)
    seq: dict = field(default_factory=dict)

    def add(self, layer, mb, stream, op, us):
        key = (layer, mb, stream)
        self.parts[key] = self.parts.get(key, 0.0) + us
        self.ops[op] = self.ops.get(op, 0.0) + us
        name = f"layer{layer}.{op}"
        self.per_layer[name] = self.per_layer.get(name, 0.0) + us
        self.seq.setdefault(key, []).append((op, us))


def pipeline_us(parts: dict, layers: list, mbs: int, starts: dict | None = None) -> float:
    """Finish time of a two-stream schedule: ``parts[(layer, mb, "attn"|"moe")]`` durations; per stream, work runs
    in (layer, mb) order; moe(l, m) after attn(l, m); attn(l, m) after moe(l-1, m). ``starts`` (optional) receives
    each part's start time."""
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

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows (the engine checks prompts against it)."""
        return self.c.vocab_size

    def _pod(self) -> Pod:
        """A fresh pod for one op's run, launching in the runner's mode."""
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
        """Kill ``die`` at modeled time ``at_us`` of the first MoE layer's exchange pod in step number ``step``
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
        if len(batch.groups) != self.num_groups:
            raise ArgumentError(f"batch has {len(batch.groups)} groups; the runner has {self.num_groups}")
        for g, seqs in enumerate(batch.groups):
            if seqs and not self.alive[g]:
                raise ArgumentError(f"group {g} is dropped (its die failed) but has {len(seqs)} sequences")
            for s in seqs:
                if self.mtp and s.want == 0:
                    raise ArgumentError(f"request {s.rid}: chunked prefill (want=0) is not supported with MTP")
        step = self.steps
        self.steps += 1
        dead = [d for d in self._killed if self.alive[d]]
        self._killed = []
        if dead:                 # killed with another die in an earlier step: the retried step cannot use it
            self._killed = dead[1:]
            raise DieFailure(dead[0], dead[0], f"die {dead[0]} failed in an earlier step, with another die")
        mbs = self.microbatches
        split = [[seqs[:len(seqs) // 2], seqs[len(seqs) // 2:]] if mbs == 2 else [seqs] for seqs in batch.groups]
        rows = [[self._rows(split[g][m]) for g in range(self.num_groups)] for m in range(mbs)]
        xs = [[self.w.embed[r.tokens] for r in rows[m]] for m in range(mbs)]
        timer = _Timer()
        fail = sorted((t, d) for st, d, t in self._failures if st == step and self.alive[d])    # (at_us, die)
        self._failures = [f for f in self._failures if f[0] != step]
        layers = list(range(self.c.num_hidden_layers))
        for li in layers:
            lw = self.w.layers[li]
            for m in range(mbs):
                xs[m] = self._attention(li, lw.attn, xs[m], rows[m], timer, (li, m))
            for m in range(mbs):
                hs = [rms_norm(x, lw.ffn_norm, self.c.rms_norm_eps) for x in xs[m]]
                if lw.dense is not None:
                    ys = self._dense(lw.dense, hs, timer, (li, m))
                else:
                    ys = self._moe(self.moe_layers.index(li), lw.moe, hs, timer, (li, m), fail)
                    fail = []
                xs[m] = [x + y for x, y in zip(xs[m], ys)]
        out = StepOutput(tokens={}, drafts={})
        head_us = 0.0
        for m in range(mbs):
            want_rows = []
            for g in range(self.num_groups):
                idx = [r0 + n - s.want + j for s, (r0, n) in zip(rows[m][g].seqs, rows[m][g].spans)
                       for j in range(s.want)]
                want_rows.append(idx)
            hs = [xs[m][g][want_rows[g]] for g in range(self.num_groups)]
            logits, us = self._gemm_groups(hs, self.w.lm_head, torch.float32, rms_norm_gamma=self.w.norm)
            head_us += us
            preds = {}
            for g in range(self.num_groups):
                p = greedy(logits[g]) if logits[g] is not None else []
                i = 0
                for s in rows[m][g].seqs:
                    preds[s.rid] = [int(t) for t in p[i:i + s.want]]
                    i += s.want
            out.tokens.update(preds)
            if self.mtp:
                drafts, us = self._mtp(rows[m], xs[m], preds, timer)
                out.drafts.update(drafts)
                head_us += us
        starts = {}
        body = pipeline_us(timer.parts, layers, mbs, starts)
        out.modeled_us = body + head_us
        out.breakdown = dict(timer.ops, lm_head=head_us)
        out.per_layer = dict(timer.per_layer)
        for key, t0 in sorted(starts.items(), key=lambda kv: kv[1]):
            for op, us in timer.seq.get(key, []):
                out.timeline.append((key[2], f"L{key[0]}.mb{key[1]}.{op}", t0, t0 + us))
                t0 += us
        out.timeline.append(("head", "lm_head" + ("+mtp" if self.mtp else ""), body, body + head_us))
        self._collect_and_rebalance()
        return out

    # ------------------------------------------------------------------------------------------- attention
    def _cores(self, stream: str) -> int:
        if self.microbatches == 1:
            return 24
        return self.attn_cores if stream == "attn" else 24 - self.attn_cores

    def _attention(self, li: int, a, xs: list, rows: list, timer: _Timer, key, cache_layer: int | None = None):
        """Residual attention block for every group: x + wo(W_uv(attn(prolog(RMSNorm(x)))))."""
        c = self.c
        L = li if cache_layer is None else cache_layer
        aic = self._cores("attn")
        t_prolog = t_attn = 0.0
        outs = []
        for g, (x, r) in enumerate(zip(xs, rows)):
            if not len(r.tokens):
                outs.append(None)
                continue
            h = rms_norm(x, a.norm, c.rms_norm_eps)
            sin, cos = rope_tables(r.pos, c.qk_rope_head_dim, c.rope_theta)
            p = mla_prolog(h, a.weight_dq, a.weight_uq_qr, a.weight_uk, a.weight_dkv_kr, a.gamma_cq, a.gamma_ckv,
                           sin, cos, self.kv[g][L], self.kr[g][L], cache_index=r.slots,
                           rmsnorm_epsilon_cq=c.rms_norm_eps, rmsnorm_epsilon_ckv=c.rms_norm_eps, aic=aic,
                           pod=self._pod(), die=g)
            t_prolog = max(t_prolog, p.run.modeled_us)
            o = torch.empty(len(r.tokens), c.num_attention_heads, c.kv_lora_rank, dtype=BF16)
            us = 0.0
            # one attention call per query length S (decode rows together, each prefill chunk alone)
            by_s = {}
            for s, span in zip(r.seqs, r.spans):
                by_s.setdefault(span[1], []).append((s, span))
            for S, items in sorted(by_s.items()):
                nb = max(-(-(s.start_pos + S) // self.block_size) for s, _ in items)
                bt = torch.zeros(len(items), nb, dtype=torch.int32)
                for b, (s, _) in enumerate(items):
                    need = -(-(s.start_pos + S) // self.block_size)
                    bt[b, :need] = torch.as_tensor(s.block_table[:need], dtype=torch.int32)
                rsel = torch.cat([torch.arange(r0, r0 + n) for _, (r0, n) in items])
                q = p.query[rsel].reshape(len(items), S, c.num_attention_heads, -1)
                qr = p.query_rope[rsel].reshape(len(items), S, c.num_attention_heads, -1)
                res = mla_decode_attention(q, qr, self.kv[g][L], self.kr[g][L], bt,
                                           [s.start_pos + S for s, _ in items], softmax_scale=c.softmax_scale,
                                           tiling="batch", aic=aic, pod=self._pod(), die=g)
                o[rsel] = res.attention_out.reshape(-1, c.num_attention_heads, c.kv_lora_rank)
                us += res.run.modeled_us
            t_attn = max(t_attn, us)
            outs.append(o)
        timer.add(key[0], key[1], "attn", "prolog", t_prolog)
        timer.add(key[0], key[1], "attn", "attention", t_attn)
        # W_uv: one group per head over head-major rows, then wo; every group's die in one run each
        act = [g for g in range(len(xs)) if outs[g] is not None]
        if not act:
            return xs
        n = c.num_attention_heads
        hm = [outs[g].transpose(0, 1).reshape(-1, c.kv_lora_rank).contiguous() for g in act]
        gl = [[len(rows[g].tokens) * (i + 1) for i in range(n)] for g in act]
        r1 = grouped_matmul(Ranks(hm), a.weight_uv, group_list=Ranks(gl), dies=act, cores=aic, pod=self._pod())
        v = [y.reshape(n, -1, c.v_head_dim).transpose(0, 1).reshape(-1, n * c.v_head_dim).contiguous()
             for y in r1.y]
        vs = [None] * len(xs)
        for g, y in zip(act, v):
            vs[g] = y
        o, us = self._gemm_groups(vs, a.wo, BF16, int8=a.wo_int8, stream="attn")
        timer.add(key[0], key[1], "attn", "o_proj", r1.run.modeled_us + us)
        res = list(xs)
        for g in act:
            res[g] = xs[g] + o[g]
        return res

    # ------------------------------------------------------------------------------------------- FFN / MoE
    def _gemm_groups(self, hs: list, w: torch.Tensor, out_dtype, *, rms_norm_gamma=None, swiglu=False,
                     stream="attn", int8=None):
        """One GEMM [T_g, K] x w [K, N] on every group with rows (one run); returns (per-group outputs, us).
        ``int8`` (an ``Int8Linear``): W8A8 instead: dynamic_quant, then the int8 grouped GEMM (two runs)."""
        act = [g for g, h in enumerate(hs) if h is not None and len(h)]
        outs = [None] * len(hs)
        if not act:
            return outs, 0.0
        xs = [rms_norm(hs[g], rms_norm_gamma, self.c.rms_norm_eps) if rms_norm_gamma is not None else hs[g]
              for g in act]
        cores = self._cores(stream)
        us = 0.0
        if int8 is not None:
            q = dynamic_quant(xs, dies=act, cores=2 * cores, pod=self._pod())
            us += q.run.modeled_us
            r = grouped_matmul(Ranks(q.y), int8.weight[None], scale=int8.scale[None], per_token_scale=Ranks(q.scale),
                               group_list=Ranks([len(x)] for x in xs), dies=act, swiglu=swiglu, cores=cores,
                               pod=self._pod())
        else:
            r = grouped_matmul(Ranks(xs), w[None], group_list=Ranks([len(x)] for x in xs), dies=act,
                               output_dtype=out_dtype, swiglu=swiglu, cores=cores, pod=self._pod())
        for g, y in zip(act, r.y):
            outs[g] = y
        return outs, us + r.run.modeled_us

    def _ffn(self, f, hs: list, stream: str):
        g1, us1 = self._gemm_groups(hs, f.w13, BF16, swiglu=True, stream=stream, int8=f.w13_int8)
        g2, us2 = self._gemm_groups(g1, f.w2, BF16, stream=stream, int8=f.w2_int8)
        return g2, us1 + us2

    def _dense(self, f, hs, timer, key):
        ys, us = self._ffn(f, hs, "moe")
        timer.add(key[0], key[1], "moe", "dense_ffn", us)
        return [y if y is not None else torch.zeros(0, self.c.hidden_size, dtype=BF16) for y in ys]

    def _moe(self, li: int, m, hs: list, timer: _Timer, key, fail):
        c = self.c
        alive = [d for d in range(self.num_groups) if self.alive[d]]
        cores = self._cores("moe")

        def t(op, us):
            timer.add(key[0], key[1], "moe", op, us)

        logits, us = self._gemm_groups(hs, m.router, torch.float32, stream="moe")
        t("router", us)
        act = [g for g in alive if logits[g] is not None]
        k = c.num_experts_per_tok
        ids = {g: torch.zeros(0, k, dtype=torch.int32) for g in alive}
        wts = {g: torch.zeros(0, k, dtype=torch.float32) for g in alive}
        if act:
            gr = moe_gating_top_k([logits[g] for g in act], k, bias=m.bias, k_group=c.topk_group,
                                  group_count=c.n_group, group_select_mode=1,
                                  routed_scaling_factor=c.routed_scaling_factor, dies=act, cores=cores * 2,
                                  pod=self._pod())
            t("gating", gr.run.modeled_us)
            for g, y, i in zip(act, gr.y, gr.expert_idx):
                ids[g], wts[g] = i, y
                self.loads[li] += np.bincount(i.reshape(-1).numpy(), minlength=c.n_routed_experts)
        # logical -> physical replica: rotate over replicas by arrival order (eplb.map_experts, by="rank")
        log2phy, logcnt, p2l = self._slot_maps(li)
        phys = []
        for g in alive:
            if len(ids[g]):
                table = eplb.rotation_table(log2phy, logcnt, len(ids[g]) * k)
                phys.append(eplb.map_experts(table, ids[g].numpy(), by="rank"))
            else:
                phys.append(np.zeros((0, k), np.int32))
        max_bs = max(1, max(len(ids[g]) for g in alive))
        pod = self._pod()
        group = MoeGroup(pod, alive, max_bs=max_bs, hidden=c.hidden_size, topk=k, num_experts=len(p2l),
                         cores=cores * 2)
        x_in = [hs[g] if hs[g] is not None else torch.zeros(0, c.hidden_size, dtype=BF16) for g in alive]
        for at_us, die in fail:
            pod.kill_die(die, at_us=at_us)

        def failed(what, cause=None):
            """The step's first killed die as a DieFailure; the others are reported by the next calls."""
            first, *rest = [d for _, d in fail]
            self._killed += rest
            return DieFailure(first, first, f"die {first} failed during MoE layer {key[0]} {what}"
                              + (f": {cause}" if cause is not None else ""))

        def detect(what, fn, *args, **kw):
            """Run a collective of the MoE group; a killed die shows as a bounded wait that expires."""
            try:
                res = fn(*args, **kw)
            except (DeadlockError, FaultError) as e:
                if not fail:
                    raise DieFailure(None, None, f"MoE layer {key[0]} {what} stalled: {e}") from e
                raise failed(what, e) from e
            if any(d in pod.engine.dead_dies for _, d in fail):          # died, even if after this collective
                raise failed(what)
            return res

        d = detect("dispatch", moe_distribute_dispatch, x_in, phys, group)
        t("dispatch", d.run.modeled_us)
        # expert GEMMs on every rank with received rows
        ranks = [r for r, die in enumerate(alive) if len(d.expand_x[r])]
        ys = {r: torch.zeros(0, c.hidden_size, dtype=BF16) for r in range(len(alive))}
        if ranks:
            slot_e = [p2l[r * self.slots:(r + 1) * self.slots] for r in ranks]
            x8 = [torch.from_numpy(np.ascontiguousarray(d.expand_x[r])) for r in ranks]
            xs8 = [torch.from_numpy(np.ascontiguousarray(d.dynamic_scales[r])) for r in ranks]
            gl = [torch.as_tensor(d.expert_token_nums[r], dtype=torch.int64) for r in ranks]
            dies = [alive[r] for r in ranks]
            r1 = grouped_matmul(Ranks(x8), Ranks(m.w13[se] for se in slot_e), scale=Ranks(m.s13[se] for se in slot_e),
                                per_token_scale=Ranks(xs8), group_list=Ranks(gl), group_list_type=1, swiglu=True,
                                dies=dies, cores=cores, pod=self._pod())
            t("gmm_gate_up", r1.run.modeled_us)
            q = dynamic_quant(list(r1.y), dies=dies, cores=cores * 2, pod=self._pod())
            t("quant", q.run.modeled_us)
            r2 = grouped_matmul(Ranks(q.y), Ranks(m.w2[se] for se in slot_e), scale=Ranks(m.s2[se] for se in slot_e),
                                per_token_scale=Ranks(q.scale), group_list=Ranks(gl), group_list_type=1, dies=dies,
                                cores=cores, pod=self._pod())
            t("gmm_down", r2.run.modeled_us)
            for r, y in zip(ranks, r2.y):
                ys[r] = y
        sh, us = self._ffn(m.shared, [hs[g] if hs[g] is not None and len(hs[g]) else None for g in
                                      range(len(hs))], "moe")
        t("shared", us)
        shared = [sh[g] if sh[g] is not None else torch.zeros(0, c.hidden_size, dtype=BF16) for g in alive]
        outs, run = detect("combine", moe_distribute_combine, [ys[r] for r in range(len(alive))], d,
                           [wts[g].numpy() for g in alive], group, shared_expert_x=shared)
        t("combine", run.modeled_us)
        if fail:                 # killed after the exchange finished: dead all the same by the end of the step
            raise failed("(after its exchange)")
        res = []
        for g in range(len(hs)):
            if g in alive:
                o = outs[alive.index(g)]
                res.append(to_torch(o) if o is not None and len(o) else torch.zeros(0, c.hidden_size, dtype=BF16))
            else:
                res.append(torch.zeros(0, c.hidden_size, dtype=BF16))
        return res

    # ------------------------------------------------------------------------------------------- MTP
    def _mtp(self, rows: list, xs: list, preds: dict, timer: _Timer):
        """Draft one token per sequence with the MTP head at its last accepted position: the head runs over every
        accepted position (main hidden state + the token that follows it) to fill its own latent cache."""
        c = self.c
        mw = self.w.mtp[0]
        sub_rows, hs, embs = [], [], []
        for g, r in enumerate(rows):
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
            sub = self._rows(seqs)
            sub_rows.append(sub)
            hs.append(xs[g][sel] if sel else torch.zeros(0, c.hidden_size, dtype=BF16))
            embs.append(self.w.embed[torch.as_tensor(nxt, dtype=torch.long)] if nxt else None)
        x_in = [mtp_input(mw, h, e, c.rms_norm_eps) if e is not None else h for h, e in zip(hs, embs)]
        key = ("mtp", 0)
        before = sum(v for (l, _, _), v in timer.parts.items() if l == "mtp")
        x_in = self._attention(0, mw.layer.attn, x_in, sub_rows, timer, key, cache_layer=len(self.w.layers))
        hn = [rms_norm(x, mw.layer.ffn_norm, c.rms_norm_eps) for x in x_in]
        ys = self._dense(mw.layer.dense, hn, timer, key)
        x_out = [x + y for x, y in zip(x_in, ys)]
        last = [x[[r0 + n - 1 for r0, n in r.spans]] if r.seqs else None for x, r in zip(x_out, sub_rows)]
        logits, us = self._gemm_groups(last, self.w.lm_head, torch.float32, rms_norm_gamma=self.w.norm)
        us += sum(v for (l, _, _), v in timer.parts.items() if l == "mtp") - before
        drafts = {}
        for g, r in enumerate(sub_rows):
            if r.seqs:
                p = greedy(logits[g])
                for i, s in enumerate(r.seqs):
                    drafts[s.rid] = [int(p[i])]
        return drafts, us

    # ------------------------------------------------------------------------------------------- EPLB
    def _collect_and_rebalance(self):
        if self.rebalance_every and self.steps % self.rebalance_every == 0 and self.loads.sum():
            self._place(np.maximum(self.loads, 1))
            self.loads[:] = 0
            self.rebalances += 1

