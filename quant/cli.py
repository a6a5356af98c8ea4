"""``ascend-emu quantize``: quantise a model, print per-layer relative output errors and fp32-vs-quantised
perplexity, next-token KL divergence and top-1 agreement on held-out text.

    ascend-emu quantize --model smollm2 --scheme w8a8 [--no-gptq] [--no-smooth] [--alpha A] [--clip] [--json]
    ascend-emu quantize --model toy --json                  # the seeded toy model on random ids (no download)

smollm2 calibrates on quant/data/calib.txt and evaluates on the disjoint quant/data/eval.txt. Registered with the
``ascend-emu`` command through the ``ascend_emu.cli`` entry point (pyproject.toml); the rest of ``quant`` does not
import ``ascend_emu``.
"""
from __future__ import annotations

import copy
import json
import time

from ascend_emu.cli import OptionError, bounded, command, console, progress

from .errors import ModelNotAvailable

# quant.model.SCHEMES (a test keeps them equal): every ``ascend-emu`` command imports this module, so the torch-backed
# parts of ``quant`` load only when ``quantize`` runs
SCHEMES = ("w8a8", "w8a16")


def _args(p) -> None:
    p.add_argument("--model", default="smollm2", choices=("smollm2", "toy"), help="model to quantise")
    p.add_argument("--scheme", default="w8a8", choices=SCHEMES, help="w8a8 (default) or weight-only w8a16")
    p.add_argument("--no-gptq", action="store_true", help="round-to-nearest weights instead of GPTQ")
    p.add_argument("--no-smooth", action="store_true", help="no SmoothQuant")
    p.add_argument("--alpha", type=bounded(float, 0.0, 1.0), default=None,
                   help="fixed SmoothQuant alpha, 0..1 (default: search per layer)")
    p.add_argument("--clip", action="store_true", help="block-level clip search for the weight scales")
    p.add_argument("--no-act-order", action="store_true",
                   help="GPTQ in natural column order (default: activation order)")
    p.add_argument("--seq-len", type=bounded(int, 2), default=256, help="tokens per calibration/evaluation chunk")
    p.add_argument("--calib-tokens", type=bounded(int, 2), default=None, help="limit the calibration tokens")
    p.add_argument("--eval-tokens", type=bounded(int, 2), default=None, help="limit the evaluation tokens")


def evaluate(ref, calib, held, *, ref_logits=None, **kw) -> dict:
    """Quantise a deep copy of ``ref`` with ``quantize_model(**kw)`` on ``calib`` and score it on ``held``.
    Returns a JSON-able dict: fp32 / quantised perplexity, KL, top-1, per-layer errors, timings."""
    from .model import quantize_model
    from .smollm2 import compare
    model = copy.deepcopy(ref)
    rep = quantize_model(model, calib, **kw)
    t = time.perf_counter()
    c = compare(ref, model, held, ref_logits)
    layers = [{"name": lr.name, "shape": list(lr.shape), "alpha": lr.alpha, "smooth": lr.smooth,
               "method": lr.method, "weight_err": lr.weight_err, "rtn_weight_err": lr.rtn_weight_err,
               "w8a8_err": lr.w8a8_err, "damp_escalations": lr.damp_escalations} for lr in rep.layers]
    return {"scheme": rep.scheme, "gptq": rep.gptq, "fp32": {"ppl": c.ppl_ref},
            "quantized": {"ppl": c.ppl, "kl": c.kl, "top1": c.top1}, "ppl_change": c.ppl_change,
            "eval_tokens": c.tokens, "calib_tokens": rep.calib_tokens, "layers": layers,
            "seconds": dict(rep.seconds, evaluate=time.perf_counter() - t), "model": model, "report": rep}


def _data(args):
    """(reference model, calibration batches, held-out batches) of ``--model``."""
    if args.model == "toy":
        from .toy import ToyLM, random_batches
        ref = ToyLM(d=256, f=512, layers=4, seed=0)
        calib = random_batches(8, args.seq_len, seed=1)
        held = random_batches(4, args.seq_len, seed=2)
    else:
        from . import smollm2
        try:
            ref, tok = smollm2.load()
        except ModelNotAvailable as e:
            raise OptionError(f"--model smollm2: {e}", "--model") from None
        calib = smollm2.token_batches(tok, "calib", args.seq_len, args.calib_tokens)
        held = smollm2.token_batches(tok, "eval", args.seq_len, args.eval_tokens)
    return ref, calib, held


@command("quantize", "INT8 post-training quantisation (SmoothQuant + GPTQ): per-layer errors, KL, perplexity", _args)
def run(args) -> int:
    from .smollm2 import logits_of
    t0 = time.perf_counter()
    with progress(args, f"loading {args.model}") as bar:
        ref, calib, held = _data(args)
        t_load = time.perf_counter() - t0
        bar.update(total=2 * len(held) + len(calib), advance=0)
        ref_logits = [logits_of(ref, ids) for ids in bar.track(held, "fp32 reference logits")]

        def quantising(i, n, names):        # counts each input group as it starts
            bar.update(f"quantising {i + 1}/{n}: {', '.join(names)}", advance=1,
                       total=2 * len(held) + len(calib) + n if i == 0 else None)

        out = evaluate(ref, bar.track(calib, "calibrating"), bar.track(held, "evaluating"), ref_logits=ref_logits,
                       scheme=args.scheme, gptq=not args.no_gptq, smooth=not args.no_smooth, smooth_alpha=args.alpha,
                       clip=args.clip, act_order=not args.no_act_order, progress=quantising)
    out.pop("model")
    out.pop("report")
    out = {"model": args.model, "smooth": not args.no_smooth, "alpha": args.alpha, **out}
    out["seconds"]["load"] = t_load
    out["seconds"]["wall"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    from rich.table import Table
    tab = Table(title=f"{args.model} {args.scheme}: relative output error per layer (calibration data)")
    for col in ("layer", "alpha", "smooth", "method", "weight err", "RTN weight err", "W8A8 err"):
        tab.add_column(col, justify="left" if col in ("layer", "smooth") else "right")
    fmt = lambda v: "-" if v is None else f"{v:.5f}"
    for lr in out["layers"]:
        tab.add_row(lr["name"], "-" if lr["alpha"] is None else f"{lr['alpha']:g}", lr["smooth"], lr["method"],
                    fmt(lr["weight_err"]), fmt(lr["rtn_weight_err"]), fmt(lr["w8a8_err"]))
    con = console()
    con.print(tab)
    q = out["quantized"]
    con.print(f"held-out {out['eval_tokens']} tokens: perplexity fp32 {out['fp32']['ppl']:.3f} -> {q['ppl']:.3f} "
              f"({out['ppl_change']:+.2%}), KL {q['kl']:.4f} nats/token, top-1 agreement {q['top1']:.4f}; "
              f"quantise {out['seconds']['total']:.1f} s")
    return 0
