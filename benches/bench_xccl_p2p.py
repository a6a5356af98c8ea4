"""send/recv: emulator wall time next to a torch copy of the same bytes; modeled us in extra_info.

Run: python -m pytest benches/bench_xccl_p2p.py --benchmark-only
"""
import numpy as np
import pytest
import torch

from ascend_emu import Pod, cloudmatrix384
from xccl import Communicator, recv, send


def _transfer(nbytes, cores, path, numeric):
    pod = Pod(cloudmatrix384(dies=17), trace=False)
    comm = Communicator(pod, [0, 16], lanes=48, phantom=not numeric)
    if numeric:
        src = pod.to_gm(0, np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    else:
        src = pod.alloc(0, (nbytes,), "uint8", phantom=True)
    dst = pod.alloc(16, (nbytes,), "uint8", phantom=not numeric)
    send(comm, src, 16, 1, cores=cores, path=path, numeric=numeric)
    t = recv(comm, dst, 0, 1, cores=cores, numeric=numeric)
    t.wait()
    return t.modeled_us


@pytest.mark.parametrize("nbytes", [4 << 10, 1 << 20, 16 << 20])
@pytest.mark.parametrize("cores", [1, 8, 48])
@pytest.mark.parametrize("path", ["mtu", "dma"])
def test_send_recv_timing_only(benchmark, nbytes, cores, path):
    us = benchmark.pedantic(lambda: _transfer(nbytes, cores, path, False), rounds=2, iterations=1)
    benchmark.extra_info.update(modeled_us=us, bytes=nbytes, cores=cores, path=path,
                                modeled_gbps=nbytes / (us * 1e3))


@pytest.mark.parametrize("nbytes", [1 << 20])
def test_send_recv_numeric(benchmark, nbytes):
    us = benchmark.pedantic(lambda: _transfer(nbytes, 8, "mtu", True), rounds=3, iterations=1)
    benchmark.extra_info.update(modeled_us=us, bytes=nbytes)


@pytest.mark.parametrize("nbytes", [1 << 20])
def test_torch_reference_copy(benchmark, nbytes):
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    y = torch.empty_like(x)
    benchmark(lambda: y.copy_(x))
