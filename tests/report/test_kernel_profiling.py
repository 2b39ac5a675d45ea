"""systems.report.kernel_profiling: the tables and answers of notebook 02 from a real (CPU) sweep,
the coverage text for out-of-memory and skipped points, and the timeline figure."""

from __future__ import annotations

import pandas as pd
import pytest

from systems.bench import profile as BP
from systems.measure import profiler as P
from systems.report import kernel_profiling as KP
from tests.fixtures.traces import write_cuda_trace


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    plan = BP.ProfilePlan(sizes=BP.SMOKE_SIZES, contexts=(16, 32), batch_size=1, warmup=1, steps=2,
                          profile_steps=1, device="cpu")
    trace_dir = tmp_path_factory.mktemp("traces")
    summary, results = BP.profile_sweep(plan, trace_dir=trace_dir, progress=False)
    return plan, summary, results, trace_dir


def test_forward_table_and_answer_a(sweep):
    _, summary, _, _ = sweep
    table = KP.forward_table(summary)
    assert len(table) == len(summary)  # every point ran
    # "span vs harness" is the profiled span over the harness's time, minus one
    assert table["span vs harness"].to_numpy() == pytest.approx(
        (table["profiled span ms"] / table["harness ms"] - 1).to_numpy())
    text = KP.answer_a(table, device="cpu")
    fa = table[table["mode"] == "forward"]
    assert f"{int(fa['agrees'].sum())} of {len(fa)} profiled forward times agree" in text
    assert f"{fa.iloc[-1]['harness ms']:.2f}" in text  # the largest configuration's number, quoted
    assert "last operator's end" in text


def test_answer_a_splits_busy_from_launch_bound_forwards():
    def row(label, harness, span, kernel, overhead):
        return {"label": label, "context": 512, "mode": "forward", "harness ms": harness, "harness std ms": 0.1,
                "profiled ms": span, "profiler overhead": overhead, "profiled span ms": span,
                "span vs harness": span / harness - 1, "kernel ms": kernel, "agrees": True}

    table = pd.DataFrame([row("small", 20.0, 30.0, 5.0, 0.45), row("xl", 300.0, 301.5, 290.0, 0.004)])
    text = KP.answer_a(table, device="cuda")
    assert "(kernel time at least 90% of the span, our cut: 1 of 2 forward-only configurations) the profiled " \
           "span is +0.5% off the harness's time" in text
    assert "Where they do not (small 512)" in text and "changes the same loop's time by +45.0%" in text
    assert "up to +50% off" in text
    assert "run for 5.00 of the span's 30.00 ms" in text  # kernel time against the same profile's span


def test_answer_a_gives_signed_ranges():
    # a CPU smoke run can time the profiled loop faster than the plain one: a negative overhead is
    # stated as a signed change, and the largest deviation (either sign) is the one quoted
    table = pd.DataFrame([{"label": n, "context": 32, "mode": "forward", "harness ms": 4.0, "harness std ms": 0.5,
                           "profiled ms": 4.0, "profiler overhead": o, "profiled span ms": span,
                           "span vs harness": span / 4.0 - 1, "kernel ms": 1.0, "agrees": True}
                          for n, o, span in (("a", -0.47, 2.0), ("b", 0.72, 5.0))])
    text = KP.answer_a(table, device="cpu")
    assert "changes the same loop's time by -47.0% to +72.0%" in text and "up to -50% off (a at 32" in text


def test_top_kernel_and_answers_b_c(sweep):
    plan, summary, results, _ = sweep
    top = KP.top_kernel_table(summary)
    assert len(top) == len(plan.sizes) * len(plan.contexts)
    text = KP.answer_b(top)
    # the answer names the kernel that leads most configurations (timing on a shared CPU decides which)
    counts = top["top_forward_kernel"].value_counts()
    assert f"`{counts.index[0]}` in {counts.iloc[0]} of {len(top)} configurations" in text
    key = ("debug-wide", 32, "forward")
    non_mm = KP.non_matmul_table(results[key])
    assert "matmul" not in set(non_mm["category"]) and len(non_mm) > 0
    shares = KP.forward_category_shares(summary)
    assert shares[list(P.CATEGORIES)].sum(axis=1).to_numpy() == pytest.approx(1.0)
    text = KP.answer_c(results[key], "debug-wide at 32 tokens", shares)
    assert f"`{non_mm.iloc[0]['kernel']}`" in text


def test_category_shares_and_answer_d(sweep):
    _, summary, _, _ = sweep
    shares = KP.category_shares(summary)
    assert shares[list(P.CATEGORIES)].sum(axis=1).to_numpy() == pytest.approx(1.0)
    phases = [f"{p} (phase)" for p in P.PHASE_RANGES]
    train = shares[shares["mode"] == "train_step"]
    assert train[phases].sum(axis=1).to_numpy() == pytest.approx(1.0)
    assert (shares.loc[shares["mode"] == "forward", "forward (phase)"] == 1).all()
    text = KP.answer_d(shares, summary, device="cpu")
    assert "Matrix multiplies take" in text and "elementwise" in text and "optimizer step" in text
    fig = KP.plot_category_shares(shares, title="t")
    assert [ax.get_xlabel() for ax in fig.axes] == ["size, context"] * 2


def test_softmax_table_and_answer_e(sweep):
    _, summary, _, _ = sweep
    e = KP.softmax_table(summary)
    assert (e["softmax ms"] > 0).all() and (e["attention matmuls ms"] > 0).all()
    assert e["time ratio / FLOP ratio"].to_numpy() == pytest.approx(
        (e["softmax / matmul time"] / e["softmax / matmul FLOPs"]).to_numpy())
    assert "memory bandwidth" in KP.answer_e(e)


def test_coverage_names_oom_and_skipped_points():
    summary = pd.DataFrame([
        {"label": "small", "context_length": 256, "mode": "train_step", "status": "ok"},
        {"label": "small", "context_length": 256, "mode": "forward", "status": "ok"},
        {"label": "small", "context_length": 512, "mode": "train_step", "status": "oom"},
        {"label": "large", "context_length": 256, "mode": "train_step", "status": "skipped (budget)"},
    ])
    text = KP.coverage_text(summary, longest=True)
    assert "Profiled 2 of 4" in text and "small at 512 (train_step)" in text and "skipped (budget)" in text
    assert "small 256 (512 ran out of memory)" in text
    fits = KP.longest_fit(summary).set_index("label")
    assert fits.loc["small", "longest_fit"] == 256 and fits.loc["small", "oom_at"] == 512
    assert pd.isna(fits.loc["large", "longest_fit"])
    cov = KP.coverage_table(summary).set_index(["label", "context_length"])
    assert cov.loc[("small", 512), "train_step"] == "oom"


def test_tool_note_says_which_profiler():
    assert "not installed" in KP.tool_note(nsys=False, device="cuda")
    assert "nsys profile" in KP.tool_note(nsys=True, device="cuda")
    assert "CPU operators" in KP.tool_note(nsys=False, device="cpu")


def test_timeline_from_cpu_and_cuda_traces(sweep, tmp_path):
    plan, _, _, trace_dir = sweep
    fig = KP.plot_step_timeline(BP.trace_file(trace_dir, plan.trace_point()))
    assert fig.axes[0].get_xlabel().startswith("time since step start")
    assert "CPU operators" in fig.axes[0].get_title()
    path = tmp_path / "cuda.json.gz"
    write_cuda_trace(path)
    fig = KP.plot_step_timeline(path, step=0)
    assert "GPU kernels" in fig.axes[0].get_title()
