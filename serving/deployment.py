"""A decode deployment: how a model's decode instance is laid out over dies (DP attention + EP MoE), as data.

    d = PRESETS["cloudmatrix-infer"]                      # the paper's decode instance (DESIGN.md 8)
    d = resolve(preset="cloudmatrix-infer", mtp=1)        # a preset with explicit fields overriding it
    layout = d.expert_layout(V3)                          # which die holds which routed replica, shared-expert dies
    ids = d.routing(V3, tokens=48)                        # per rank [48, 8] physical expert ids (balanced routing)

Dies (EP ranks, CANN's ``expert_shard_type`` 0): dies ``0 .. shared_expert_dies - 1`` each host a copy of the
shared expert; the other ``dies - shared_expert_dies`` routed-expert dies hold ``(n_routed_experts +
redundant_experts) / routed-expert dies`` physical routed experts each, contiguous (physical expert p on die
``shared_expert_dies + p // experts_per_die``). Every die is also one DP attention rank with ``batch_per_die``
sequences. Each token goes to its top-K routed experts and, with shared-expert dies, to shared die ``r %
shared_expert_dies`` (r its rank: ``torch_npu.npu_moe_distribute_dispatch``'s ``shared_expert_rank_num``,
whose kernel sends to ``epRankId % rankNumPerSharedExpert``), so a shared die receives the tokens of ``dies /
shared_expert_dies`` ranks. ``shared_expert_dies = 0``: the shared expert is computed locally on every die.

Redundant experts (``eplb``): the load estimate is the balanced routing's (every logical expert receives the same
rows), so ``eplb.rebalance_experts`` (one load slice, locality "none") gives the ``redundant_experts`` extra replicas
to experts 0 .. R-1 (its greedy splits the largest per-replica share, lowest expert id first on ties) and places
them; each rank's rows of a replicated expert split over the replicas by ``eplb.map_experts`` (``by="rank"``: the
j-th (token, k) entry of that expert on rank r goes to replica ``(j + r) % replicas``), so the split is
deterministic and within one row of even per rank.

W8A8 with ``quant`` (the paper: INT8 for the large matmuls of FFN and attention, per-token activations x per-channel
weights): routed and shared experts, the dense FFN, o_proj and MLAProlog (weight_quant_mode 2: the normed hidden
state quantised per token by a dynamic quant before the prolog, int8 W_dq / W_dkv_kr / W_uq_qr; timing-only, the
numeric runner's MLA projections are bf16) run int8, and dispatch sends int8 rows (combine returns bf16). Left bf16:
the absorbed W_uk / W_uv per-head products (small [T, 128] x [128, 512] per head, kept bf16 as in the paper's
absorbed MLA), the router (its scores choose the experts) and lm_head.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import numpy as np

from ascend_emu.errors import ArgumentError

DEFAULT_ACCEPTANCE = 0.85      # DeepSeek-V3 report: 85-90 % acceptance of the second (MTP) token
DEFAULT_MOE_AIC = 8            # the MoE stream's AICs with two microbatches (the attention stream gets the rest)


@dataclass(frozen=True)
class Deployment:
    """One decode instance. ``dies``: DP attention ranks = EP ranks; ``batch_per_die`` sequences per die at
    ``seq_len`` context; ``shared_expert_dies`` / ``redundant_experts``: see the module doc; ``microbatches`` 1 or 2
    (two: the attention stream on AIC ``moe_aic``.. with their AIVs, the MoE stream on AIC 0 .. moe_aic - 1 and AIV
    0 .. 2 moe_aic - 1); ``mtp`` draft tokens per step (0 or 1), each accepted with probability ``acceptance``;
    ``quant``: W8A8 (module doc); ``kv_int8``: int8 latent cache. ``name``: the preset it came from."""
    dies: int = 16
    batch_per_die: int = 96
    seq_len: int = 4096
    shared_expert_dies: int = 0
    redundant_experts: int = 0
    microbatches: int = 2
    mtp: int = 0
    acceptance: float = DEFAULT_ACCEPTANCE
    quant: bool = True
    kv_int8: bool = False
    moe_aic: int = DEFAULT_MOE_AIC
    name: str = "custom"

    # ------------------------------------------------------------------------------------------- checks
    def check(self, cfg=None) -> "Deployment":
        """Raise ArgumentError naming the field and its limit; with a model config also the expert split."""
        for name in ("dies", "batch_per_die", "seq_len"):
            _positive_int(getattr(self, name), name)
        for name in ("shared_expert_dies", "redundant_experts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ArgumentError(f"{name}={v!r} must be an int >= 0")
        if self.microbatches not in (1, 2):
            raise ArgumentError(f"microbatches={self.microbatches}: use 1 or 2")
        if self.mtp not in (0, 1):
            raise ArgumentError(f"mtp={self.mtp}: use 0 or 1")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ArgumentError(f"acceptance={self.acceptance} must be in 0..1")
        if not 1 <= self.moe_aic <= 23:
            raise ArgumentError(f"moe_aic={self.moe_aic} out of range 1..23 (the attention stream needs AICs too)")
        if self.batch_per_die < self.microbatches:
            raise ArgumentError(f"batch_per_die={self.batch_per_die} must be at least microbatches="
                                f"{self.microbatches}")
        if self.seq_len < 1 + self.mtp:
            raise ArgumentError(f"seq_len={self.seq_len} must be at least the {1 + self.mtp} query tokens per "
                                f"sequence")
        s = self.shared_expert_dies
        if s and (s >= self.dies or self.dies % s):
            raise ArgumentError(f"shared_expert_dies={s} must be below dies={self.dies} and divide it (each "
                                f"shared-expert die takes the tokens of dies / shared_expert_dies ranks)")
        if cfg is not None:
            self._check_experts(cfg)
        return self

    def _check_experts(self, cfg) -> None:
        e, r, s = cfg.n_routed_experts, self.redundant_experts, self.shared_expert_dies
        if s and cfg.n_shared_experts < 1:
            raise ArgumentError(f"shared_expert_dies={s}: config {cfg.name!r} has no shared expert")
        if r > e:
            raise ArgumentError(f"redundant_experts={r} is above the {e} routed experts of config {cfg.name!r} "
                                f"(at most one extra replica per expert under the balanced load)")
        routed = self.dies - s
        if r and routed < 2:
            raise ArgumentError(f"redundant_experts={r} needs at least 2 routed-expert dies (dies - "
                                f"shared_expert_dies = {routed}): a replica lives on another die than its expert")
        if (e + r) % routed:
            if not (s or r):
                raise ArgumentError(f"dies={self.dies}: each die is one EP rank and must hold the same number of "
                                    f"the {e} routed experts (use a divisor, e.g. 8, 16, 32, 64)")
            raise ArgumentError(f"dies={self.dies}: the {e} routed + redundant_experts={r} physical experts must "
                                f"split evenly over the {routed} routed-expert dies (dies - shared_expert_dies="
                                f"{s}); e.g. redundant_experts={routed - e % routed if e % routed else 0}")

    # ------------------------------------------------------------------------------------------- layout
    def routed_dies(self) -> int:
        return self.dies - self.shared_expert_dies

    def physical_experts(self, cfg) -> int:
        return cfg.n_routed_experts + self.redundant_experts

    def experts_per_die(self, cfg) -> int:
        """Physical routed experts on each routed-expert die."""
        return self.physical_experts(cfg) // self.routed_dies()

    def expert_layout(self, cfg) -> "ExpertLayout":
        """Which logical expert each physical slot holds (``eplb`` on the balanced load estimate; module doc)."""
        self.check(cfg)
        return _expert_layout(self, cfg)

    def routing(self, cfg, tokens: int) -> list:
        """Per rank [tokens, K] physical expert ids of the balanced routing mapped to replicas (module doc)."""
        logical = balanced_routing(self.dies, tokens, cfg.num_experts_per_tok, cfg.n_routed_experts)
        if not self.redundant_experts:
            return logical
        import eplb
        layout = self.expert_layout(cfg)
        rows = tokens * cfg.num_experts_per_tok
        # rank r's rotation table (offset r) is rows r .. r + rows - 1 of the offset-0 one: one table for every rank
        table = eplb.rotation_table(layout.log2phy, layout.logcnt, rows + len(logical) - 1)
        return [eplb.map_experts(table[r:r + rows], ids, by="rank").astype(np.int64) for r, ids in enumerate(logical)]

    def received_rows(self, cfg, tokens: int) -> np.ndarray:
        """[dies] rows each die receives in one dispatch of ``tokens`` tokens per rank (routed rows on routed-expert
        dies, the tokens of its ranks on shared-expert dies), counted from the routing and the layout."""
        rows = np.zeros(self.dies, np.int64)
        epd, s = self.experts_per_die(cfg), self.shared_expert_dies
        for r, ids in enumerate(self.routing(cfg, tokens)):
            np.add.at(rows, s + ids.reshape(-1) // epd, 1)
            if s:
                rows[r % s] += tokens
        return rows

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ExpertLayout:
    """Physical routed experts: ``phy2log`` [P] logical expert of each slot, ``log2phy`` [E, X] slots of each expert
    (-1 padded), ``logcnt`` [E] replicas per expert; slot p lives on die ``shared_dies + p // experts_per_die``."""
    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    experts_per_die: int
    shared_dies: int
    dies: int

    def die_of_slot(self, slot) -> np.ndarray:
        return self.shared_dies + np.asarray(slot) // self.experts_per_die

    def replicated(self) -> list:
        """Logical experts with more than one replica, ascending."""
        return [int(e) for e in np.flatnonzero(self.logcnt > 1)]


@functools.lru_cache(maxsize=8)
def _expert_layout(d: Deployment, cfg) -> ExpertLayout:
    e, p = cfg.n_routed_experts, d.physical_experts(cfg)
    if not d.redundant_experts:
        phy2log = np.arange(e, dtype=np.int64)
        log2phy, logcnt = phy2log[:, None].copy(), np.ones(e, np.int64)
    else:
        import eplb
        load = np.ones((1, e))                         # balanced routing: every expert the same rows
        phy2log, log2phy, logcnt = (a[0] for a in eplb.rebalance_experts(
            load, p, cfg.n_group, 1, d.routed_dies(), locality="none"))
    for a in (phy2log, log2phy, logcnt):
        a.setflags(write=False)
    return ExpertLayout(phy2log, log2phy, logcnt, d.experts_per_die(cfg), d.shared_expert_dies, d.dies)


def balanced_routing(dies: int, tokens: int, topk: int, experts: int) -> list:
    """Logical expert ids [tokens, topk] per rank: ((r T + t) K + k) mod E: distinct experts per token, every expert
    the same number of rows when dies x tokens x topk is a multiple of E."""
    base = np.arange(tokens * topk, dtype=np.int64).reshape(tokens, topk)
    return [(r * tokens * topk + base) % experts for r in range(dies)]


def _positive_int(v, name: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ArgumentError(f"{name}={v!r} must be an int >= 1")


# ================================================================================================ presets
# The paper's decode instance (CloudMatrix384 paper sections 4.1, 5.1; DESIGN.md 8): 160 NPUs = 320 dies, EP320
# with one expert per die (256 routed, 32 redundant, 32 shared-expert copies), DP320 attention, 96 sequences per NPU
# = 48 per die at 4K context, INT8 (W8A8, INT8 dispatch), MTP acceptance 70 %, two microbatches with the attention
# stream on 16 AIC + 32 AIV and the MoE stream on 8 AIC + 16 AIV.
PRESETS: dict = {
    "cloudmatrix-infer": Deployment(dies=320, batch_per_die=48, seq_len=4096, shared_expert_dies=32,
                                    redundant_experts=32, microbatches=2, mtp=0, acceptance=0.7, quant=True,
                                    kv_int8=False, moe_aic=8, name="cloudmatrix-infer"),
}

OVERRIDABLE = tuple(f.name for f in fields(Deployment) if f.name != "name")


def resolve(deployment: Deployment | None = None, preset: str | None = None, **overrides) -> Deployment:
    """The deployment to run: ``deployment``, else the named ``preset``, else the defaults; then every override that
    is not None replaces its field (explicit options win over a preset)."""
    if deployment is not None and preset is not None:
        raise ArgumentError("pass deployment= or preset=, not both")
    if preset is not None and preset not in PRESETS:
        raise ArgumentError(f"preset={preset!r}: use one of {sorted(PRESETS)}")
    base = deployment if deployment is not None else PRESETS[preset] if preset is not None else Deployment()
    if not isinstance(base, Deployment):
        raise ArgumentError(f"deployment={base!r} must be a serving.deployment.Deployment")
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ArgumentError(f"unknown deployment fields {sorted(unknown)}; use {list(OVERRIDABLE)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **given).check() if given else base.check()


__all__ = ["Deployment", "ExpertLayout", "PRESETS", "resolve", "balanced_routing", "DEFAULT_ACCEPTANCE"]
