"""serving.timing: the timing-only decode step (DP attention + EP MoE, one or two microbatches, MTP)."""
import json

import pytest

from ascend_emu.errors import ArgumentError
from serving.config import MINI, V3
from serving.timing import balanced_routing, decode_step_timing, layer_timing

import serving.cli  # noqa: F401  (registers serve-model and decode-layer)

SMALL = dict(dies=4, batch_per_die=16, seq_len=256)
MINI_MTP = MINI.replace(num_nextn_predict_layers=1)


def _overlaps(a, b):
    return a[3] < b[4] and b[3] < a[4]


def test_two_microbatches_run_concurrently_on_split_cores():
    """Two microbatches: the attention ops of microbatch 1 overlap the MoE ops of microbatch 0 in one pod run,
    so the period is shorter than the two streams' busy times added up."""
    r = layer_timing(MINI, "moe", microbatches=2, **SMALL)
    attn1 = [e for e in r.schedule if e[0] == 0 and e[1] == 1 and e[2] in ("mla_prolog", "attention", "o_proj")]
    moe0 = [e for e in r.schedule if e[0] == 0 and e[1] == 0 and e[2] in ("router", "gating", "dispatch")]
    assert any(_overlaps(a, m) for a in attn1 for m in moe0)
    busy = r.stream_busy_us
    assert r.period_us >= max(busy.values()) and r.period_us < busy["attention"] + busy["moe"]
    one = layer_timing(MINI, "moe", microbatches=1, **SMALL)
    assert one.period_us == pytest.approx(sum(one.stream_busy_us.values()))          # serial: no overlap


def test_two_microbatches_lower_layer_latency_when_attention_dominates():
    """Same total batch (64 sequences per die at 8K context, mini shapes): with one microbatch the die runs attention,
    then waits on dispatch / combine latency; with two, one microbatch's attention hides the other's MoE exchange,
    so the per-layer latency drops (V3 at 16-64 dies is HBM-bound and does not gain: see the module doc)."""
    kw = dict(dies=4, batch_per_die=64, seq_len=8192)
    one = layer_timing(MINI, "moe", microbatches=1, **kw)
    two = layer_timing(MINI, "moe", microbatches=2, **kw)
    assert two.period_us < one.period_us
    assert two.tokens == one.tokens == 64


@pytest.mark.slow
def test_v3_shapes_with_mtp_and_int8_cache():
    """The real V3 shapes run end to end (S = 2 query tokens, int8 latent cache, two microbatches)."""
    r = decode_step_timing(V3, dies=8, batch_per_die=16, seq_len=512, microbatches=2, mtp=1, kv_int8=True,
                           acceptance=0.9)
    assert (r.dense_layers, r.moe_layers) == (3, 58)
    assert r.tokens_per_step == pytest.approx(1.9)
    assert r.mtp_us > r.lm_head_us > 0
    assert r.tpot_ms == pytest.approx(r.step_us / 1.9 / 1000)
    assert set(r.breakdown_us) == {"dense", "moe", "mtp"}


def test_deterministic():
    a = layer_timing(MINI, "moe", microbatches=2, **SMALL)
    b = layer_timing(MINI, "moe", microbatches=2, **SMALL)
    assert a.schedule == b.schedule
    assert a.period_us == b.period_us and a.breakdown_us == b.breakdown_us
    assert a.instructions == b.instructions and a.bytes_moved == b.bytes_moved


def test_step_composition_and_mtp_accounting():
    base = decode_step_timing(MINI_MTP, microbatches=1, **SMALL)
    assert (base.dense_layers, base.moe_layers) == (1, 2)
    assert base.tokens_per_step == 1.0 and base.mtp_us == 0.0
    assert base.step_us == pytest.approx(base.fill_us + base.per_layer_us["dense"] + 2 * base.per_layer_us["moe"]
                                         + base.lm_head_us)
    mtp = decode_step_timing(MINI_MTP, microbatches=1, mtp=1, acceptance=0.8, **SMALL)
    assert mtp.tokens_per_step == pytest.approx(1.8)
    assert mtp.mtp_us > 0
    assert mtp.step_us == pytest.approx(mtp.fill_us + mtp.per_layer_us["dense"] + 2 * mtp.per_layer_us["moe"]
                                        + mtp.lm_head_us + mtp.mtp_us)
    assert mtp.tpot_ms == pytest.approx(mtp.step_us / 1.8 / 1000)
    assert mtp.tokens_per_s_per_die == pytest.approx(16 * 1.8 / (mtp.step_us * 1e-6))
    assert mtp.tokens_per_s == pytest.approx(4 * mtp.tokens_per_s_per_die)
    # two query tokens per sequence: the main model's layers do more work than with one
    assert mtp.per_layer_us["moe"] > base.per_layer_us["moe"]
    assert mtp.tpot_ms < mtp.step_us / 1000


def test_serve_model_json(capsys):
    from ascend_emu.cli import main
    rc = main(["serve-model", "--config", "mini", "--dies", "4", "--batch-per-die", "16", "--seq-len", "128",
               "--microbatches", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("config", "dies", "modeled_tpot_ms", "tokens_per_s_per_die", "tokens_per_s", "per_layer_us",
                "breakdown_us", "microbatches", "mtp"):
        assert key in out
    assert out["config"] == "mini" and out["dies"] == 4 and out["microbatches"] == 2 and out["mtp"] == 0
    assert set(out["per_layer_us"]) == {"dense", "moe"}
    assert {"mla_prolog", "attention", "o_proj", "gating", "dispatch", "routed_experts", "shared_expert",
            "combine"} <= set(out["breakdown_us"]["moe"])
    assert out["tokens_per_s"] == pytest.approx(4 * out["tokens_per_s_per_die"])
    assert out["tokens_per_s_per_npu"] == pytest.approx(2 * out["tokens_per_s_per_die"])     # 2 dies per chip
    assert out["modeled_tpot_ms"] > 0
    assert set(out["roofline"]) == set(out["breakdown_us"])
    assert all(set(out["roofline"][k]) == set(out["breakdown_us"][k]) for k in out["roofline"])


def test_decode_layer_model_op(capsys):
    from ascend_emu.cli import main
    rc = main(["model", "decode-layer", "--json", "--quiet", "--config", "mini", "--dies", "2", "--batch-per-die",
               "8", "--seq-len", "128", "--microbatches", "1", "--sim-layers", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["op"] == "decode-layer" and out["modeled_us"] > 0 and 0 <= out["utilization"] <= 1
    roof = out["roofline"]
    assert set(roof) == set(out["breakdown_us"])
    for op, r in roof.items():
        assert r["kernel_us"] == pytest.approx(out["breakdown_us"][op])
        assert r["roofline_us"] == max(r["compute_us"], r["hbm_us"], r["movers_us"], r["fabric_us"]) > 0
        assert r["bound"] in ("compute", "hbm", "movers", "fabric") and r["compulsory_bytes"] > 0
    assert roof["dispatch"]["fabric_us"] > 0 and roof["router"]["bound"] != "fabric"


def test_layer_roofline_sums_the_microbatches_work():
    """Each op's bounds count the work of every microbatch of the layer: two microbatches of 8 sequences do the
    same FLOPs and move the same activation bytes as one of 16, and read each weight twice."""
    one = layer_timing(MINI, "moe", microbatches=1, **SMALL).roofline
    two = layer_timing(MINI, "moe", microbatches=2, **SMALL).roofline
    assert two["attention"]["compulsory_bytes"] == one["attention"]["compulsory_bytes"]
    router_weight = MINI.hidden_size * MINI.n_routed_experts * 2
    assert two["router"]["compulsory_bytes"] == one["router"]["compulsory_bytes"] + router_weight


@pytest.mark.parametrize("kw, name", [
    (dict(dies=3), "dies"),            # 16 experts (mini) / 256 (V3) do not split over 3 dies
    (dict(dies=4, microbatches=3), "microbatches"),
    (dict(dies=4, mtp=2), "mtp"),
    (dict(dies=4, acceptance=1.5), "acceptance"),
    (dict(dies=4, layers=0), "layers"),
])
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(ArgumentError, match=name):
        decode_step_timing(MINI_MTP, **{"batch_per_die": 8, "seq_len": 128, **kw})


def test_mtp_needs_an_mtp_head():
    with pytest.raises(ArgumentError, match="mtp"):
        decode_step_timing(MINI, dies=4, mtp=1, batch_per_die=8, seq_len=128)


def test_serve_model_bad_dies_exit_code(capsys):
    from ascend_emu.cli import main
    rc = main(["serve-model", "--config", "v3", "--dies", "3", "--json"])
    assert rc == 2
    assert "dies=3" in capsys.readouterr().err


def test_balanced_routing():
    ids = balanced_routing(16, 48, 8, 256)
    import numpy as np
    counts = np.bincount(np.concatenate([i.reshape(-1) for i in ids]), minlength=256)
    assert (counts == 16 * 48 * 8 // 256).all()
    assert all(len(set(row)) == 8 for i in ids for row in i.tolist())


def test_layer_roofline_reports_each_ops_own_hbm_bytes():
    """One microbatch, one layer: die 0's launches are exactly the ops' launches, so the ops' HBM bytes add up to
    theirs; with two microbatches the streams share the run and each op still gets a count of its own."""
    one = layer_timing(MINI, "moe", microbatches=1, **SMALL)
    ops = {op: r["hbm_bytes"] for op, r in one.roofline.items()}
    die0 = [la for la in one.run.launches if la.dies == [0]]
    assert sum(ops.values()) == sum(la.hbm_bytes for la in die0) > 0
    assert ops["attention"] > 0 and ops["routed_experts"] > 0
    two = layer_timing(MINI, "moe", microbatches=2, **SMALL)
    assert all(isinstance(r["hbm_bytes"], int) for r in two.roofline.values())
    assert two.roofline["attention"]["hbm_bytes"] > 0


def test_layer_figures_come_from_the_step_builders_records(monkeypatch):
    """The timing-only layer is built on serving.step.StepPod (the numeric runner's step builder): its schedule and
    breakdown are the op records of that step on the routed-expert compute die, the exchange-only dies included
    in the dispatch / combine records."""
    import serving.timing as timing
    from serving.step import StepPod
    built = []

    class Recorded(StepPod):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            built.append(self)
    monkeypatch.setattr(timing, "StepPod", Recorded)
    r = layer_timing(MINI, "moe", microbatches=2, **SMALL)
    (step,) = built
    records = step.records()
    die = r.compute_dies["routed"]["die"]
    expected = [(rec.key[0], rec.key[1], rec.op, la.start_ps / 1e6, la.end_ps / 1e6) for rec in records
                for la in rec.launches if la.dies == [die] and rec.key[0] < r.sim_layers]
    assert r.schedule == expected
    last = [rec for rec in records if rec.key[0] == r.sim_layers - 1]
    assert r.breakdown_us["attention"] == pytest.approx(sum(
        (la.end_ps - la.start_ps) / 1e6 for rec in last if rec.op == "attention" for la in rec.launches
        if la.dies == [die]))
    dispatch = [rec for rec in last if rec.op == "dispatch"]
    assert len(dispatch) == 2 and all(sorted(la.dies[0] for la in rec.launches) == list(range(4))
                                      for rec in dispatch)
    assert {rec.lane for rec in records} == {"attention", "moe"}


def test_w8a8_prolog_quantises_its_input_and_reads_int8_weights():
    """With quant at V3 shapes the prolog runs weight_quant_mode 2: a dynamic quant of the hidden state, then the
    prolog on int8 token_x with int8 W_dq / W_dkv_kr; both count in the "mla_prolog" op, whose roofline holds the
    int8 bytes. The mini config's heads do not fill int8 fractals: bf16."""
    from kernels.roofline import Work
    from serving.layer_parts import prolog_quant_mode, prolog_work
    assert (prolog_quant_mode(V3, True), prolog_quant_mode(V3, False), prolog_quant_mode(MINI, True)) == (2, 0, 0)
    b = 4
    r = layer_timing(V3, "dense", dies=2, batch_per_die=b, seq_len=256, microbatches=1, quant=True)
    h, x_cols = V3.hidden_size, V3.q_lora_rank + V3.kv_lora_rank + V3.qk_rope_head_dim
    assert [op for _, _, op, _, _ in r.schedule][:3] == ["mla_prolog", "mla_prolog", "attention"]
    works = prolog_work(V3, b, quant_int8=True, kv_int8=False)
    assert works[0] == Work(cube_flops=2.0 * b * h * x_cols, cube_dtype="int8",
                            read_bytes=b * h + 4 * b + h * x_cols + 4 * x_cols)
    quant_bytes = b * h * 2 + b * (h + 4)
    roof = r.roofline["mla_prolog"]
    assert roof["compulsory_bytes"] == quant_bytes + sum(w.read_bytes + w.write_bytes for w in works)
    # the HBMs moved the x projections' weights as int8: bf16 weights would add h * x_cols bytes (15 MB)
    assert roof["hbm_bytes"] < roof["compulsory_bytes"] + h * x_cols // 2
