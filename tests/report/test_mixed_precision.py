"""systems.report.mixed_precision: the dtype matrix, the LayerNorm summary, the speedup table and
the answers of notebook 03, from the experiments' own output."""

import pandas as pd
import pytest

from systems.bench import precision as mp
from systems.report import mixed_precision as report


def test_accumulation_answer_quotes_the_loops():
    acc = mp.accumulation_experiment()
    text = report.accumulation_answer(acc)
    a = acc.set_index("loop")
    assert f"{a.loc['fp16 += fp16', 'result']:.5g}" in text and f"{a.loc['bf16 += bf16', 'result']:g}" in text
    # spacing: fp16 numbers in [8, 16) are 2^-7 apart, bf16 numbers in [4, 8) 2^-5
    assert report.spacing(9.95, "fp16") == 2.0 ** -7
    assert report.spacing(4.0, "bf16") == 2.0 ** -5


def test_dtype_matrix_and_answer():
    both = mp.probe_all(("fp16", "bf16"), device="cpu")
    wide = report.dtype_matrix(both)
    assert set(wide.columns) == {"bf16", "fp16"}
    assert wide.loc["loss"].tolist() == ["fp32", "fp32"]
    assert list(wide.index[:3]) == list(dict.fromkeys(both["quantity"]))[:3]  # probe order kept
    text = report.dtype_answer(both)
    assert "**fp16 autocast (cpu):**" in text and "**bf16 autocast (cpu):**" in text
    assert "the loss `fp32`" in text
    assert "CPU autocast does not list `layer_norm`" in text  # the CPU run's LayerNorm output is bf16


def test_layernorm_summary_and_answer():
    scales = [1e-4, 1.0, 10.0, 100.0]
    df = mp.layernorm_sensitivity(scales=scales, d=1024, rows=8, mean_to_std=(0.0, 10.0))
    summary = report.layernorm_summary(df)
    assert summary["fp16_sum_sq_overflow_scale"] == 10.0
    assert summary["bf16_any_nonfinite"] is False
    # squares of 1e-4 activations underflow fp16: its variance is off by over 10 % there and nowhere larger
    assert summary["fp16_sum_sq_underflow_scale"] == 1e-4
    text = report.layernorm_answer(summary)
    assert "overflows to inf from activation scale 10 on" in text
    assert "no longer needs protecting from overflow" in text  # only said because no bf16 run overflowed
    table = report.layernorm_table(df, mean_to_std=0.0, value="var_rel_err", methods=("sum_sq",))
    assert list(table.columns) == ["scale", "bf16 sum_sq", "fp16 sum_sq", "fp32 sum_sq"]
    assert list(table["scale"]) == scales
    fig = report.plot_layernorm(df)
    assert [ax.get_xlabel() for ax in fig.axes] == ["activation scale (std of x)"] * 2


def test_speedup_table_and_answer():
    records = [
        {"model": "a", "mode": "forward", "precision": "fp32", "status": "ok", "step_mean_s": 0.2,
         "step_std_s": 0.01, "tokens_per_s": 10.0, "n_params": 100},
        {"model": "a", "mode": "forward", "precision": "bf16", "status": "ok", "step_mean_s": 0.1,
         "step_std_s": 0.01, "tokens_per_s": 20.0, "n_params": 100},
        {"model": "b", "mode": "forward", "precision": "fp32", "status": "oom", "error": "out of memory"},
        {"model": "b", "mode": "forward", "precision": "bf16", "status": "ok", "step_mean_s": 0.5,
         "step_std_s": 0.0, "tokens_per_s": 4.0, "n_params": 1000},
    ]
    table = report.speedup_table(records).set_index("model")
    assert table.loc["a", "speedup"] == pytest.approx(2.0)
    assert table.loc["b", "fp32_status"] == "oom" and pd.isna(table.loc["b", "speedup"])
    text = report.speedup_answer(report.speedup_table(records), pd.DataFrame(records), device="cuda", gpu="X",
                                 handout="2026")
    assert "bf16 autocast is faster everywhere" in text and "a 200.0 → 100.0 ms (2.00×)" in text
    assert "b forward fp32: oom" in text
    # with per-step times the medians decide, so one slow step does not move the speedup
    timed = [{**records[0], "step_times_s": [0.2, 0.2, 0.2, 0.2, 2.0], "batch_size": 4, "context_length": 8},
             {**records[1], "step_times_s": [0.1, 0.1, 0.1, 0.1, 0.1], "batch_size": 4, "context_length": 8}]
    row = report.speedup_table(timed).iloc[0]
    assert row["speedup"] == pytest.approx(2.0) and row["fp32_p90_ms"] > row["fp32_ms"] == pytest.approx(200.0)
    assert row["bf16_tok_s"] == pytest.approx(32 / 0.1)
    # the handout's names label the presets: 2026's xl is the 2.7B preset
    named = report.speedup_table([{**r, "model": "2.7B"} for r in records[:2]], handout="2026")
    assert list(named["size"]) == ["xl"]


def _timed(model, mode, precision, ms, *, n_params, flops):
    return {"model": model, "mode": mode, "precision": precision, "status": "ok", "n_params": n_params,
            "flops_per_step": flops, "step_times_s": [t / 1e3 for t in ms], "batch_size": 4, "context_length": 8}


def test_speedup_answer_calls_a_difference_inside_the_spread_noise():
    records = [
        # s, forward_backward: fp32 50 ms flat; bf16's median 52 ms, its p10-p90 42-63 ms (inclusive
        # quantiles of five times) holds fp32's 50: 0.96x, but within noise, not slower
        _timed("s", "forward_backward", "fp32", [50] * 5, n_params=100, flops=1e12),
        _timed("s", "forward_backward", "bf16", [40, 45, 52, 60, 65], n_params=100, flops=1e12),
        # m does 5x s's FLOPs in 100 / 52 = 1.92x the bf16 time: under half of 5x
        _timed("m", "forward_backward", "fp32", [400] * 5, n_params=1000, flops=5e12),
        _timed("m", "forward_backward", "bf16", [100] * 5, n_params=1000, flops=5e12),
        # s's bf16 train step (45 ms) shorter than its bf16 forward + backward (52 ms): impossible but for noise
        _timed("s", "train_step", "fp32", [60] * 5, n_params=100, flops=1e12),
        _timed("s", "train_step", "bf16", [45] * 5, n_params=100, flops=1e12),
    ]
    speed = report.speedup_table(records)
    row = speed.set_index(["model", "mode"]).loc[("s", "forward_backward")]
    assert (row["bf16_p10_ms"], row["bf16_p90_ms"]) == pytest.approx((42.0, 63.0))
    assert report.precision_noise_side(row) == "fp32"
    # the table decides it once per row; m's medians lie outside each other's spread
    assert row["noise_side"] == "fp32"
    assert pd.isna(speed.set_index(["model", "mode"]).loc[("m", "forward_backward"), "noise_side"])
    text = report.speedup_answer(speed, pd.DataFrame(records), device="cuda", gpu="X", handout="2026")
    assert "bf16 autocast is faster at 2 and within noise at 1 of the points" in text and "slower" not in text
    assert ("s 50.0 → 52.0 ms (0.96×, within noise: fp32's median lies inside bf16's p10–p90 range, "
            "42.0–63.0 ms)") in text
    assert "m 400.0 → 100.0 ms (4.00×)" in text  # outside each other's spread: a real speedup
    assert ("For s, forward_backward is not bound by its FLOPs: m does 5.00× its FLOPs in only "
            f"{100 / 52:.2f}× its bf16 time") in text
    assert ("For s, the bf16 train step (median 45.0 ms) came out shorter than the bf16 forward_backward "
            "(52.0 ms)") in text
    # the FLOP scaling is a GPU argument: a CPU smoke run does not make it
    cpu = report.speedup_answer(speed, pd.DataFrame(records), device="cpu", gpu="X", handout="2026")
    assert "not bound by its FLOPs" not in cpu and "within noise at 1" in cpu
    # bf16's median inside fp32's spread counts too; medians outside both spreads do not
    assert report.precision_noise_side({"fp32_ms": 50, "fp32_p10_ms": 40, "fp32_p90_ms": 60,
                              "bf16_ms": 55, "bf16_p10_ms": 54, "bf16_p90_ms": 56}) == "bf16"
    assert report.precision_noise_side({"fp32_ms": 50, "fp32_p10_ms": 49, "fp32_p90_ms": 51,
                              "bf16_ms": 45, "bf16_p10_ms": 44, "bf16_p90_ms": 46}) is None


def test_harness_bf16_sweep_runs_on_cpu(tmp_path):
    from systems.bench.benchmark import run_sweep

    configs = mp.precision_sweep_configs(["debug"], modes=("forward",), context_length=16, batch_size=1,
                                         default_steps=(0, 1), device="cpu")
    records = run_sweep(configs, out_path=tmp_path / "r.jsonl", progress=False)
    table = report.speedup_table(records)
    assert len(table) == 1 and table["speedup"].iloc[0] > 0
    fig = report.plot_speedup(table, title="t")
    assert fig.axes[0].get_xlabel() == "parameters"
