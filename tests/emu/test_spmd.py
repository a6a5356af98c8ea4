"""ascend_emu.spmd: per-rank functions as cooperative tasks; collectives meet, run once, resume every rank."""
import pytest

import ascend_emu
from ascend_emu import ArgumentError, DeadlockError, Pod, cloudmatrix384
from ascend_emu.spmd import Collective, current, in_spmd

LOG = []


def _gather(arrivals):
    LOG.append(("run", [ctx.rank for ctx, _ in arrivals]))
    values = [p for _, p in arrivals]
    return [(values, ctx.die) for ctx, _ in arrivals]


GATHER = Collective("gather", _gather)


def pod(n=4):
    return Pod(cloudmatrix384(dies=n), trace=False)


def test_ranks_meet_at_each_collective_and_resume_in_group_rank_order():
    LOG.clear()

    def script(rank):
        LOG.append(("before", rank))
        ctx = current()
        assert in_spmd() and (ctx.rank, ctx.world_size) == (rank, 3)
        # group ranks are not the spmd ranks here: group rank = 2 - rank
        values, die = GATHER(rank * 10, group="g", group_rank=2 - rank, group_size=3)
        LOG.append(("after", rank))
        again, _ = GATHER(values[0] + rank, group="g", group_rank=2 - rank, group_size=3)
        return values, die, again

    out = ascend_emu.spmd(script, pod(), 3, dies=[2, 0, 3])
    assert [o[0] for o in out] == [[20, 10, 0]] * 3 and [o[1] for o in out] == [2, 0, 3]
    assert [o[2] for o in out] == [[22, 21, 20]] * 3
    # every rank runs up to the collective first, the step runs once, ranks resume in group-rank order (2, 1, 0)
    assert LOG[:4] == [("before", 0), ("before", 1), ("before", 2), ("run", [2, 1, 0])]
    assert LOG[4:7] == [("after", 2), ("after", 1), ("after", 0)]
    assert not in_spmd()


def test_deterministic():
    def script(rank):
        return GATHER(rank, group="g", group_rank=rank, group_size=4)
    assert ascend_emu.spmd(script, pod(), 4) == ascend_emu.spmd(script, pod(), 4)


def test_deadlock_names_the_waiting_ranks_and_the_missing_ones():
    def script(rank):
        if rank == 1:
            return "left early"
        return GATHER(rank, group="g", group_rank=rank, group_size=3)

    with pytest.raises(DeadlockError, match=r"ranks \[1\] have returned") as e:
        ascend_emu.spmd(script, pod(), 3)
    assert e.value.blocked == ["spmd rank 0 waits in gather (step 0 of group 'g') for group ranks [1]",
                               "spmd rank 2 waits in gather (step 0 of group 'g') for group ranks [1]"]


def test_misuse_is_a_clear_error():
    other = Collective("other", _gather)
    with pytest.raises(ArgumentError, match="runs across ranks"):
        GATHER(1, group="g", group_rank=0, group_size=1)
    with pytest.raises(ArgumentError, match="reached other .* as step 0 of group 'g', where ranks \\[0\\] reached "
                                            "gather"):
        ascend_emu.spmd(lambda r: (other if r else GATHER)(r, group="g", group_rank=r, group_size=2), pod(), 2)
    with pytest.raises(ArgumentError, match="spmd ranks 0 and 1 both claim group_rank=0"):
        ascend_emu.spmd(lambda r: GATHER(r, group="g", group_rank=0, group_size=2), pod(), 2)
    with pytest.raises(ArgumentError, match="group_size=3 must be an int in 1..2"):
        ascend_emu.spmd(lambda r: GATHER(r, group="g", group_rank=r, group_size=3), pod(), 2)
    with pytest.raises(ArgumentError, match="each rank needs its own die"):
        ascend_emu.spmd(lambda r: r, pod(), 2, dies=[1, 1])
    with pytest.raises(ascend_emu.AddressError, match="die 9 out of range"):
        ascend_emu.spmd(lambda r: r, pod(), 2, dies=[0, 9])
    with pytest.raises(ArgumentError, match="world_size=0"):
        ascend_emu.spmd(lambda r: r, pod(), 0)


def test_an_exception_in_a_rank_propagates_with_the_rank_and_leaves_no_task_behind():
    def script(rank):
        if rank == 2:
            raise ValueError("bad input on this rank")
        return GATHER(rank, group="g", group_rank=rank, group_size=3)

    with pytest.raises(ValueError, match="bad input") as e:
        ascend_emu.spmd(script, pod(), 3)
    assert "(raised in spmd rank 2 of 3, die 2)" in e.value.__notes__
    assert not in_spmd()
    assert ascend_emu.spmd(lambda r: r * 2, pod(), 3) == [0, 2, 4]     # the next run starts clean
