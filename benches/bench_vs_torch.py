"""Emulator vs plain torch doing the same math (issue 19's table): CPU time of one numeric emulator call over CPU time
of the torch code computing the same outputs, both single-threaded, in one process.

Each row builds its inputs once, then runs the emulator and torch alternately (``--rounds`` times each) and keeps
the least CPU time (``time.process_time``: the other developers' jobs on a shared machine do not count) of each
side. Every emulator output is checked against torch's before its time counts. The emulator side is the whole host
call: a fresh pod, the inputs into GM, the run, the outputs back to the host.

Run:  python benches/bench_vs_torch.py [--rows gmm,prolog,...] [--rounds 3] [--json]
  or  python -m pytest benches/bench_vs_torch.py --benchmark-only    (ratios in each benchmark's extra_info)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run as a script from a source tree


@dataclass
class Row:
    """One row: ``emulator()`` and ``torch_math()`` return comparable outputs; ``check(emu, ref)`` raises if they
    differ beyond the row's stated tolerance."""
    name: str
    what: str
    emulator: Callable
    torch_math: Callable
    check: Callable


def _bf16_close(got, want, rel: float) -> None:
    """|got - want| <= rel * max|want| (bf16 outputs computed with the same formula but other elementwise
    libraries: exp differs by an ulp now and then, rounding to bf16 hides most of it)."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item()
    top = want.abs().max().item()
    if not err <= rel * top:
        raise AssertionError(f"max error {err} > {rel} x max |ref| {top}")


# ------------------------------------------------------------------------------------------------ the rows
def row_gmm(int_mm: bool = True) -> Row:
    """grouped_matmul int8, 8 experts, M 1024 (128 rows each) x K 7168 x N 4096, per-token x per-channel
    dequant, SwiGLU -> bf16 [1024, 2048]; torch: ``torch._int_mm`` per expert (``int_mm``; else ``quant.int8_gemm``,
    the same exact products by fp32 BLAS over K chunks, which a CPU without int8 dot-product instructions runs far
    faster), the same dequant and SwiGLU."""
    from kernels.grouped_matmul import grouped_matmul
    from quant import int8_gemm
    g = torch.Generator().manual_seed(0)
    e, m, k, n = 8, 1024, 7168, 4096
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (e, k, n), generator=g, dtype=torch.int8)
    scale = torch.rand(e, n, generator=g) * 1e-4
    pts = torch.rand(m, generator=g) * 1e-3
    ends = torch.arange(1, e + 1) * (m // e)
    product = torch._int_mm if int_mm else (lambda a, b: int8_gemm(a, b.t()))

    def emulator():
        return grouped_matmul(x, w, group_list=ends, scale=scale, per_token_scale=pts, swiglu=True,
                              trace=False).y

    def torch_math():
        out, start = [], 0
        for ge, end in enumerate(ends.tolist()):
            acc = product(x[start:end], w[ge])
            f = acc.float() * pts[start:end, None] * scale[ge]
            gate, up = f[:, :n // 2], f[:, n // 2:]
            out.append((gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16))
            start = end
        return torch.cat(out)
    name, what = ("gmm", "grouped_matmul int8 E8 1024x7168x4096 SwiGLU") if int_mm else \
        ("gmm_f32", "the same, torch by exact fp32 BLAS (quant.int8_gemm)")
    return Row(name, what, emulator, torch_math, lambda a, b: _bf16_close(a, b, 2 ** -7))


def _prolog_model():
    from kernels.mla import prolog_weights_from_deepseek
    from kernels.rope import rope_angles, rope_sin_cos
    t, he, hcq, hckv, n, d, dr = 96, 7168, 1536, 512, 128, 128, 64
    g = torch.Generator().manual_seed(1)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=g) * sc).bfloat16()
    wq_a, wq_b = r(hcq, he, sc=he ** -0.5), r(n * (d + dr), hcq, sc=hcq ** -0.5)
    wkv_a, wkv_b = r(hckv + dr, he, sc=he ** -0.5), r(n * 2 * d, hckv, sc=hckv ** -0.5)
    m = {"x": r(t, he), "q_norm": (1 + 0.1 * torch.randn(hcq, generator=g)).bfloat16(),
         "kv_norm": (1 + 0.1 * torch.randn(hckv, generator=g)).bfloat16()}
    m["sin"], m["cos"] = rope_sin_cos(rope_angles(torch.arange(t) * 7 + 3, dr))
    m.update(prolog_weights_from_deepseek(wq_a, wq_b, wkv_a, wkv_b, n, d, dr))
    return m, (t, hckv, dr)


def row_prolog() -> Row:
    """mla_prolog (npu_mla_prolog_v3), 96 tokens, DeepSeek-V3 dims (He 7168, Hcq 1536, Hckv 512, N 128, D 128,
    Dr 64), bf16 weights, PA_BSND cache; torch: ``mla_prolog_reference`` (the same algorithm in fp32 torch)."""
    from kernels.mla import mla_prolog, mla_prolog_reference
    m, (t, hckv, dr) = _prolog_model()
    blocks, bs = 2, 128
    args = (m["x"], m["weight_dq"], m["weight_uq_qr"], m["weight_uk"], m["weight_dkv_kr"], m["q_norm"],
            m["kv_norm"], m["sin"], m["cos"])

    def emulator():
        kv = torch.zeros(blocks, bs, 1, hckv).bfloat16()
        kr = torch.zeros(blocks, bs, 1, dr).bfloat16()
        res = mla_prolog(*args, kv, kr, cache_index=torch.arange(t), rmsnorm_epsilon_cq=1e-6,
                         rmsnorm_epsilon_ckv=1e-6)
        return res.query, res.query_rope

    def torch_math():
        ref = mla_prolog_reference(*args, rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6)
        return ref["query"], ref["query_rope"]

    def check(got, want):
        for a, b in zip(got, want):
            _bf16_close(a, b, 2 ** -6)
    return Row("prolog", "mla_prolog 96 tokens, V3 dims, bf16", emulator, torch_math, check)


def row_attention() -> Row:
    """MLA decode attention, batch 16 x 4096 kv tokens, 128 heads, Hckv 512, Dr 64, bf16 PA_BSND cache in pages
    of 128; torch: ``attention_reference`` (fp32 softmax over the gathered pages)."""
    from kernels.attention import attention_reference, mla_decode_attention
    g = torch.Generator().manual_seed(2)
    batch, s, n, hckv, dr, bs, seq = 16, 1, 128, 512, 64, 128, 4096
    lens = [seq] * batch
    pages = seq // bs
    bt = torch.randperm(batch * pages, generator=g).reshape(batch, pages).int()
    q = torch.randn(batch, s, n, hckv, generator=g).bfloat16()
    qr = torch.randn(batch, s, n, dr, generator=g).bfloat16()
    kv = torch.randn(batch * pages, bs, 1, hckv, generator=g).bfloat16()
    kr = torch.randn(batch * pages, bs, 1, dr, generator=g).bfloat16()
    scale = 0.135234

    def emulator():
        return mla_decode_attention(q, qr, kv, kr, bt, lens, softmax_scale=scale).attention_out

    def torch_math():
        return attention_reference(q, qr, kv, kr, bt, lens, scale)
    vmax = kv.float().abs().max().item()

    def check(got, want):
        err = (got.float() - want.float()).abs().max().item()
        if not err <= 2 ** -7 * vmax:          # tests/kernels/test_attention.py's bound
            raise AssertionError(f"attention max error {err} > 2^-7 x {vmax}")
    return Row("attention", "decode attention B16 x 4K, N128, bf16", emulator, torch_math, check)


def row_dispatch_combine() -> Row:
    """FusedDispatch (INT8) + FusedCombine (bf16), EP16, 96 tokens per rank, hidden 7168, top-8 of 256 experts.
    Both sides compute every output the emulator gives and the check compares them bitwise: dispatch's per-rank
    expand_x (INT8, expert-major then source rank then (token, k) order), dynamic_scales, source identities and
    per-expert counts; combine's weighted sums (fp32 in k order, bf16). torch: the same math written plainly, rank
    by rank: quantise, one stable sort of the (token, k) pairs by expert, gathers. The experts between the two (the
    identity on the dequantised rows, bf16) are neither side's work: their outputs are made once, outside the
    timing, and both combines take them."""
    from kernels.fused_moe import MoeGroup, moe_distribute_combine, moe_distribute_dispatch
    from ascend_emu import Pod, cloudmatrix384
    ep, bs, h, k, e = 16, 96, 7168, 8, 256
    epr = e // ep
    rng = np.random.default_rng(3)
    ids = [np.argsort(rng.random((bs, e)), axis=1)[:, :k] for _ in range(ep)]
    x = [torch.randn(bs, h, generator=torch.Generator().manual_seed(10 + r)).bfloat16() for r in range(ep)]
    w = [rng.random((bs, k)).astype(np.float32) for _ in range(ep)]
    ids_t, w_t = torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(w))

    def torch_dispatch():
        q, scale = [], []
        for r in range(ep):                                               # each source rank: per-token INT8
            xf = x[r].float()
            s = xf.abs().amax(-1) / 127
            q.append(torch.round(xf / torch.where(s == 0, torch.ones_like(s), s)[:, None]).clamp(-128, 127)
                     .to(torch.int8))
            scale.append(s)
        q, scale = torch.cat(q), torch.cat(scale)                         # [ranks x tokens, H]
        expert = ids_t.reshape(-1)                                        # pairs in (source, token, k) order
        order = torch.sort(expert, stable=True).indices                   # expert-major, then source, token, k
        per_expert = torch.bincount(expert, minlength=e)
        cut = [0] + torch.cumsum(per_expert.reshape(ep, epr).sum(1), 0).tolist()
        disp = []
        for d in range(ep):                                               # each destination rank's outputs
            pair = order[cut[d]:cut[d + 1]]
            row = pair // k                                               # source * tokens + token
            disp.append((q[row], scale[row], torch.stack([row // bs, row % bs, pair % k], 1).int(),
                         per_expert[d * epr:(d + 1) * epr]))
        return disp, order

    ref_disp, ref_order = torch_dispatch()
    # the experts' outputs, per destination rank, in its received-row order (not timed)
    y = [(a.float() * s[:, None]).bfloat16() for a, s, _, _ in ref_disp]

    def emulator():
        grp = MoeGroup(Pod(cloudmatrix384(dies=ep), trace=False), range(ep), max_bs=bs, hidden=h, topk=k,
                       num_experts=e)
        d = moe_distribute_dispatch(x, ids, grp)
        out, _ = moe_distribute_combine(y, d, w, grp)
        return [(d.expand_x[r], d.dynamic_scales[r], d.assist_info_for_combine[r], d.expert_token_nums[r])
                for r in range(ep)], out

    def torch_math():
        disp, order = torch_dispatch()
        pos = torch.empty_like(order)
        pos[order] = torch.arange(len(order))                             # each pair's received row
        rows = torch.cat(y)
        out = []
        for r in range(ep):                                               # each source rank's combine
            back = rows[pos[r * bs * k:(r + 1) * bs * k]].reshape(bs, k, h)
            acc = torch.zeros(bs, h)
            for j in range(k):                                            # fp32, in k order, as combine sums
                acc += back[:, j].float() * w_t[r, :, j, None]
            out.append(acc.bfloat16())
        return disp, out

    def check(got, want):
        for r, (a, b) in enumerate(zip(got[0], want[0])):
            for name, u, v in zip(("expand_x", "dynamic_scales", "assist_info", "expert_token_nums"), a, b):
                if not np.array_equal(np.asarray(u), v.numpy()):
                    raise AssertionError(f"dispatch {name}[{r}] differs from torch's")
        for r, (a, b) in enumerate(zip(got[1], want[1])):          # the same fp32 steps: bitwise
            if not np.array_equal(np.asarray(a).view(np.int16), b.view(torch.int16).numpy()):
                raise AssertionError(f"combine output[{r}] differs from torch's")
    return Row("moe", "fused dispatch + combine EP16, 96 tok/rank, H 7168", emulator, torch_math, check)


def _row_send_recv(mib: int) -> Row:
    """XCCL send/recv of ``mib`` MiB from die 0 to die 16 (the other server) on 8 lanes, mtu path (UB
    ping-pong through the managed ring), between host buffers aliased as GM (``to_gm(copy=False)``); torch: one
    copy of the same bytes."""
    from ascend_emu import Pod, cloudmatrix384
    from xccl import Communicator
    nbytes = mib << 20
    src = np.random.default_rng(4).integers(0, 256, nbytes, dtype=np.uint8)
    src_t = torch.from_numpy(src)

    def emulator():
        pod = Pod(cloudmatrix384(dies=17), trace=False)
        comm = Communicator(pod, [0, 16], lanes=8)
        a = pod.to_gm(0, src, copy=False)                  # the host buffers themselves (no copy in or out)
        got = np.zeros(nbytes, np.uint8)
        out = pod.to_gm(16, got, copy=False)
        comm.send(a, dst_die=16, event_id=1, cores=8, path="mtu")
        comm.recv(out, src_die=0, event_id=1, cores=8).wait()
        return got

    def torch_math():
        return torch.empty_like(src_t).copy_(src_t)

    def check(got, want):
        if not np.array_equal(got, want.numpy()):
            raise AssertionError("send/recv delivered other bytes")
    return Row(f"p2p{mib}", f"send/recv {mib} MiB, mtu path, 8 lanes", emulator, torch_math, check)


def row_p2p16() -> Row:
    return _row_send_recv(16)


def row_p2p64() -> Row:
    return _row_send_recv(64)


def row_quant() -> Row:
    """dynamic_quant (npu_dynamic_quant) of 1024 x 7168 bf16 on 48 AIVs; torch: ``dynamic_quant_reference``."""
    from kernels.dynamic_quant import dynamic_quant, dynamic_quant_reference
    x = (torch.randn(1024, 7168, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()

    def emulator():
        res = dynamic_quant(x, trace=False)
        return res.y, res.scale

    def check(got, want):
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise AssertionError("dynamic_quant differs from the reference (bitwise)")
    return Row("quant", "dynamic_quant 1024 x 7168 bf16", emulator, lambda: dynamic_quant_reference(x), check)


ROWS = {"gmm": row_gmm, "gmm_f32": lambda: row_gmm(int_mm=False), "prolog": row_prolog, "attention": row_attention, "moe": row_dispatch_combine,
        "p2p16": row_p2p16, "p2p64": row_p2p64, "quant": row_quant}


# ------------------------------------------------------------------------------------------------ measuring
def _cpu(fn) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def measure(row: Row, rounds: int = 3) -> dict:
    """Alternate emulator and torch ``rounds`` times each (after one unmeasured warm-up of each: numba caches,
    first-touch pages); return the least CPU seconds of each side and their ratio."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # the emulator runs its tile math on one thread; so does torch here
    try:
        row.check(row.emulator(), row.torch_math())
        emu, ref = [], []
        for _ in range(rounds):
            t, got = _cpu(row.emulator)
            emu.append(t)
            t, want = _cpu(row.torch_math)
            ref.append(t)
            row.check(got, want)
    finally:
        torch.set_num_threads(threads)
    e, r = min(emu), min(ref)
    return {"row": row.name, "what": row.what, "emulator_s": e, "torch_s": r, "ratio": e / r}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs of each side per row")
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    args = ap.parse_args(argv)
    for name in args.rows.split(","):
        res = measure(ROWS[name](), args.rounds)
        if args.json:
            print(json.dumps(res), flush=True)
        else:
            print(f"{res['what']:<52} emulator {res['emulator_s']:8.3f} s  torch {res['torch_s']:8.3f} s  "
                  f"ratio {res['ratio']:6.2f}x", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ pytest-benchmark
def _bench(benchmark, name):
    res = benchmark.pedantic(lambda: measure(ROWS[name](), 2), rounds=1, iterations=1)
    benchmark.extra_info.update(res)


def test_vs_torch_grouped_matmul(benchmark):
    _bench(benchmark, "gmm")


def test_vs_torch_grouped_matmul_fp32_blas(benchmark):
    _bench(benchmark, "gmm_f32")


def test_vs_torch_mla_prolog(benchmark):
    _bench(benchmark, "prolog")


def test_vs_torch_decode_attention(benchmark):
    _bench(benchmark, "attention")


def test_vs_torch_dispatch_combine(benchmark):
    _bench(benchmark, "moe")


def test_vs_torch_send_recv_16mib(benchmark):
    _bench(benchmark, "p2p16")


def test_vs_torch_send_recv_64mib(benchmark):
    _bench(benchmark, "p2p64")


def test_vs_torch_dynamic_quant(benchmark):
    _bench(benchmark, "quant")


if __name__ == "__main__":
    sys.exit(main())
