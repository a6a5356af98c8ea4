"""GM-bound copies sample their source at their start and land it at their end, copying the bytes once (issue 19):
the engine lends the source and copies it at the landing, unless a write into it comes first."""
import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384, kernel
from ascend_emu.isa import OPS


def count_executions(monkeypatch, names) -> dict:
    """Count the start-time data paths of ops ``names`` the engine runs, per op (those it defers do not run)."""
    counts = {}
    for name in names:
        spec = OPS[name]
        real = spec.execute

        def counting(ins, real=real, name=name):
            counts[name] = counts.get(name, 0) + 1
            real(ins)
        monkeypatch.setattr(spec, "execute", counting)
    return counts


@pytest.fixture
def samples(monkeypatch):
    """Count the eager samples (isa.ex_sample) the engine takes, per op."""
    return count_executions(monkeypatch, ("copy_ub_to_gm", "dma_copy"))


@kernel(cores="aiv")
def _overwrite_in_flight(ctx, x_gm, y_gm, z_gm, computed):
    t = ctx.ub.alloc(x_gm.shape, "fp32")
    if computed:                              # t made by the vector unit, not loaded
        u = ctx.ub.alloc(x_gm.shape, "fp32")
        yield ctx.copy_gm_to_ub(u, x_gm)
        yield ctx.vec.muls(t, u, 1.0)
    else:                                     # t a lazy load: the copies out of it borrow x_gm's bytes
        yield ctx.copy_gm_to_ub(t, x_gm)
    first = ctx.copy_ub_to_gm(y_gm, t)        # lands one L2 latency after its bytes have left UB
    yield first
    yield ctx.vec.muls(t, t, 2.0)             # may overwrite t once its bytes have left: before y_gm has landed
    yield ctx.copy_ub_to_gm(z_gm, t)


@pytest.mark.parametrize("computed", [True, False])
@pytest.mark.parametrize("die", [0, 1])
def test_a_source_overwritten_before_the_landing_lands_its_start_values(samples, die, computed):
    """The first copy takes its sample when muls overwrites t before y_gm lands, the second copies once, at its
    landing: on its own die, and to another die (a staged write lends its source to its push's landing when one
    process owns both dies, staging.py). When t was loaded from x_gm, the first copy borrows x_gm's bytes instead
    (a lazy load stands for its tile): muls overwriting t takes no sample."""
    pod = Pod(cloudmatrix384(dies=2), trace=True)
    x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    x_gm = pod.to_gm(0, x)
    y_gm, z_gm = pod.alloc(die, x.shape, "fp32"), pod.alloc(die, x.shape, "fp32")
    pod.launch(_overwrite_in_flight, aiv=1, args=(x_gm, y_gm, z_gm, computed))
    assert np.array_equal(y_gm.numpy(), x) and np.array_equal(z_gm.numpy(), 2 * x)
    assert samples == ({"copy_ub_to_gm": 1} if computed else {})


@kernel(cores="aiv")
def _dma(ctx, dst, src):
    yield ctx.dma_copy(dst, src)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_gm_source_written_by_the_host_during_a_dma_copy(samples, overwrite):
    """A DMA copy's GM source written while the copy is in flight: the copy lands the source as it was."""
    x = np.arange(1 << 16, dtype=np.uint8)

    def run(at_us=None):
        pod = Pod(cloudmatrix384(dies=2), trace=True)
        src, dst = pod.to_gm(0, x), pod.alloc(0, x.shape, "uint8")
        if at_us is not None:
            pod.host_write(src[100:200], 7, at_us=at_us)
        return pod.launch(_dma, aiv=1, args=(dst, src)), src, dst
    probe = run()[0]
    flowed = max(s[5] for s in probe.trace.slices if s[3] == "dma_copy") / 1e6
    mid = (flowed + probe.end_us) / 2                 # after the copy read its source, before it landed
    _, src, dst = run(mid if overwrite else None)
    assert np.array_equal(dst.numpy(), x)
    assert np.all(src.numpy()[100:200] == 7) == overwrite
    assert samples == ({"dma_copy": 1} if overwrite else {})


@kernel(cores="aiv")
def _shift(ctx, buf):
    yield ctx.dma_copy(buf[64:], buf[:-64])


def test_a_dma_copy_within_one_tensor_lands_the_source_as_it_was():
    pod = Pod(cloudmatrix384(dies=1), trace=False)
    x = np.arange(256, dtype=np.int32)
    buf = pod.to_gm(0, x)
    pod.launch(_shift, aiv=1, args=(buf,))
    assert np.array_equal(buf.numpy(), np.concatenate([x[:64], x[:-64]]))
