"""Expert-placement load balancing (DESIGN.md 7): load collection, redundant experts, placement, replica rotation,
live reconfiguration and failure shrink. Numpy + Numba only; speaks DeepSeek EPLB's format (vLLM, SGLang):

    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    eplb.balance_report(weight, phy2log, num_gpus).overall        # max/mean die load

``eplb.emu`` (the Collect kernel and the reconfiguration model on the emulator) imports ascend_emu; import it
explicitly.
"""
from .api import ALGOS, inverse_map, rebalance_experts
from .errors import EplbError
from .load import LoadCollector
from .mapping import arrival_rank, map_experts, rotation_table
from .placement import place
from .reconfig import LiveReconfig, ReconfigResult, StepRecord, check_no_unloaded_routes, plan_rounds
from .redundancy import replicate
from .report import BalanceReport, balance_report, die_loads, lower_bound
from .shrink import shrink
from .synthetic import drifting_load, hopping_load, skewed_load

__all__ = [
    "rebalance_experts", "balance_report", "BalanceReport", "die_loads", "lower_bound", "inverse_map", "ALGOS",
    "replicate", "place", "LoadCollector", "rotation_table", "map_experts", "arrival_rank", "LiveReconfig",
    "ReconfigResult", "StepRecord", "plan_rounds", "check_no_unloaded_routes", "shrink", "skewed_load",
    "drifting_load", "hopping_load", "EplbError",
]
