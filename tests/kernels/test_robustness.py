"""Robustness sweep over the kernels' public entry points (gating, dynamic quant, grouped GEMM, decode attention,
fused dispatch): dtypes, shapes, ranks, NaN/inf, out-of-range and non-integer ids, non-contiguous inputs.

The only allowed outcomes: the library's own error naming an argument the case made invalid, or a result equal to
the kernel's reference (bitwise where the reference is bitwise, within the documented tolerance otherwise). Each case
runs in a child process (``tests.isolation``): a crash or a hang fails the case, not the run.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.isolation import check, child  # noqa: F401 (child: the module's worker fixture)

SWEEP = settings(max_examples=8, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
DTYPES = ("float32", "bfloat16", "float16")
SPECIAL = (None, float("nan"), float("inf"), -float("inf"))


def _tensor(shape, dtype, seed, noncontig=False, scale=1.0):
    """A seeded random tensor; ``noncontig``: the same values through a transposed (non-contiguous) view."""
    import torch
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, generator=g) * scale).to(getattr(torch, dtype))
    return t.t().contiguous().t() if noncontig and t.ndim == 2 else t


# ---------------------------------------------------------------------------------------------- gating
def gating_case(t, e, dtype, noncontig, special, where, layout, bias_kind, seed):
    import torch
    from kernels import gating_select_reference, moe_gating_top_k
    x = _tensor((t, e), dtype, seed, noncontig, 2.0)
    bias = None if bias_kind is None else _tensor((e,), "float32", seed + 1, scale=0.1)
    if special is not None:
        (x if where == "x" else bias)[..., 0] = special
    res = moe_gating_top_k(x, bias=bias, out_flag=True, cores=2, trace=False, **layout)
    kw = {k: v for k, v in layout.items() if k != "k"}
    kw["k_group"] = kw.get("k_group", 1) if kw.get("group_count", 1) > 1 else 1
    w, idx = gating_select_reference(res.out, layout["k"], bias=bias, **kw)
    assert torch.equal(res.expert_idx, idx)
    assert torch.allclose(res.y.float(), w.to(x.dtype).float(), rtol=2 ** -7 if dtype != "float32" else 2 ** -20,
                          atol=0)


@SWEEP
@given(t=st.integers(1, 20), e=st.sampled_from([16, 32, 48]), dtype=st.sampled_from(DTYPES), noncontig=st.booleans(),
       special=st.sampled_from(SPECIAL), where=st.sampled_from(["x", "bias"]),
       layout=st.sampled_from([dict(k=4), dict(k=4, k_group=2, group_count=4, group_select_mode=1),
                               dict(k=3, k_group=1, group_count=4), dict(k=40), dict(k=2.5),
                               dict(k=2, k_group=3, group_count=2)]),
       bias_kind=st.sampled_from([None, "bias"]), seed=st.integers(0, 2 ** 16))
def test_gating(child, t, e, dtype, noncontig, special, where, layout, bias_kind, seed):
    names = []
    cap = e // layout.get("group_count", 1) * layout.get("k_group", 1)
    if not isinstance(layout["k"], int) or not 1 <= layout["k"] <= cap:
        names.append("k=")
    if layout.get("k_group", 1) > layout.get("group_count", 1):
        names.append("k_group")
    if where == "bias" and bias_kind is None:
        special = None
    if special is not None and special != special:
        names.append(where)                                   # NaN logits or biases have no order
    check(child, gating_case, t, e, dtype, noncontig, special, where, layout, bias_kind, seed, names=tuple(names))


# ---------------------------------------------------------------------------------------------- dynamic quant
def dynamic_quant_case(t, h, dtype, noncontig, special, smooth_kind, seed):
    import torch
    from kernels import dynamic_quant, dynamic_quant_reference
    x = _tensor((t, h), dtype, seed, noncontig, 3.0)
    if special is not None and t:
        x[t // 2, h // 3] = special
    smooth = None
    if smooth_kind == "ok":
        smooth = (torch.rand(h, generator=torch.Generator().manual_seed(seed)) + 0.5).to(x.dtype)
    elif smooth_kind == "wrong_shape":
        smooth = torch.ones(h + 16, dtype=x.dtype)
    y, scale = dynamic_quant(x, smooth_scales=smooth, cores=3, trace=False)
    ry, rs = dynamic_quant_reference(x, smooth_scales=smooth)
    assert torch.equal(y, ry) and torch.equal(scale.view(torch.int32), rs.view(torch.int32))


@SWEEP
@given(t=st.integers(0, 20), h=st.sampled_from([32, 64, 48, 96]), dtype=st.sampled_from(DTYPES),
       noncontig=st.booleans(), special=st.sampled_from(SPECIAL),
       smooth_kind=st.sampled_from([None, "ok", "wrong_shape"]), seed=st.integers(0, 2 ** 16))
def test_dynamic_quant(child, t, h, dtype, noncontig, special, smooth_kind, seed):
    names = []
    if smooth_kind == "wrong_shape":
        names.append("smooth_scales")
    if special is not None and t:
        names.append("x")                                     # a non-finite row has no INT8 scale
    check(child, dynamic_quant_case, t, h, dtype, noncontig, special, smooth_kind, seed, names=tuple(names))


# ---------------------------------------------------------------------------------------------- grouped GEMM
def grouped_matmul_case(m, k, n, e, group_list, glt, out_dtype, swiglu, scales, noncontig, special, seed):
    import torch
    from kernels import grouped_matmul, grouped_matmul_reference
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    if noncontig:
        x = x.t().contiguous().t()
    w = torch.randint(-128, 128, (e, k, n), generator=g, dtype=torch.int8)
    kw = {}
    if scales:
        kw["scale"] = torch.rand(e, n, generator=g) * 0.01 + 1e-3
        kw["per_token_scale"] = torch.rand(m, generator=g) * 0.01 + 1e-3
        if special is not None and m:
            kw["per_token_scale"][0] = special
    od = None if out_dtype is None else getattr(torch, out_dtype)
    res = grouped_matmul(x, w, group_list=group_list, group_list_type=glt, output_dtype=od, swiglu=swiglu, cores=2,
                         trace=False, **kw)
    ref, _ = grouped_matmul_reference(x, w, group_list=torch.as_tensor(group_list), group_list_type=glt,
                                      output_dtype=od, swiglu=swiglu, **kw)
    got, want = res.y.float(), ref.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    if swiglu:                                                # silu's exp: within one ulp of the output dtype
        tol = 2.0 ** -7 if res.y.dtype == torch.bfloat16 else 2.0 ** -20
        ok = ((got - want).abs() <= tol * want.abs() + 1e-6 * want.abs().nan_to_num(0, 0, 0).max()) | \
            (got == want) | torch.isnan(want)
        assert ok.all()
    else:
        assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5))


@SWEEP
@given(m=st.integers(0, 40), k=st.sampled_from([32, 64]), n=st.sampled_from([32, 64, 96]), e=st.integers(1, 3),
       gl_kind=st.sampled_from(["cumulative", "counts", "negative", "decreasing", "float", "too_many_rows",
                                "wrong_length"]),
       out_dtype=st.sampled_from([None, "bfloat16", "float32", "int32"]), swiglu=st.booleans(), scales=st.booleans(),
       noncontig=st.booleans(), special=st.sampled_from(SPECIAL), seed=st.integers(0, 2 ** 16))
def test_grouped_matmul(child, m, k, n, e, gl_kind, out_dtype, swiglu, scales, noncontig, special, seed):
    rng = np.random.default_rng(seed)
    ends = sorted(rng.integers(0, m + 1, e).tolist())
    counts = np.diff([0] + ends).tolist()
    names = []
    gl, glt = ends, 0
    if gl_kind == "counts":
        gl, glt = counts, 1
    elif gl_kind == "negative":
        gl, glt = [-1] + counts[1:], 1
    elif gl_kind == "decreasing" and e > 1 and ends[-1] > ends[0]:
        gl = ends[::-1]
    elif gl_kind == "float":
        gl = [v + 0.5 for v in ends]
    elif gl_kind == "too_many_rows":
        gl = ends[:-1] + [m + 1]
    elif gl_kind == "wrong_length":
        gl = ends + [m]
    if gl is not ends or gl_kind in ("too_many_rows",):
        names.append("group_list")
    if gl_kind == "counts":
        names.remove("group_list")
    if swiglu and (n // 2) % 32:
        names.append("swiglu")
    if out_dtype == "int32" and (scales or swiglu):
        names.append("output_dtype")
    check(child, grouped_matmul_case, m, k, n, e, gl, glt, out_dtype, swiglu, scales, noncontig, special, seed,
          names=tuple(names))


# ---------------------------------------------------------------------------------------------- decode attention
def attention_case(lens, s, bs, cache_mode, poison, bad_block, seed):
    import torch
    from kernels import attention_reference, mla_decode_attention
    from tests.kernels.test_attention import make_case, poison_unused_slots, to_nz_cache
    q, qr, kv, kr, bt = make_case(seed, lens, s, 2, 64, 16, bs)
    if poison is not None:
        kv, kr = poison_unused_slots(kv, bt, lens, poison), poison_unused_slots(kr, bt, lens, poison)
    if bad_block and bt.shape[1]:
        bt[0, 0] = kv.shape[0]
    kv_in, kr_in = (to_nz_cache(kv), to_nz_cache(kr)) if cache_mode == "PA_NZ" else (kv, kr)
    got = mla_decode_attention(q, qr, kv_in, kr_in, bt, lens, softmax_scale=0.1, cache_mode=cache_mode,
                               aic=2).attention_out.float()
    ref = attention_reference(q, qr, kv, kr, bt, lens, 0.1)
    assert (got - ref).abs().max().item() <= 2 ** -7 * kv[torch.isfinite(kv)].float().abs().max().item()


@SWEEP
@given(lens=st.lists(st.integers(1, 140), min_size=1, max_size=3), s=st.integers(1, 3), bs=st.sampled_from([16, 64]),
       cache_mode=st.sampled_from(["PA_BSND", "PA_NZ"]), poison=st.sampled_from(SPECIAL),
       too_long=st.booleans(), bad_block=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_decode_attention(child, lens, s, bs, cache_mode, poison, too_long, bad_block, seed):
    names = []
    lens = [max(L, s) for L in lens]
    if too_long:
        lens[0] = s - 1 if s > 1 else 0
        names.append("actual_seq_lengths_kv")
    if bad_block and not too_long:
        names.append("block_table")
    check(child, attention_case, lens, s, bs, cache_mode, poison, bad_block, seed, names=tuple(names))


# ---------------------------------------------------------------------------------------------- fused dispatch
def fused_dispatch_case(bs, ids, quant, special, seed):
    import torch
    from ascend_emu import Pod, cloudmatrix384
    from kernels import MoeGroup, dispatch_reference, moe_distribute_dispatch
    g = torch.Generator().manual_seed(seed)
    x = [(torch.randn(bs, 64, generator=g) * 2).to(torch.bfloat16) for _ in range(2)]
    if special is not None and bs:
        x[1][0, 3] = special
    group = MoeGroup(Pod(cloudmatrix384(dies=2), trace=False), [0, 1], max_bs=4, hidden=64, topk=2, num_experts=8,
                     quant=quant, cores=2)
    res = moe_distribute_dispatch(x, ids, group)
    ref = dispatch_reference([xi.float().numpy() for xi in x], ids, 8, 2, quant=quant)
    for d in range(2):
        rows, ident, counts = ref[d]
        n = len(rows)
        assert np.array_equal(res.expert_token_nums[d], counts)
        got = np.asarray(res.expand_x[d][:n], np.float32)
        if quant:
            got = got * np.asarray(res.dynamic_scales[d][:n], np.float32)[:, None]
            step = np.abs(rows).max(1, keepdims=True) / 127
            assert np.all(np.abs(got - rows) <= step / 2 * (1 + 1e-6) + 1e-30)
        else:
            assert np.array_equal(got, rows, equal_nan=True)


@SWEEP
@given(bs=st.integers(0, 4), bad=st.sampled_from([None, "out_of_range", "float", "too_many_tokens"]),
       quant=st.booleans(), special=st.sampled_from(SPECIAL), seed=st.integers(0, 2 ** 16))
def test_fused_dispatch(child, bs, bad, quant, special, seed):
    rng = np.random.default_rng(seed)
    ids = [np.array([rng.permutation(8)[:2] for _ in range(bs)], np.int64).reshape(bs, 2) for _ in range(2)]
    for a in ids:
        a[rng.random(a.shape) < 0.2] = -1
    names = []
    if bad == "out_of_range" and bs:
        ids[0][0, 0] = 8
        names.append("expert_ids")
    elif bad == "float" and bs:
        ids[1] = ids[1].astype(np.float64) + 0.5
        names.append("expert_ids")
    elif bad == "too_many_tokens":
        ids[1] = np.zeros((5, 2), np.int64)
        names.append("expert_ids")
    if quant and special is not None and bs:
        names.append("x")                                     # INT8 on the wire: a non-finite row has no scale
    check(child, fused_dispatch_case, bs, ids, quant, special, seed, names=tuple(names))
