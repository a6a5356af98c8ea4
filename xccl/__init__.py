"""XCCL: far-memory communication protocols as kernels on ascend_emu (DESIGN.md section 4).

    comm = xccl.Communicator(pod, dies=[0, 16])
    comm.send(kv_gm, dst_die=16, event_id=7, cores=8, path="mtu")     # queued on die 0
    t = comm.recv(kv_dst_gm, src_die=0, event_id=7, cores=8)          # queued on die 16
    run = t.wait()                                                    # runs the pod; RunResult

    res = xccl.dispatch(comm, x, topk_ids, num_experts=64, quant=True)       # pull-based EP dispatch
    out = xccl.combine(comm, res.handle, expert_out, topk_weights)          # weighted return
"""
from .a2e import A2EGroup, A2EHandle, E2AHandle, plan_groups
from .a2e import reference as a2e_reference
from .comm import Communicator, XcclError
from .moe import (CombineResult, DispatchHandle, DispatchResult, RoutingPlan, combine, default_placement, dispatch,
                  plan_routing, prepare_dispatch)
from .p2p import Transfer, recv, send
from .service import ExpertService, ServiceResult, replica_placement, service_reference

__all__ = ["Communicator", "XcclError", "Transfer", "send", "recv", "dispatch", "combine", "prepare_dispatch",
           "A2EGroup", "A2EHandle", "E2AHandle", "plan_groups", "a2e_reference",
           "plan_routing", "default_placement", "DispatchResult", "DispatchHandle", "CombineResult", "RoutingPlan",
           "ExpertService", "ServiceResult", "replica_placement", "service_reference"]
