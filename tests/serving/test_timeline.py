"""The serving step timeline (serving.cli.step_trace): one colour per op, the legend beside the plot."""
import matplotlib.colors as mcolors
import matplotlib.image as mpimg
import numpy as np

from serving.cli import step_trace

ATTENTION_OPS = ("prolog", "attention", "o_proj", "dense_ffn")
MOE_OPS = ("router", "gating", "dispatch", "quant", "gmm_gate_up", "gmm_down", "shared", "combine")


def decode_step_timeline(layers: int = 2) -> list:
    """(stream, "L{layer}.mb{mb}.{op}", start_us, end_us) as EmulatedRunner.execute records them."""
    out, t = [], 0.0
    for layer in range(layers):
        for stream, ops in (("attn", ATTENTION_OPS), ("moe", MOE_OPS)):
            for i, op in enumerate(ops):
                out.append((stream, f"L{layer}.mb0.{op}", t, t + 5.0 + i))
                t += 5.0 + i
    out.append(("head", "lm_head", t, t + 4.0))
    return out


def test_each_op_has_its_own_colour_and_the_legend_stays_off_the_title(tmp_path):
    trace = step_trace(decode_step_timeline(), "ascend-emu serving: one decode step (mini model, 2 dies)")
    ops = set(ATTENTION_OPS + MOE_OPS + ("lm_head",))
    fig = trace.figure()
    try:
        ax = fig.axes[0]
        handles = ax.get_legend().legend_handles
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert set(labels) == ops and len(labels) == len(ops)
        colors = {lab: mcolors.to_hex(h.get_facecolor()) for lab, h in zip(labels, handles)}
        assert len(set(colors.values())) == len(ops)
        r = fig.canvas.get_renderer()
        legend, title = ax.get_legend().get_window_extent(r), ax.title.get_window_extent(r)
        assert not legend.overlaps(title) and not legend.overlaps(ax.get_window_extent(r))
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
    img = mpimg.imread(trace.plot(tmp_path / "step.png"))[..., :3]
    for op, color in colors.items():      # every op's bars are drawn in its own colour
        close = np.abs(img - np.array(mcolors.to_rgb(color))).max(axis=-1) < 0.01
        assert close.sum() > 200, op
