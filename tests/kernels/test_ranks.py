"""Host inputs of the kernels' host calls enter GM without a copy where the dtype and layout allow (issue 19), and
their checks take one pass."""
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384
from kernels.grouped_matmul import grouped_matmul


def _stores(pod: Pod) -> dict:
    return {s.name: s for a in pod.gm._arenas.values() for s in a._stores}


def test_grouped_matmul_weights_alias_the_host_tensor_and_converted_inputs_are_copied():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (2, 64, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(2, 128, generator=g, dtype=torch.float64)       # converted to fp32: a copy
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    res = grouped_matmul(x, w, group_list=torch.tensor([10, 32]), scale=scale, pod=pod, trace=False)
    stores = _stores(pod)
    assert np.shares_memory(stores["weight0"].data, w.numpy())
    assert np.shares_memory(stores["x0"].data, x.numpy())
    assert not np.shares_memory(stores["scale0"].data, scale.numpy())
    want = torch.cat([x[:10].int() @ w[0].int(), x[10:].int() @ w[1].int()]).double()
    want[:10] *= scale[0].float().double()
    want[10:] *= scale[1].float().double()
    assert torch.allclose(res.y.double(), want, rtol=2 ** -7)


def test_mla_prolog_weights_alias_the_host_tensors_and_the_caches_are_written_in_place():
    from kernels.mla import mla_prolog, mla_prolog_reference, prolog_weights_from_deepseek
    from kernels.rope import rope_angles, rope_sin_cos
    t, he, hcq, hckv, n, d, dr, bs = 4, 256, 128, 64, 2, 32, 16, 16
    g = torch.Generator().manual_seed(1)

    def r(*s):
        return (torch.randn(*s, generator=g) * 0.1).bfloat16()
    w = prolog_weights_from_deepseek(r(hcq, he), r(n * (d + dr), hcq), r(hckv + dr, he), r(n * 2 * d, hckv), n, d, dr)
    x, q_norm, kv_norm = r(t, he), 1 + r(hcq), 1 + r(hckv)
    sin, cos = rope_sin_cos(rope_angles(torch.arange(t), dr))
    kv, kr = torch.zeros(1, bs, 1, hckv).bfloat16(), torch.zeros(1, bs, 1, dr).bfloat16()
    args = (x, w["weight_dq"], w["weight_uq_qr"], w["weight_uk"], w["weight_dkv_kr"], q_norm, kv_norm, sin, cos)
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    res = mla_prolog(*args, kv, kr, cache_index=torch.arange(t), pod=pod)
    stores = _stores(pod)
    for name in ("weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr"):
        assert np.shares_memory(stores[name].data, w[name].view(torch.int16).numpy()), name
    assert np.shares_memory(stores["token_x"].data, x.view(torch.int16).numpy())
    assert not np.shares_memory(stores["kv_cache"].data, kv.view(torch.int16).numpy())    # copied back at the end
    ref = mla_prolog_reference(*args)
    assert (res.query.float() - ref["query"].float()).abs().max() <= 2 ** -6 * ref["query"].float().abs().max()
    kv_rows = kv[0, :t, 0].float()                              # the caller's cache, written in place
    assert (kv_rows - ref["kv"].float()).abs().max() <= 2 ** -6 * ref["kv"].float().abs().max()
    assert not kv[0, t:].any()


def test_decode_attention_reads_the_query_and_caches_through_aliases():
    from kernels.attention import attention_reference, mla_decode_attention
    g = torch.Generator().manual_seed(2)
    batch, n, hckv, dr, bs, lens = 2, 2, 64, 16, 16, [20, 7]
    bt = torch.arange(4).reshape(batch, 2).int()
    q, qr = torch.randn(batch, 1, n, hckv, generator=g).bfloat16(), torch.randn(batch, 1, n, dr, generator=g).bfloat16()
    kv, kr = torch.randn(4, bs, 1, hckv, generator=g).bfloat16(), torch.randn(4, bs, 1, dr, generator=g).bfloat16()
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    res = mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=0.1, pod=pod)
    stores = _stores(pod)
    for name, v in (("query", q), ("query_rope", qr), ("kv_cache", kv), ("kr_cache", kr)):
        assert np.shares_memory(stores[name].data, v.view(torch.int16).numpy()), name
    ref = attention_reference(q, qr, kv, kr, bt, lens, 0.1)
    assert (res.attention_out.float() - ref).abs().max() <= 2 ** -7 * kv.float().abs().max()


@settings(max_examples=60, deadline=None, database=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]),
       shape=st.sampled_from([(1,), (7,), (3, 5), (2, 3, 4)]),
       bad=st.lists(st.tuples(st.integers(0, 119), st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300])),
                    max_size=3), seed=st.integers(0, 2 ** 16))
def test_check_finite_raises_exactly_for_non_finite_values_at_the_first_one(dtype, shape, bad, seed):
    """The one-pass check (aminmax) raises when and where the elementwise one does: NaN or +-inf in the tensor's
    dtype, or a float64 value past fp32's range (the kernels compute in fp32)."""
    from kernels.ranks import check_finite
    from ascend_emu import ArgumentError
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 100
    flat = t.reshape(-1)
    for i, v in bad:
        flat[i % flat.numel()] = v
    t = t.to(dtype)                                   # 1e300 is inf in the narrower dtypes
    expect = ~torch.isfinite(t.float())
    if not expect.any():
        check_finite(t, "x", "why")
        return
    first = tuple(int(i) for i in expect.nonzero()[0])
    where = re.escape(str(first if len(first) != 1 else first[0]))
    with pytest.raises(ArgumentError, match=rf"x holds a non-finite value at {where}:"):
        check_finite(t, "x", "why")

