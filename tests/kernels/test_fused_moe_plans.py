"""The fused dispatch's host and per-die plans (issue 19: built once, vectorised) against plain loops."""
import numpy as np
from hypothesis import given, settings, strategies as st

from kernels.fused_moe import _assemble_jobs, _plan_dispatch, _received_identity


class _Group:
    def __init__(self, size, epr):
        self.size, self.epr = size, epr


def _identity_loops(plans, d, epr):
    rows = []
    for le in range(epr):
        for p in plans:
            pairs = [(int(p.slot[t, k]), t, k) for t, k in np.argwhere((p.dest == d) & (p.slot >= 0))
                     if int(p.ids[t, k]) % epr == le]
            rows.extend((p.rank, t, k) for _, t, k in sorted(pairs))
    return np.array(rows, np.int32).reshape(-1, 3)


def _routing(rng, e, k, bs):
    """[bs, min(k, e)] distinct expert ids per token out of ``e``, about a fifth masked (-1)."""
    k = min(k, e)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(bs)]) if bs else np.zeros((0, k), np.int64)
    ids[rng.random(ids.shape) < 0.2] = -1
    return ids


def _slots_loops(ids, ranks, epr):
    """The dispatch plan's slots and counts by the (token, k) loop it replaces."""
    counts = np.zeros((ranks, epr), np.int64)
    for e in ids[ids >= 0]:
        counts[e // epr, e % epr] += 1
    offset = np.cumsum(counts, axis=1) - counts
    seen = np.zeros_like(counts)
    slot = np.full(ids.shape, -1, np.int64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                d, e = divmod(int(ids[t, k]), epr)
                slot[t, k] = offset[d, e] + seen[d, e]
                seen[d, e] += 1
    return slot, counts


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 6), epr=st.integers(1, 4), k=st.integers(1, 4), bs=st.integers(0, 12),
       seed=st.integers(0, 2 ** 16))
def test_dispatch_plan_slots_match_the_token_loop(ranks, epr, k, bs, seed):
    ids = _routing(np.random.default_rng(seed), ranks * epr, k, bs)
    plan = _plan_dispatch(_Group(ranks, epr), 0, ids)
    slot, counts = _slots_loops(ids, ranks, epr)
    assert np.array_equal(plan.slot, slot) and np.array_equal(plan.counts, counts)
    assert np.array_equal(plan.dest, np.where(ids >= 0, ids // epr, -1))


def _jobs_loops(seen, rows_per_tile):
    counts, jobs = seen.T, []
    starts = np.cumsum(counts.reshape(-1)) - counts.reshape(-1)
    for idx in range(counts.size):
        le, s = divmod(idx, seen.shape[0])
        n = int(counts[le, s])
        src_off = int(np.sum(seen[s, :le])) if le else 0
        for r0 in range(0, n, rows_per_tile):
            jobs.append((s, src_off + r0, int(starts[idx]) + r0, min(rows_per_tile, n - r0)))
    return jobs


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 5), epr=st.integers(1, 3), k=st.integers(1, 4), bs=st.integers(0, 8),
       seed=st.integers(0, 2 ** 16))
def test_received_identity_is_expert_major_then_source_then_slot(ranks, epr, k, bs, seed):
    rng = np.random.default_rng(seed)
    g = _Group(ranks, epr)
    plans = [_plan_dispatch(g, r, _routing(rng, ranks * epr, k, bs)) for r in range(ranks)]
    for d in range(ranks):
        got = _received_identity(plans, d, epr)
        assert got.dtype == np.int32 and np.array_equal(got, _identity_loops(plans, d, epr))


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 6), epr=st.integers(1, 4), rows_per_tile=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_assemble_jobs_match_the_per_core_loops_and_are_built_once(ranks, epr, rows_per_tile, seed):
    seen = np.random.default_rng(seed).integers(0, 9, (ranks, epr)).astype(np.int32)

    class Out:
        jobs = {}
    out = Out()
    jobs = _assemble_jobs(out, seen, rows_per_tile)
    assert jobs == _jobs_loops(seen, rows_per_tile)
    assert _assemble_jobs(out, seen.copy(), rows_per_tile) is jobs           # the die's other cores reuse it


def _deal_loops(ids, n, cores, rank, block_idx):
    if n == 1:
        return list(range(block_idx, len(ids), cores))
    per = cores // n if n < cores else 1
    dealt, mine = [0] * n, []
    for i in range(len(ids)):
        s = int(ids[i][0]) % n
        owner = s % cores if per == 1 else s + n * (dealt[s] % per)
        dealt[s] += 1
        if owner == block_idx:
            mine.append(i)
    return sorted(mine, key=lambda i: ((int(ids[i][0]) - rank) % n, i))


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 70), cores=st.sampled_from([1, 5, 48]), rows=st.integers(1, 120),
       seed=st.integers(0, 2 ** 16))
def test_combine_dealing_matches_the_per_core_loops_and_is_built_once(ranks, cores, rows, seed):
    from kernels.fused_moe import _deal_rows
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, ranks, rows), rng.integers(0, 8, rows), rng.integers(0, 4, rows)], 1)
    ids = ids.astype(np.int32)
    g = _Group(ranks, 1)
    g._deals = {}
    rank = int(rng.integers(0, ranks))
    deal = _deal_rows(g, 3, ids, rank, cores)
    assert [deal[c] for c in range(cores)] == [_deal_loops(ids, ranks, cores, rank, c) for c in range(cores)]
    assert _deal_rows(g, 3, ids.copy(), rank, cores) is deal
