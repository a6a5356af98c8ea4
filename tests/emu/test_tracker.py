"""The GM / tile dependency tracker (ascend_emu.tracker): its address lookup finds what a scan of every region finds."""
from hypothesis import given, settings, strategies as st

from ascend_emu.isa import OPS, Instr
from ascend_emu.tracker import Regions

WIDE = 1 << 16          # tracker.WIDE (a C constant of the compiled build: not importable there)

_SPECS = [OPS["copy_gm_to_ub"], OPS["copy_ub_to_gm"], OPS["gm_store"], OPS["muls"]]

_access = st.tuples(
    st.integers(0, 1 << 18),                                          # lo (bytes)
    st.sampled_from([4, 32, 512, 4096, 40000, WIDE, WIDE + 1, 3 * WIDE]),   # length: narrow, the limit, wide
    st.sampled_from([None, (64, 32), (1024, 512)]),                   # pattern: contiguous or evenly blocked
    st.booleans(),                                                    # write
    st.integers(0, 3),                                                # spec
    st.integers(-1, 5000),                                            # its end once issued (-1: not known yet)
)


@given(accesses=st.lists(_access, min_size=1, max_size=120), now_step=st.integers(0, 200))
@settings(max_examples=150, deadline=None)
def test_the_lookup_finds_what_looking_back_a_wide_region_finds(accesses, now_step):
    """Two trackers see the same accesses; one looks back only as far as its widest narrow region (``span``), the
    other as far as any narrow region could reach (WIDE bytes, the lookup before ``span``). Every instruction gets
    the same ready time and pending count, and every earlier one the same waiters, in the same order."""
    fast, slow = Regions(), Regions()
    issued = []
    for step, (lo, length, pattern, write, spec, end) in enumerate(accesses):
        pair = []
        for regs in (fast, slow):
            ins = Instr(_SPECS[spec], (), ())
            ins.ready = step
            if regs is slow:
                regs.span = WIDE
            regs.track(ins, lo, lo + length, pattern, write, step * now_step)
            pair.append(ins)
        a, b = pair
        assert (a.ready, a.pending) == (b.ready, b.pending)
        issued.append(pair)
        for ins in pair:                    # its times become known (or not) before the next access
            if end >= 0:
                ins.busy_end = end
                ins.end = end + 7
    index = {id(x): i for i, pair in enumerate(issued) for x in pair}
    for a, b in issued:
        assert [index.get(id(w), w) for w in a.waiters or ()] == [index.get(id(w), w) for w in b.waiters or ()]
    assert len(fast) == len(slow)
