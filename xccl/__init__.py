"""XCCL: far-memory communication protocols as kernels on ascend_emu (DESIGN.md section 4).

    comm = xccl.Communicator(pod, dies=[0, 16])
    comm.send(kv_gm, dst_die=16, event_id=7, cores=8, path="mtu")     # queued on die 0
    t = comm.recv(kv_dst_gm, src_die=0, event_id=7, cores=8)          # queued on die 16
    run = t.wait()                                                    # runs the pod; RunResult
"""
from .comm import Communicator, XcclError
from .p2p import Transfer, recv, send

__all__ = ["Communicator", "XcclError", "Transfer", "send", "recv"]
