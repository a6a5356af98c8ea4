"""Block-level clipping search and the INT8 KV cache for the non-RoPE latent."""
from __future__ import annotations

import pytest
import torch

import quant
from quant.errors import QuantError


def test_clip_search_never_worse_and_clips_heavy_tails():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=g)
    x[:, 0] *= 1e-3                                      # a nearly silent input channel ...
    h = 2.0 / 1024 * x.double().t() @ x.double()
    w = torch.randn(128, 64, generator=g) * 0.05
    w[:, 0] = 2.5                                        # ... whose huge weights set every row's max: clip them
    w[:64, 0] = 0.1                                      # rows 0-63: no outlier, nothing to gain
    scale, factors = quant.search_clip(w, h, block_rows=16)
    assert factors.shape == (8,) and scale.shape == (128,)
    base = quant.channel_scales(w)
    e_clip = quant.output_error(w, quant.dequantize_weight(quant.quantize_weight_rtn(w, scale), scale), h)
    e_none = quant.output_error(w, quant.dequantize_weight(quant.quantize_weight_rtn(w, base), base), h)
    assert e_clip <= e_none
    assert bool((factors[4:] < 1).all()) and bool((factors[:4] == 1).all()), factors
    assert all(any(abs(f - c) < 1e-6 for c in quant.search.DEFAULT_CLIPS) for f in factors.tolist())
    with pytest.raises(QuantError, match="block_rows=0"):
        quant.search_clip(w, h, block_rows=0)
    with pytest.raises(QuantError, match="clips="):
        quant.search_clip(w, h, clips=(1.2,))


def test_kv_per_token_and_per_channel():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 40, 64 + 16, generator=g)
    kv[..., 5] *= 30                                                             # an outlier latent channel
    tok, rope = quant.quantize_kv(kv, rope_dim=16, mode="token")
    assert tok.q.dtype == torch.int8 and tok.scale.shape == (2, 40) and rope.dtype == torch.bfloat16
    assert torch.equal(rope, kv[..., 64:].to(torch.bfloat16))
    lat = kv[..., :64]
    assert ((tok.dequantize() - lat).abs() <= tok.scale[..., None] / 2 + 1e-6).all()
    ch, _ = quant.quantize_kv(kv, rope_dim=16, mode="channel")
    assert ch.scale.shape == (64,)
    assert ((ch.dequantize() - lat).abs() <= ch.scale / 2 + 1e-6).all()
    # per-channel wins on the non-outlier channels; mla_prolog's convention: stored = rint(k * quant_scale_ckv)
    err = lambda r: (r.dequantize() - lat).abs()[..., 6:].mean()
    assert err(ch) < err(tok)
    qs = quant.channel_quant_scale(lat)
    assert torch.equal(ch.q, torch.round(lat * qs).clamp(-128, 127).to(torch.int8))
    hot = quant.quantize_latent(lat * 2, "channel", qs)                          # beyond the calibrated range
    assert int(hot.q.max()) == 127 and int(hot.q.min()) == -128
    with pytest.raises(QuantError, match="mode='tensor'"):
        quant.quantize_latent(lat, "tensor")
    with pytest.raises(QuantError, match="rope_dim=80"):
        quant.quantize_kv(kv, rope_dim=80)
