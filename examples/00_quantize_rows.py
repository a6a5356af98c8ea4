"""00: double-buffered per-row INT8 quantisation on 48 AIVs, stored to the other die; checked against torch."""
import torch

from ascend_emu import Pod, cloudmatrix384, kernel

R, H = 8, 1024


@kernel(cores="aiv")
def quantize_rows(ctx, x_gm, y_gm, scale_gm, rows):
    x_t = ctx.ub.alloc((2, R, H), "bf16")
    y_t = ctx.ub.alloc((2, R, H), "int8")
    s_t = ctx.ub.alloc((2, R), "fp32")
    lo = ctx.block_idx * rows
    for i, r in enumerate(range(lo, lo + rows, R)):
        k = i % 2
        yield ctx.copy_gm_to_ub(x_t[k], x_gm[r:r + R])
        yield ctx.vec.quant_int8(y_t[k], s_t[k], x_t[k])
        yield ctx.copy_ub_to_gm(y_gm[r:r + R], y_t[k])
        yield ctx.copy_ub_to_gm(scale_gm[r:r + R], s_t[k])


def main():
    pod = Pod(cloudmatrix384(dies=2))
    x = torch.randn(48 * 64, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x_gm = pod.to_gm(0, x)
    y_gm = pod.alloc(1, x.shape, "int8")
    s_gm = pod.alloc(1, (x.shape[0],), "fp32")
    run = pod.launch(quantize_rows, die=0, aiv=48, args=(x_gm, y_gm, s_gm, 64))
    xf = x.float()
    ref_s = xf.abs().amax(-1) / 127
    ref_q = torch.round(xf / ref_s[:, None]).clamp(-128, 127).to(torch.int8)
    assert (s_gm.numpy() == ref_s.numpy()).all() and (y_gm.numpy() == ref_q.numpy()).all()
    print(run.summary())
    return run


if __name__ == "__main__":
    main()
