"""MoE gating: torch_npu ``npu_moe_gating_top_k`` (DeepSeek-V3 group-limited routing) and
``npu_moe_gating_top_k_softmax`` as AIV kernels, with torch references.

DeepSeek-V3 routing, per token (row of router logits x [T, E]):
1. scores = sigmoid(x) (norm_type=1) or softmax(x) (norm_type=0), fp32;
2. selection values v = scores + bias (the bias steers selection only; weights use the unbiased scores);
3. group_count > 1: split v into group_count groups of E/group_count; score each group by its max
   (group_select_mode=0) or by the sum of its two largest values (group_select_mode=1, V3 with a bias); keep the
   best k_group groups and set the other groups' values to -inf;
4. expert_idx = the k largest v, in descending order; y = scores[expert_idx];
5. sigmoid: y = y / (sum(y) + eps); then y *= routed_scaling_factor (softmax weights are not renormalised, as in
   DeepSeek-V3's reference). y has x's dtype, expert_idx is int32.

Tie-break (defined here, kernel and reference agree): among equal values the LOWEST index wins, for groups and for
experts. torch.topk on CPU does not promise this (topk([1, 3, 3, 2, 3, 1], 3) gives indices [2, 4, 1]), so the
reference selects with a stable descending sort.

Kernel choice: no sort instruction is modeled, so top-k is an iterative arg-max over a tile of R tokens at once:
k passes of reduce_max, compare(eq), select(candidate indices, +big), reduce_min (-> lowest index holding the max),
compare(index table, idx), then retire the winner: its value -> -inf and its candidate index -> +big. The second
retirement is what keeps -inf a real value: once only -inf values are left (a -inf bias, or the experts of dropped
groups), the next pass still takes the lowest index that was not taken yet, as the reference's stable sort does.
Groups are retired the same way, and the kept groups are the retired ones. Every pass is a few vector instructions
over the [R, E] tile; no scalar reads of scores. The index table (0..E-1 as fp32) is a constant loaded from GM: the
vector unit here has no CreateVecIndex / arithmetic-progression instruction.

Non-finite inputs: +inf and -inf logits and biases select exactly as the reference does. NaN has no place in an
order (torch's sort would rank it above +inf and the weights would all be NaN), so a NaN logit or bias raises
``ArgumentError`` naming the argument, token and expert before anything runs; so do the inputs whose scores would be
NaN: softmax (norm_type=0) of a row holding +inf or only -inf, and, with group_select_mode=1, a group whose bias has
one +inf and otherwise -inf (its score, the sum of its top two, is inf - inf). Timing-only runs hold no values and
are not checked.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_emu import Pod, kernel
from ascend_emu.arguments import check_int
from ascend_emu.errors import ArgumentError, CapacityError, ShapeError

from .ranks import (Outputs, Pending, caller_streams, check_cores, check_dtype, join_ranks, make_pod, per_rank,
                    queue_ranks, run_ranks, split_ranks, to_gm, to_torch)

BIG = 3.0e38           # "no candidate" index sentinel for the lowest-index reduce_min
ROWS_MAX = 32          # tokens per tile


@kernel(cores="aiv")
def gating_kernel(ctx, x_gm, bias_gm, iota_gm, finished_gm, y_gm, idx_gm, out_gm, p):
    """x_gm [T, E] logits -> y_gm [T, k] weights (x dtype), idx_gm [T, k] int32, out_gm [T, E] fp32 (or None).
    bias_gm [E] (or None), iota_gm [max(E, G)] fp32 index table, finished_gm [T] uint8 (softmax variant) or None.
    ``p`` is the plan dict: k, k_group, group_count, mode, norm_type, renorm_weights, scale, eps, rows.
    Tile j (R tokens) runs on core j % block_num."""
    t_rows, e = x_gm.shape
    k, kg, g_cnt, rows = p["k"], p["k_group"], p["group_count"], p["rows"]
    eg = e // g_cnt
    tiles = range(ctx.block_idx, -(-t_rows // rows), ctx.block_num)
    if not len(tiles):
        return
    f32 = "fp32"
    ub = ctx.ub
    iota = ub.alloc((max(e, g_cnt),), f32, name="iota")
    ninf = ub.alloc((1,), f32, name="ninf")                # scalar operands of select, broadcast
    big = ub.alloc((1,), f32, name="big")
    x_in = None if x_gm.dtype == np.float32 else ub.alloc((rows, e), x_gm.dtype, name="x")
    s = ub.alloc((rows, e), f32, name="scores")           # norm scores (weights come from here)
    v = ub.alloc((rows, e), f32, name="select")           # biased, masked selection values
    cand = ub.alloc((rows, e), f32, name="cand")
    avail = ub.alloc((rows, e), f32, name="avail_idx")   # index of each expert not taken yet, +big once taken
    mask = ub.alloc((rows, e), "uint8", name="mask")
    col = ub.alloc((rows,), f32, name="col")               # one value per token
    w_t = ub.alloc((k, rows), f32, name="w")               # [k, R]: pass j fills row j (32-byte aligned rows)
    i_t = ub.alloc((k, rows), f32, name="idx")
    i_out = ub.alloc((k, rows), "int32", name="idx_i32")
    w_out = None if y_gm.dtype == np.float32 else ub.alloc((k, rows), y_gm.dtype, name="w_out")
    if bias_gm is not None:
        b_in = None if bias_gm.dtype == np.float32 else ub.alloc((e,), bias_gm.dtype, name="bias_in")
        b_t = ub.alloc((e,), f32, name="bias")
    if g_cnt > 1:
        gs = ub.alloc((rows, g_cnt), f32, name="group_score")
        g2 = ub.alloc((rows, g_cnt), f32, name="group_second")
        gcnt = ub.alloc((rows, g_cnt), f32, name="group_ties")
        gmask = ub.alloc((rows, g_cnt), "uint8", name="group_mask")
        gcand = ub.alloc((rows, g_cnt), f32, name="group_cand")
        gavail = ub.alloc((rows, g_cnt), f32, name="group_avail_idx")
    if finished_gm is not None:
        fin = ub.alloc((rows,), "uint8", name="finished")
        e_const = ub.alloc((1,), f32, name="num_experts")

    # constants: index table, -inf, +big, bias (once per core)
    yield ctx.copy_gm_to_ub(iota, iota_gm, pad=True)
    yield ctx.vec.duplicate(ninf, -np.inf)
    yield ctx.vec.duplicate(big, BIG)
    if finished_gm is not None:
        yield ctx.vec.duplicate(e_const, float(e))
    if bias_gm is not None:
        if b_in is None:
            yield ctx.copy_gm_to_ub(b_t, bias_gm, pad=True)
        else:
            yield ctx.copy_gm_to_ub(b_in, bias_gm, pad=True)
            yield ctx.vec.cast(b_t, b_in)
    vec = ctx.vec
    for t in tiles:
        r0 = t * rows
        r = min(rows, t_rows - r0)
        S, V, C, M = s[:r], v[:r], cand[:r], mask[:r]
        c1 = col[:r].reshape(r, 1)
        # 1. logits -> fp32 scores
        if x_in is None:
            yield ctx.copy_gm_to_ub(S, x_gm[r0:r0 + r], pad=True)
        else:
            yield ctx.copy_gm_to_ub(x_in[:r], x_gm[r0:r0 + r], pad=True)
            yield vec.cast(S, x_in[:r])
        if p["norm_type"] == 1:                            # sigmoid = 1 / (1 + exp(-x))
            yield vec.muls(S, S, -1.0)
            yield vec.exp(S, S)
            yield vec.adds(S, S, 1.0)
            yield vec.reciprocal(S, S)
        else:                                              # softmax = exp(x - max) / sum
            yield vec.reduce_max(c1, S)
            yield vec.sub(S, S, c1)
            yield vec.exp(S, S)
            yield vec.reduce_sum(c1, S)
            yield vec.div(S, S, c1)
        if out_gm is not None:
            yield ctx.copy_ub_to_gm(out_gm[r0:r0 + r], S, pad=True)
        # 2. selection values
        if bias_gm is not None:
            yield vec.add(V, S, b_t)
        else:
            yield vec.copy(V, S)
        # 3. group-limited routing
        if g_cnt > 1:
            V3, M3, C3 = V.reshape(r, g_cnt, eg), M.reshape(r, g_cnt, eg), C.reshape(r, g_cnt, eg)
            GS, G2, GC, GM, GD = gs[:r], g2[:r], gcnt[:r], gmask[:r], gcand[:r]
            GS1 = GS.reshape(r, g_cnt, 1)
            yield vec.reduce_max(GS, V3)                   # each group's max
            if p["mode"] == 1:                             # + its second largest (= the max again if it repeats)
                yield vec.compare(M3, V3, GS1, "eq")
                yield vec.cast(C3, M3)
                yield vec.reduce_sum(GC, C3)               # how many hold the max
                yield vec.select(C3, M3, ninf, V3)
                yield vec.reduce_max(G2, C3)
                yield vec.compare(GM, GC, 2.0, "ge")
                yield vec.select(G2, GM, GS, G2)
                yield vec.add(GS, GS, G2)
            ig = iota[:g_cnt]
            GA = gavail[:r]
            yield vec.broadcast(GA, ig)
            for _ in range(kg):                            # k_group arg-max passes over the groups not kept yet
                yield vec.reduce_max(c1, GS)
                yield vec.compare(GM, GS, c1, "eq")
                yield vec.select(GD, GM, GA, big)
                yield vec.reduce_min(c1, GD)               # lowest group index holding the max
                yield vec.compare(GM, ig, c1, "eq")
                yield vec.select(GS, GM, ninf, GS)         # kept: out of the next passes' max ...
                yield vec.select(GA, GM, big, GA)          # ... and of their candidates, even at -inf
            yield vec.compare(GM, GA, big, "eq")           # kept groups
            yield vec.select(V3, GM.reshape(r, g_cnt, 1), V3, ninf)
        # 4. top-k: k arg-max passes over [r, E]
        ie = iota[:e]
        A = avail[:r]
        yield vec.broadcast(A, ie)
        for j in range(k):
            wj, ij = w_t[j, :r], i_t[j, :r]
            ij1 = ij.reshape(r, 1)
            yield vec.reduce_max(c1, V)
            yield vec.compare(M, V, c1, "eq")
            yield vec.select(C, M, A, big)
            yield vec.reduce_min(ij, C)                    # lowest expert index not taken yet holding the max
            yield vec.compare(M, ie, ij1, "eq")
            yield vec.select(C, M, S, ninf)
            yield vec.reduce_max(wj, C)                    # its unbiased score
            if j + 1 < k:                                  # retire the winner: value and candidate index
                yield vec.select(V, M, ninf, V)
                yield vec.select(A, M, big, A)
        # 5. weights
        W = w_t[:, :r]
        if p["renorm_weights"]:
            den = col[:r]
            yield vec.copy(den, w_t[0, :r])
            for j in range(1, k):
                yield vec.add(den, den, w_t[j, :r])
            yield vec.adds(den, den, p["eps"])
            yield vec.div(W, W, den)
        if p["scale"] != 1.0:
            yield vec.muls(W, W, p["scale"])
        if finished_gm is not None:                        # finished rows: expert index = E
            yield ctx.copy_gm_to_ub(fin[:r], finished_gm[r0:r0 + r], pad=True)
            yield vec.select(i_t[:, :r], fin[:r], e_const, i_t[:, :r])
        yield vec.cast(i_out[:, :r], i_t[:, :r])
        if w_out is not None:
            yield vec.cast(w_out[:, :r], W)
        wsrc = w_t if w_out is None else w_out
        for j in range(k):                                 # [k, R] tile -> columns of [T, k]: DataCopyPad, strided GM
            yield ctx.copy_ub_to_gm(y_gm[r0:r0 + r, j], wsrc[j, :r], pad=True)
            yield ctx.copy_ub_to_gm(idx_gm[r0:r0 + r, j], i_out[j, :r], pad=True)


# ============================================================================================ host API
@dataclass
class GatingResult(Outputs):
    """``y`` [T, k] routing weights (x's dtype), ``expert_idx`` [T, k] int32, ``out`` [T, E] fp32 norm scores
    (None unless out_flag), ``run`` the RunResult."""
    y: object
    expert_idx: object
    out: object
    run: object
    _outputs = ("y", "expert_idx", "out")


@dataclass
class GatingSoftmaxResult(Outputs):
    """``y`` [T, k] softmax top-k values (x's dtype), ``expert_idx`` [T, k] int32 (E for finished rows),
    ``row_idx`` [T, k] int32 (row_idx[i, j] = j * T + i), ``run``."""
    y: object
    expert_idx: object
    row_idx: object
    run: object
    _outputs = ("y", "expert_idx", "row_idx")


def _plan_rows(t_rows: int, cores: int, e: int, g_cnt: int, k: int, ub_bytes: int) -> int:
    """Tokens per tile: a multiple of 16 (rows of the [k, R] bf16 tile stay 32-byte aligned), at most ROWS_MAX,
    no more than a core's share, and few enough that the kernel's tiles fit the UB (checked here, not at alloc)."""
    per_core = -(-max(t_rows, 1) // cores)
    want = min(ROWS_MAX, 16 * -(-per_core // 16))
    per_row = e * (4 * 4 + 1 + 2) + g_cnt * (5 * 4 + 1) + k * (3 * 4 + 2) + 4 + 1   # [R, *] tiles, bytes per token
    fixed = e * (4 + 2 + 4) + 4 * max(e, g_cnt) + 32 * 24                          # [E] tiles, alignment slack
    fit = 16 * ((ub_bytes - fixed) // (16 * per_row)) if ub_bytes > fixed else 0
    if fit < 16:
        raise CapacityError(f"x.shape[-1]={e} experts: a tile of 16 tokens needs {16 * per_row + fixed} bytes of UB, "
                            f"the {ub_bytes}-byte UB holds fewer")
    return int(min(want, fit))


def _launch(xs, form, biases, finished, p, numeric, pod, dies, cores, trace, out_flag, result, stream=None,
            after=()):
    """Check, place and launch every rank's gating; ``result(y, expert_idx, out, run)`` makes the host function's
    result (now, or at ``collect`` when queued on the caller's ``stream``). Timing only, the inputs may be
    ``kernels.ranks.HostShape`` (no torch is loaded then)."""
    n = len(xs)
    if stream is not None:
        pod, dies, cores, streams = caller_streams(stream, n, "aiv", cores)
    else:
        pod, dies = make_pod(pod, dies, n, trace)
        cores = check_cores(pod.profile, cores)
    prof = pod.profile
    launches, outs = [], []
    for r, (xr, br, fr, die) in enumerate(zip(xs, biases, finished, dies)):
        dt = check_dtype(xr, "x", ("fp16", "bf16", "fp32"))
        if xr.ndim != 2:
            raise ShapeError(f"x must be 2-D [tokens, experts], got shape {tuple(xr.shape)}")
        t_rows, e = (int(d) for d in xr.shape)
        if e % p["group_count"]:
            raise ShapeError(f"x.shape[-1]={e} experts do not split into group_count={p['group_count']} groups")
        if br is not None:
            if tuple(br.shape) != (e,):
                raise ShapeError(f"bias must be [E={e}], got {tuple(br.shape)}")
            check_dtype(br, "bias", ("fp16", "bf16", "fp32"))
        if numeric:
            _check_orderable(xr, br, p, "x" if form == "single" else f"x[{r}]")
        x_gm = to_gm(pod, die, xr, f"logits{r}", numeric)
        b_gm = None if br is None else to_gm(pod, die, br, f"bias{r}", numeric)
        f_gm = None
        if fr is not None:
            if tuple(fr.shape) != (t_rows,):
                raise ShapeError(f"finished must be [T={t_rows}], got {tuple(fr.shape)}")
            import torch
            f_gm = to_gm(pod, die, torch.as_tensor(fr).to(torch.uint8), f"finished{r}", numeric, real=True)
        iota = np.arange(max(e, p["group_count"]), dtype=np.float32)
        i_gm = to_gm(pod, die, iota, f"index_table{r}", numeric, real=True)
        y_gm = pod.alloc(die, (t_rows, p["k"]), dt, phantom=not numeric, name=f"y{r}")
        idx_gm = pod.alloc(die, (t_rows, p["k"]), "int32", phantom=not numeric, name=f"expert_idx{r}")
        o_gm = pod.alloc(die, (t_rows, e), "fp32", phantom=not numeric, name=f"out{r}") if out_flag else None
        pr = dict(p, rows=_plan_rows(t_rows, cores, e, p["group_count"], p["k"], prof.ub_bytes))
        n_tiles = -(-t_rows // pr["rows"])
        launches.append((die, gating_kernel, (x_gm, b_gm, i_gm, f_gm, y_gm, idx_gm, o_gm, pr),
                         {"aiv": max(1, min(cores, n_tiles))}, numeric))
        outs.append((y_gm, idx_gm, o_gm))
    def finish(run):
        ys = [to_torch(y.numpy()) if numeric else None for y, _, _ in outs]
        ids = [to_torch(i.numpy()) if numeric else None for _, i, _ in outs]
        os_ = [to_torch(o.numpy()) if (numeric and o is not None) else None for _, _, o in outs]
        return result(join_ranks(ys, form), join_ranks(ids, form), join_ranks(os_, form), run)
    if stream is not None:
        return Pending(queue_ranks(launches, streams, after), finish)
    return finish(run_ranks(pod, launches))


def _check_orderable(x, bias, p, name: str) -> None:
    """Raise for the inputs whose selection values would hold NaN (see the module docstring); meta tensors (no
    values) pass."""
    import torch
    if getattr(x, "is_meta", False) or getattr(bias, "is_meta", False):
        return
    xf = torch.as_tensor(x).float()
    nan = torch.isnan(xf)
    if nan.any():
        t, e = (int(i) for i in nan.nonzero()[0])
        raise ArgumentError(f"{name} holds NaN at token {t}, expert {e}: router logits must not be NaN (NaN has no "
                            f"place in a top-k order)")
    if p["norm_type"] == 0:
        bad = torch.isposinf(xf).any(-1) | torch.isneginf(xf).all(-1)
        if bad.any():
            t = int(bad.nonzero()[0])
            raise ArgumentError(f"{name} token {t} holds +inf or only -inf: its softmax (norm_type=0) is NaN")
    if bias is None:
        return
    bf = torch.as_tensor(bias).float()
    if torch.isnan(bf).any():
        raise ArgumentError(f"bias holds NaN at expert {int(torch.isnan(bf).nonzero()[0])}: a selection bias must not "
                            f"be NaN")
    if p["group_count"] > 1 and p["mode"] == 1:
        top2 = bf.view(p["group_count"], -1).sort(-1, descending=True).values[:, :2]
        bad = torch.isposinf(top2[:, 0]) & torch.isneginf(top2[:, 1])
        if bad.any():
            raise ArgumentError(f"bias: group {int(bad.nonzero()[0])} has one +inf and otherwise -inf biases, so its "
                                f"score with group_select_mode=1 (the sum of its top two) is inf - inf = NaN")


def _check_k(k, e_min, k_group, group_count):
    check_int(k, "k", 1)
    if not 1 <= k <= e_min // group_count * k_group:
        raise ArgumentError(f"k={k} out of range 1..{e_min // group_count * k_group} (experts / group_count * "
                            f"k_group)")


def moe_gating_top_k(x, k: int, *, bias=None, k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                     renorm: int = 0, norm_type: int = 1, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0, eps: float = 1e-20, numeric: bool = True,
                     pod: Pod | None = None, dies=None, cores: int | None = None, trace: bool = True,
                     stream=None, after=()):
    """torch_npu.npu_moe_gating_top_k on the emulator (arguments and defaults as torch_npu; DeepSeek-V3 routing is
    ``k=8, bias=e_score_correction_bias, k_group=4, group_count=8, group_select_mode=1, routed_scaling_factor=2.5``).

    x: router logits [T, E] fp32/fp16/bf16 for one rank, [R, T, E] (leading rank dim) or a list of per-rank [T_r, E].
    bias: [E] (one for every rank, or per rank). renorm: 0 only (norm, then top-k). norm_type: 1 sigmoid, 0 softmax.
    Returns ``GatingResult(y, expert_idx, out, run)``; see the module docstring for the math and the tie-break.
    stream / after: queue on the caller's streams instead (their AIVs) and return a ``kernels.ranks.Pending``.
    """
    if renorm != 0:
        raise ArgumentError(f"renorm={renorm}: only 0 (normalise, then top-k) is supported")
    if norm_type not in (0, 1):
        raise ArgumentError(f"norm_type={norm_type}: use 1 (sigmoid) or 0 (softmax)")
    if group_select_mode not in (0, 1):
        raise ArgumentError(f"group_select_mode={group_select_mode}: use 0 (group max) or 1 (sum of the top 2)")
    check_int(group_count, "group_count", 1)
    check_int(k_group, "k_group", 1, group_count)
    xs, form = split_ranks(x, "x", stacked_ndim=2)
    e_min = min(int(xr.shape[-1]) for xr in xs)
    _check_k(k, e_min, k_group, group_count)
    if group_count > 1 and group_select_mode == 1 and e_min // group_count < 2:
        raise ArgumentError(f"group_select_mode=1 sums each group's top 2: groups of {e_min // group_count} expert")
    p = {"k": int(k), "k_group": int(k_group) if group_count > 1 else 1, "group_count": int(group_count),
         "mode": group_select_mode, "norm_type": norm_type, "renorm_weights": norm_type == 1,
         "scale": float(routed_scaling_factor), "eps": float(eps)}
    biases = per_rank(bias, len(xs), "bias", stacked_ndim=1)
    return _launch(xs, form, biases, [None] * len(xs), p, numeric, pod, dies, cores, trace, out_flag,
                   lambda y, idx, out, run: GatingResult(y, idx, out, run), stream, after)


def moe_gating_top_k_softmax(x, finished=None, k: int = 1, *, numeric: bool = True, pod: Pod | None = None,
                             dies=None, cores: int | None = None, trace: bool = True) -> GatingSoftmaxResult:
    """torch_npu.npu_moe_gating_top_k_softmax on the emulator: softmax over experts, then top-k (lowest index wins
    ties); rows with ``finished`` True get expert index E. x: [T, E], [R, T, E] or a list; finished: [T] bool."""
    import torch
    xs, form = split_ranks(x, "x", stacked_ndim=2)
    e_min = min(int(xr.shape[-1]) for xr in xs)
    _check_k(k, e_min, 1, 1)
    p = {"k": int(k), "k_group": 1, "group_count": 1, "mode": 0, "norm_type": 0, "renorm_weights": False,
         "scale": 1.0, "eps": 0.0}
    fins = per_rank(finished, len(xs), "finished", stacked_ndim=1)
    rows = [torch.arange(int(k) * xr.shape[0], dtype=torch.int32).reshape(int(k), xr.shape[0]).T.contiguous()
            for xr in xs]                                 # a function of the shape: made on the host
    return _launch(xs, form, [None] * len(xs), fins, p, numeric, pod, dies, cores, trace, False,
                   lambda y, idx, _, run: GatingSoftmaxResult(y, idx, join_ranks(rows, form), run))


# ============================================================================================ torch references
def topk_lowest_index(v, k: int):
    """(values, indices) of the k largest along the last dim, descending, ties to the lowest index."""
    import torch
    vals, idx = torch.sort(v, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def gating_select_reference(scores, k: int, *, bias=None, k_group: int = 1, group_count: int = 1,
                            group_select_mode: int = 0, renorm_weights: bool = True,
                            routed_scaling_factor: float = 1.0, eps: float = 1e-20):
    """Selection and weighting from fp32 norm ``scores`` [T, E]: (weights fp32 [T, k], expert_idx int32 [T, k])."""
    import torch
    t_rows, e = scores.shape
    v = scores + bias.float() if bias is not None else scores.clone()
    if group_count > 1:
        g = v.view(t_rows, group_count, e // group_count)
        if group_select_mode == 1:
            top2, _ = topk_lowest_index(g, 2)
            gs = top2[..., 0] + top2[..., 1]
        else:
            gs = g.amax(-1)
        _, gidx = topk_lowest_index(gs, k_group)
        keep = torch.zeros(t_rows, group_count, dtype=torch.bool).scatter_(1, gidx, True)
        v = g.masked_fill(~keep[..., None], float("-inf")).reshape(t_rows, e)
    _, idx = topk_lowest_index(v, k)
    w = scores.gather(1, idx)
    if renorm_weights:
        w = w / (w.sum(-1, keepdim=True) + eps)
    return w * routed_scaling_factor, idx.to(torch.int32)


def moe_gating_top_k_reference(x, k: int, *, bias=None, k_group: int = 1, group_count: int = 1,
                               group_select_mode: int = 0, norm_type: int = 1, routed_scaling_factor: float = 1.0,
                               eps: float = 1e-20):
    """torch reference of ``moe_gating_top_k`` for one rank: (y x.dtype, expert_idx int32, out fp32 scores)."""
    import torch
    xf = x.float()
    scores = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, dim=-1)
    w, idx = gating_select_reference(scores, k, bias=bias, k_group=k_group if group_count > 1 else 1,
                                     group_count=group_count, group_select_mode=group_select_mode,
                                     renorm_weights=norm_type == 1, routed_scaling_factor=routed_scaling_factor,
                                     eps=eps)
    return w.to(x.dtype), idx, scores


def moe_gating_top_k_softmax_reference(x, finished=None, k: int = 1):
    """torch reference of ``moe_gating_top_k_softmax`` for one rank: (y, expert_idx, row_idx)."""
    import torch
    scores = torch.softmax(x.float(), dim=-1)
    w, idx = gating_select_reference(scores, k, renorm_weights=False)
    if finished is not None:
        idx = torch.where(torch.as_tensor(finished, dtype=torch.bool)[:, None], x.shape[-1], idx).to(torch.int32)
    t_rows = x.shape[0]
    row_idx = torch.arange(k * t_rows, dtype=torch.int32).reshape(k, t_rows).T.contiguous()
    return w.to(x.dtype), idx, row_idx
