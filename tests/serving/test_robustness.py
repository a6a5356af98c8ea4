"""Robustness sweep over serving's public entry points (the engine and the emulated runner, the KV block pool):
prompts with out-of-vocabulary, negative or non-integer ids, empty prompts, bad sampling and runner options.

The only allowed outcomes: the library's own error naming an argument the case made invalid, or a result equal to
the reference (the engine's tokens equal ``ReferenceModel.generate``'s; the pool's counts equal a plain model of
them). Each case runs in a child process (``tests.isolation``): a crash or a hang fails the case, not the run.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.isolation import check, child  # noqa: F401 (child: the module's worker fixture)

SWEEP = settings(max_examples=6, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- engine + runner
def engine_case(prompts, max_tokens, runner_kw, arrival):
    from serving import EmulatedRunner, Engine, MINI, ReferenceModel, SamplingParams, init_weights
    w = init_weights(MINI, seed=0)
    runner = EmulatedRunner(w, **runner_kw)
    res = Engine(runner, max_batch=2, token_budget=64).generate(prompts, SamplingParams(max_tokens=max_tokens),
                                                              arrival_us=[arrival] * len(prompts))
    ref = ReferenceModel(w)
    got = [r.output_tokens for r in sorted(res.requests, key=lambda r: r.rid)]
    assert got == [ref.generate(p, max_tokens) for p in prompts]


@SWEEP
@given(lens=st.lists(st.integers(1, 5), min_size=1, max_size=2),
       bad=st.sampled_from([None, "out_of_vocab", "negative", "float", "empty"]),
       max_tokens=st.sampled_from([1, 2, 0, 1.5]),
       runner=st.sampled_from(["ok", "groups2", "groups0", "groups1.5", "block_size32", "microbatches3",
                               "num_blocks0"]),
       arrival=st.sampled_from([0.0, 5.0, -1.0, float("nan")]), seed=st.integers(0, 2 ** 16))
def test_engine_generate(child, lens, bad, max_tokens, runner, arrival, seed):
    from serving import MINI
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, MINI.vocab_size, n)] for n in lens]
    names = []
    if bad == "out_of_vocab":
        prompts[0][0] = MINI.vocab_size
        names.append("vocabulary")
    elif bad == "negative":
        prompts[-1][-1] = -3
        names.append("prompt")
    elif bad == "float":
        prompts[0][0] = 2.5
        names.append("prompt")
    elif bad == "empty":
        prompts[0] = []
        names.append("prompt")
    if max_tokens not in (1, 2):
        names.append("max_tokens")
    kw = {"ok": {}, "groups2": {"groups": 2}, "groups0": {"groups": 0}, "groups1.5": {"groups": 1.5},
          "block_size32": {"block_size": 32}, "microbatches3": {"microbatches": 3},
          "num_blocks0": {"num_blocks": 0}}[runner]
    if runner not in ("ok", "groups2"):
        names.append(next(iter(kw)))
    if not 0 <= arrival < float("inf"):
        names.append("arrival_us")
    check(child, engine_case, prompts, max_tokens, kw, arrival, names=tuple(names))


# ---------------------------------------------------------------------------------------------- KV block pool
def pool_case(num_blocks, plan):
    """Run ``plan`` on a BlockPool, checking after each op that the counts equal a plain model's. Ops: ("allocate",
    n), ("free_held", None): free the oldest block still held, ("free", [ids])."""
    from serving import BlockPool
    pool = BlockPool(num_blocks, 16)
    held = []
    for op, arg in plan:
        if op == "allocate":
            got = pool.allocate(arg)
            assert len(set(got)) == len(got) == arg and not set(got) & set(held)
            held += got
        elif op == "free_held":
            pool.free([held.pop(0)])
        else:
            pool.free(arg)
        assert pool.num_free == num_blocks - len(held) and pool.num_used == len(held)


@SWEEP
@given(num_blocks=st.sampled_from([4, 8, 0, 2.5]),
       ops=st.lists(st.tuples(st.sampled_from(["allocate", "free_held", "free_bad_id"]), st.integers(-1, 9)),
                    max_size=6))
def test_block_pool(child, num_blocks, ops):
    """The parent walks the ops on a plain count model up to the first invalid one, which must raise naming it."""
    names, plan = [], []
    if not (isinstance(num_blocks, int) and num_blocks >= 1):
        names.append("num_blocks")
    else:
        free, held = num_blocks, 0
        for op, k in ops:
            if op == "allocate":
                plan.append((op, k))
                if k < 0 or k > free:
                    names.append("n=" if k < 0 else "blocks asked")
                    break
                free, held = free - k, held + k
            elif op == "free_held" and held:
                plan.append((op, None))
                free, held = free + 1, held - 1
            elif op == "free_bad_id":
                plan.append(("free", [num_blocks + max(k, 0)]))
                names.append("out of range")
                break
    check(child, pool_case, num_blocks, plan, names=tuple(names))
