"""A core's pipe busy times (Core.busy, charged in place per instruction, issue 19) against the trace they must
agree with: each (die, unit, pipe)'s busy time is the sum of that unit's slices on that pipe; and Core.busy reads and
resets as a dict of ints."""
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.engine import Core

H = 256


@kernel(cores="aiv")
def _mixed(ctx, x_gm, y_gm, ops):
    """Per step: a load, ``ops[i]`` vector ops, a store; the tiles double-buffered."""
    t = ctx.ub.alloc((2, 8, H), "fp32")
    for i, n in enumerate(ops):
        s = i % 2
        yield ctx.copy_gm_to_ub(t[s], x_gm[ctx.block_idx])
        for _ in range(n):
            yield ctx.vec.muls(t[s], t[s], 0.5)
        yield ctx.vec.add(t[s], t[s], t[1 - s])
        yield ctx.copy_ub_to_gm(y_gm[ctx.block_idx], t[s])


@settings(max_examples=12, deadline=None)
@given(cores=st.integers(1, 6), ops=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_busy_times_are_the_sums_of_the_traced_slices(cores, ops):
    pod = Pod(cloudmatrix384(dies=1), trace=True)
    x = pod.alloc(0, (cores, 8, H), "fp32", phantom=True)
    y = pod.alloc(0, (cores, 8, H), "fp32", phantom=True)
    run = pod.launch(_mixed, aiv=cores, args=(x, y, tuple(ops)))
    sums: dict = {}
    for die, unit, track, _name, start, end, _args in run.trace.slices:
        if track in ("MTE2", "MTE3", "VECTOR"):
            sums[(die, unit, track)] = sums.get((die, unit, track), 0) + (end - start)
    assert set(run.pipe_busy) == set(sums)
    for key, ps in sums.items():
        assert abs(run.pipe_busy[key] - ps / 1e6) < 1e-9, key
    steps = len(ops)
    vec = sum(ops) + steps
    assert sum(1 for s in run.trace.slices if s[2] == "VECTOR") == cores * vec


def test_core_busy_reads_and_resets_as_a_dict_of_ints():
    class _Launch:
        traffic = None
    c = Core(0, "aiv", 3, _Launch())
    assert c.busy == {}
    c._charge("MTE2", 5)
    c._charge("VECTOR", 0)
    c._charge("MTE2", 7)
    assert c.busy == {"MTE2": 12, "VECTOR": 0} and list(c.busy) == ["MTE2", "VECTOR"]
    c.busy = {"MTE3": 4}
    c._charge("MTE3", 1)
    assert c.busy == {"MTE3": 5}
    c.busy = {}
    assert c.busy == {}
