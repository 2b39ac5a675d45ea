"""systems.report.notebook: the context every notebook sets up, its answer records, and the table
formatting the report's tables go through."""

import json
import math
import re

import pandas as pd
import pytest
import torch

from systems.report import notebook as nb


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# GPU 0's used memory as the driver counts it (physical GPU 0: run without CUDA_VISIBLE_DEVICES)
_GPU0_USED_MIB = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
_SETUP_THEN_GPU_MEMORY = f"""
import subprocess, sys
from systems.report import notebook as nb
nb.setup(name="08_sharding_fsdp", profile="full", out_dir=sys.argv[1], gpus_in_ranks=sys.argv[2] == "1")
print(subprocess.run({_GPU0_USED_MIB!r}, capture_output=True, text=True, check=True).stdout.strip())
"""


def _gpu0_used_mib() -> int:
    import subprocess

    return int(subprocess.run(_GPU0_USED_MIB, capture_output=True, text=True, check=True).stdout.strip())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_setup_of_a_rank_notebook_makes_no_cuda_context(tmp_path):
    # each setup in a fresh process, which reads GPU 0's used memory while it is alive; the control
    # (pace measured in-process) must show its context's memory, or the check could not see one
    import subprocess
    import sys

    def used_after_setup(gpus_in_ranks: bool) -> int:
        out = subprocess.run([sys.executable, "-c", _SETUP_THEN_GPU_MEMORY, str(tmp_path), "1" if gpus_in_ranks else "0"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.strip().splitlines()[-1])

    base = _gpu0_used_mib()
    control, ranks = used_after_setup(False), used_after_setup(True)
    assert control - base > 100, (base, control)  # a CUDA context holds hundreds of MiB
    assert ranks - base < 50, (base, ranks)


def test_setup_makes_folders_and_names_the_run_without_missing_fields(tmp_path, capsys):
    ctx = nb.setup(name="01_benchmarking", profile="smoke", out_dir=tmp_path, handout="2025")
    assert ctx.figures.is_dir() and ctx.results.is_dir()
    assert ctx.result_path("timings") == tmp_path / "results" / "01_benchmarking_timings.jsonl"
    line = capsys.readouterr().out
    assert line.startswith("**Run:** profile `smoke`, 2025 handout")
    # On this CPU machine driver and CUDA are None; the line leaves them out instead of printing None.
    assert "None" not in line
    assert f"torch `{ctx.env['torch']}`" in line
    assert re.search(r"; host pace [0-9.]+ us per small op issued back to back \([0-9.]+-[0-9.]+, ", line)


@pytest.mark.parametrize("kwargs, message", [
    ({"profile": "fast", "handout": "2026"}, "profile"),
    ({"profile": "smoke", "handout": "2024"}, "2024"),
])
def test_setup_rejects_bad_parameters_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        nb.setup(name="01_benchmarking", out_dir=tmp_path, **kwargs)


def test_answer_and_not_run_are_recorded_under_the_index_anchor(tmp_path, capsys):
    ctx = nb.setup(name="01_benchmarking", profile="smoke", out_dir=tmp_path, handout="2026", show_env=False)
    nb.answer(ctx, "benchmarking_script", "b", "forward 1 ms")
    nb.not_run(ctx, "benchmarking_script", "c", "smoke profile")
    rows = _rows(ctx.result_path("deliverables"))
    assert [(r["problem"], r["part"], r["status"], r["reason"]) for r in rows] == [
        ("benchmarking_script", "b", "answered", None),
        ("benchmarking_script", "c", "not run", "smoke profile"),
    ]
    out = capsys.readouterr().out
    # The rendered anchor is the one the row carries, so the index's link lands on the answer.
    assert f'<a id="{rows[0]["anchor"]}"></a>' in out and "forward 1 ms" in out


def test_an_answer_quoting_another_runs_rows_names_that_run(tmp_path, capsys):
    ctx = nb.setup(name="10_fast_train_step", profile="smoke", out_dir=tmp_path, handout="2026", show_env=False)
    elsewhere = {"git_commit": "124754b", "gpu": "NVIDIA H200", "gpu_count": 2}
    nb.answer(ctx, "leaderboard", "", "- 5.5 s per step\n- 2 GPUs", measured_by=elsewhere)
    row = _rows(ctx.result_path("deliverables"))[0]
    assert row["measured_by"] == elsewhere and row["env"]["git_commit"] != "124754b"
    # a list answer starts on its own line, else Markdown glues its first item to the label
    assert "**leaderboard.**\n\n- 5.5 s per step" in capsys.readouterr().out


def test_a_misspelt_problem_fails_in_the_notebook(tmp_path):
    ctx = nb.setup(name="01_benchmarking", profile="smoke", out_dir=tmp_path, show_env=False)
    with pytest.raises(KeyError, match="benchmarking_scrip"):
        nb.answer(ctx, "benchmarking_scrip", "b", "x")


def test_format_table_formats_each_column_for_reading():
    df = pd.DataFrame({
        "context": [128, 2048, 16384],                # integers: separators, never "2.05e+03"
        "ms": [1.234, 12.5, 150.0],                   # typical value 12.5: one decimal
        "error": [1e-6, 3e-7, float("nan")],          # all tiny: scientific, NaN as a dash
        "label": ["a", None, "c"],
        "fits": [True, False, True],
    })
    out = nb.format_table(df)
    assert list(out["context"]) == ["128", "2,048", "16,384"]
    assert list(out["ms"]) == ["1.2", "12.5", "150.0"]
    assert list(out["error"]) == ["1.00e-06", "3.00e-07", "—"]
    assert list(out["label"]) == ["a", "—", "c"]
    assert list(out["fits"]) == ["yes", "no", "yes"]


def test_format_table_explicit_formats_win_and_missing_stays_a_dash():
    df = pd.DataFrame({"ratio": [1.13456, None]})
    out = nb.format_table(df, {"ratio": "{:.2f}x"})
    assert list(out["ratio"]) == ["1.13x", "—"]


def test_an_all_missing_numeric_column_is_dashes():
    df = pd.DataFrame({"x": [math.nan, math.nan]})
    assert list(nb.format_table(df)["x"]) == ["—", "—"]


def test_show_says_an_empty_table_is_empty(capsys):
    nb.show(pd.DataFrame(columns=["impl", "reason"]), caption="points that did not run")
    assert capsys.readouterr().out.strip() == "*points that did not run*: none."


def test_a_saved_figure_is_described_by_its_titles_and_closed(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = nb.setup(name="01_benchmarking", profile="smoke", out_dir=tmp_path, handout="2026", show_env=False)
    fig, (left, right) = plt.subplots(1, 2)
    fig.suptitle("Step time")
    left.set(title="forward", xlabel="context", ylabel="ms")
    right.set(xlabel="context")
    assert nb.figure_description(fig) == "Step time | forward; x: context; y: ms | x: context"
    nb.save_figure(fig, ctx, "phases")
    assert (ctx.figures / "01_benchmarking_phases.png").read_bytes().startswith(b"\x89PNG")
    assert not plt.fignum_exists(fig.number)  # closed: the inline backend will not show it a second time
    assert nb.figure_description(plt.figure()) == "a figure"


def test_join_words_reads_as_a_list_in_prose():
    assert nb.join_words(["a"]) == "a"
    assert nb.join_words(["a", "b"]) == "a and b"
    assert nb.join_words(["a", "b", "c"]) == "a, b and c"


def test_value_range_collapses_equal_ends_and_spells_signed_ranges_with_to():
    assert nb.value_range([1.04, 0.99, 1.0], "{:.2f}") == "0.99–1.04"
    assert nb.value_range([1.001, 0.999], "{:.2f}") == "1.00"  # both ends read the same
    assert nb.value_range([-0.12, 0.405], "{:+.1%}", signed=True) == "-12.0% to +40.5%"


@pytest.mark.parametrize("n, text", [
    (3_406_809_600, "3.41 B"),  # the 2026 xl
    (1_998_000_000, "2.00 B"),  # trailing zeros kept: three significant figures, not '2 B'
    (12_800_000_000, "12.8 B"),
    (128_625_408, "129 M"),
    (850_000, "0.850 M"),
])
def test_param_count_gives_three_significant_figures(n, text):
    assert nb.param_count(n) == text


def test_noise_side_names_the_median_inside_the_others_spread():
    assert nb.noise_side({"a": (10.0, 9.0, 11.0), "b": (10.5, 10.2, 12.0)}) == "b"  # only b's inside a's range
    assert nb.noise_side({"a": (10.0, 9.9, 10.1), "b": (10.05, 9.0, 11.0)}) == "a"  # both inside: a, named first
    # ranges that overlap (9-10.6 against 10.5-12) with neither median inside the other's: beyond the noise
    assert nb.noise_side({"a": (9.5, 9.0, 10.6), "b": (11.0, 10.5, 12.0)}) is None


def test_spread_measured_needs_every_median_and_percentile():
    assert nb.spread_measured({"a": (10.0, 9.0, 11.0), "b": (10.5, 10.2, 12.0)})
    assert not nb.spread_measured({"a": (10.0, 9.0, None), "b": (10.5, 10.2, 12.0)})  # a row without its p90
    assert not nb.spread_measured({"a": (10.0, 9.0, 11.0), "b": (10.5, float("nan"), 12.0)})  # a NaN cell


def test_within_noise_is_a_verdict_only_where_both_spreads_were_measured():
    assert nb.within_noise({"a": (10.0, 9.0, 11.0), "b": (10.5, 10.2, 12.0)}) is True
    assert nb.within_noise({"a": (9.5, 9.0, 10.6), "b": (11.0, 10.5, 12.0)}) is False
    # a NaN p10 fails every comparison: noise_side alone would call the two apart
    assert nb.within_noise({"a": (9.5, float("nan"), 10.6), "b": (11.0, 10.5, 12.0)}) is None


def test_step_spread_reads_a_rows_median_and_percentiles():
    row = {"step_ms": 10.0, "step_ms_p10": 9.0, "step_ms_p90": 11.0, "us": 5.0}
    assert nb.step_spread(row) == (10.0, 9.0, 11.0)
    assert nb.step_spread(row, key="us") == (5.0, None, None)  # missing percentiles read None
    assert nb.step_spread(pd.Series(row)) == (10.0, 9.0, 11.0)
