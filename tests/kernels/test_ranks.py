"""Host inputs of the kernels' host calls enter GM without a copy where the dtype and layout allow (issue 19)."""
import numpy as np
import torch

from ascend_emu import Pod, cloudmatrix384
from kernels.grouped_matmul import grouped_matmul


def _stores(pod: Pod) -> dict:
    return {s.name: s for a in pod.gm._arenas.values() for s in a._stores}


def test_grouped_matmul_weights_alias_the_host_tensor_and_converted_inputs_are_copied():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (32, 64), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (2, 64, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(2, 128, generator=g, dtype=torch.float64)       # converted to fp32: a copy
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    res = grouped_matmul(x, w, group_list=torch.tensor([10, 32]), scale=scale, pod=pod, trace=False)
    stores = _stores(pod)
    assert np.shares_memory(stores["weight0"].data, w.numpy())
    assert np.shares_memory(stores["x0"].data, x.numpy())
    assert not np.shares_memory(stores["scale0"].data, scale.numpy())
    want = torch.cat([x[:10].int() @ w[0].int(), x[10:].int() @ w[1].int()]).double()
    want[:10] *= scale[0].float().double()
    want[10:] *= scale[1].float().double()
    assert torch.allclose(res.y.double(), want, rtol=2 ** -7)
