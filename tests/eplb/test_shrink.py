"""Failure shrink keeps every expert on the survivors, or says why it cannot."""
import numpy as np
import pytest

import eplb
from eplb import EplbError, shrink


@pytest.mark.parametrize("num_gpus, slots, failed", [(40, 1, [3, 17, 39]), (8, 6, [0, 5])])
def test_shrink_keeps_every_expert_off_failed_dies(num_gpus, slots, failed):
    w = eplb.skewed_load(4, 32, hot_ratio=10.0, seed=7)
    old = eplb.rebalance_experts(w, num_gpus * slots, 1, 1, num_gpus)[0]
    phy2log, log2phy, logcnt = shrink(w, old, failed, num_gpus)
    die = np.arange(num_gpus * slots) // slots
    dead = np.isin(die, failed)
    assert (phy2log[:, dead] == -1).all() and (phy2log[:, ~dead] >= 0).all()
    assert (logcnt >= 1).all() and (logcnt.sum(1) == (~dead).sum()).all()
    assert not np.isin(log2phy, np.flatnonzero(dead)).any()
    for layer in range(4):
        for d in set(die[~dead].tolist()):
            held = phy2log[layer, die == d]
            assert len(set(held.tolist())) == len(held)               # still never two replicas on a die
    survivors = np.unique(die[~dead])
    rep = eplb.balance_report(w, phy2log[:, ~dead], len(survivors))
    assert rep.overall <= 1.05 * eplb.lower_bound(w, int((~dead).sum()), len(survivors)).max()
    if slots == 1:                                                    # survivors keep what they can
        kept = (phy2log == old)[:, ~dead].mean()
        assert kept > 0.8


def test_shrink_impossible_is_a_clear_error():
    w = eplb.skewed_load(2, 32, hot_ratio=10.0, seed=1)
    old = eplb.rebalance_experts(w, 36, 1, 1, 36)[0]
    with pytest.raises(EplbError, match="5 failed dies leave 31 dies x 1 slots = 31 slots for 32 experts"):
        shrink(w, old, [0, 1, 2, 3, 4], 36)
    with pytest.raises(EplbError, match="failed die 36 out of range"):
        shrink(w, old, [36], 36)
