"""systems.report.benchmarking: notebook 01's tables and answers from harness records, labelled
with the selected handout's size names."""

import numpy as np
import pytest

from systems.bench.benchmark import BenchmarkConfig, run_sweep
from systems.measure.timer import median_p10_p90
from systems.report import benchmarking as report

TINY = dict(model="debug", context_length=32, batch_size=2, warmup=1, steps=3, device="cpu")


@pytest.fixture(scope="module")
def records():
    return run_sweep([BenchmarkConfig(mode=m, **TINY) for m in ("forward", "train_step")], progress=False)


def _record(preset, mode, status="ok", **times):
    r = {"model": preset, "mode": mode, "status": status, "warmup": 5, "n_params": 1e6}
    r.update(times)
    return r


def test_phase_table_keeps_the_handouts_statistics_and_adds_percentiles(records):
    table = report.phase_table(records, handout="2026").set_index("mode")
    train = next(r for r in records if r["mode"] == "train_step")
    assert table.loc["train_step", "step ms"] == pytest.approx(train["step_mean_s"] * 1e3)
    assert table.loc["train_step", "backward std ms"] == pytest.approx(train["backward_std_s"] * 1e3)
    median, p10, p90 = median_p10_p90(train["step_times_s"])
    assert table.loc["train_step", "step p90 ms"] == pytest.approx(p90 * 1e3)
    assert np.isnan(table.loc["forward"].get("backward ms", np.nan))
    assert report.peak_note(records) == "rates from the median step; no named peak for this device, so no MFU"


def test_sizes_carry_the_handouts_names():
    rows = [_record("2.7B", "forward", forward_mean_s=0.3, forward_std_s=0.001, step_mean_s=0.3, step_std_s=0.001),
            _record("10B", "train_step", status="oom")]
    assert list(report.phase_table(rows, handout="2026")["size"]) == ["xl", "10B"]
    assert list(report.phase_table(rows[:1], handout="2025")["size"]) == ["2.7B"]
    text = report.answer_b(rows[:1], rows[1:], handout="2026")
    assert "300.0 ms ± 1.0 ms (xl)" in text and "Did not run: 10B train_step (oom)" in text


def test_answer_b_explains_a_low_backward_ratio_only_where_there_is_one():
    def train(preset, fwd, bwd, mfu):
        return _record(preset, "train_step", forward_mean_s=fwd, backward_mean_s=bwd, optimizer_mean_s=0.01,
                       step_mean_s=fwd + bwd + 0.01, step_std_s=0.001, mfu=mfu)

    text = report.answer_b([], [train("small", 0.03, 0.04, 0.3), train("2.7B", 0.33, 0.68, 0.56)], handout="2026")
    assert "Where it is under 1.8×, the train step's MFU is 30% (small) against 56% (xl) for the sizes at or" in text
    text = report.answer_b([], [train("small", 0.03, 0.06, 0.3), train("2.7B", 0.33, 0.68, 0.56)], handout="2026")
    assert "Where it is under" not in text
    # the groups' MFU ranges meet (medium's 49% against large's 48%): no explanation is claimed
    text = report.answer_b([], [train("small", 0.03, 0.04, 0.3), train("medium", 0.1, 0.17, 0.49),
                                train("large", 0.2, 0.39, 0.48)], handout="2026")
    assert "Where it is under" not in text


def test_answer_b_reads_ratios_and_spread(records):
    forward = [r for r in records if r["mode"] == "forward"]
    train = [r for r in records if r["mode"] == "train_step"]
    text = report.answer_b(forward, train, handout="2026")
    t = train[0]
    assert f"{t['backward_mean_s'] / t['forward_mean_s']:.2f}× (debug)" in text
    worst = max(r["step_std_s"] / r["step_mean_s"] for r in records)
    assert f"at most {worst:.1%} of the mean" in text
    fig = report.plot_phases(train, title="t", handout="2026")
    assert fig.axes[0].get_xlabel() == "model size"
    assert report.answer_b([], [_record("small", "train_step", status="oom")], handout="2026").startswith("No size ran")


def test_warmup_answer_follows_the_data():
    def run(warmup, steps_ms):
        return {"model": "small", "mode": "train_step", "warmup": warmup, "status": "ok",
                "step_times_s": [t / 1e3 for t in steps_ms]}

    rows = [run(0, [500, 10, 10, 11, 10]), run(1, [12, 10, 10, 10, 11]), run(2, [10, 10, 11, 10, 10]),
            {"model": "10B", "mode": "train_step", "warmup": 0, "status": "skipped (train step oom in the timing sweep)"}]
    table = report.warmup_table(rows, handout="2026")
    assert list(table["status"]) == ["ok", "ok", "ok", "skipped (train step oom in the timing sweep)"]
    assert table.loc[0, "first / median"] == pytest.approx(50.0)
    text = report.warmup_answer(table, device="cuda")
    assert "takes 50.0× (small) the median" in text and "slower, noisier step" in text
    assert "With 1 warm-up step the first measured step is 1.20× (small)" in text
    # medians: 10 (1 warm-up) against 10 (2 warm-ups): the whole run is compared too
    assert "the median, and the run's median is 1.00× (small) the 2-warm-up run's." in text
    slow = report.warmup_table([*rows[:1], run(1, [12, 11, 11, 12, 11]), *rows[2:]], handout="2026")
    assert "the run's median is 1.10× (small) the 2-warm-up run's" in report.warmup_answer(slow, device="cuda")
    assert "cuBLAS" in text
    # a "cold" run that is not slower: the answer must not claim it is
    rows[0] = run(0, [10, 10, 10, 10, 10])
    text = report.warmup_answer(report.warmup_table(rows, handout="2026"), device="cpu")
    assert "slower, noisier" not in text and "noise between two processes" in text
    fig = report.plot_warmup(rows, title="t", handout="2026")
    assert fig.axes[0].get_xlabel() == "measured step"


def test_harness_answer_names_the_modes_each_handout_asks_for():
    assert "full training step with our AdamW" in report.harness_answer("2026")
    assert "forward only or forward and backward" in report.harness_answer("2025")
