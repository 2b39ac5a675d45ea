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


def test_harness_bf16_sweep_runs_on_cpu(tmp_path):
    from systems.bench.benchmark import run_sweep

    configs = mp.precision_sweep_configs(["debug"], modes=("forward",), context_length=16, batch_size=1,
                                         default_steps=(0, 1), device="cpu")
    records = run_sweep(configs, out_path=tmp_path / "r.jsonl", progress=False)
    table = report.speedup_table(records)
    assert len(table) == 1 and table["speedup"].iloc[0] > 0
    fig = report.plot_speedup(table, title="t")
    assert fig.axes[0].get_xlabel() == "parameters"
