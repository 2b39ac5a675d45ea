"""Notebook 06's tables, figure and answers (systems/report/flash_attention.py) from synthetic rows
shaped like the full profile's: every number in the text comes from the rows, every grid point keeps
its table line, and no figure panel is empty."""

import matplotlib
import pandas as pd
import pytest

from systems.bench.flash import geomean_ratios
from systems.report import flash_attention as report

matplotlib.use("Agg")


def _row(impl, dtype, d, seq, e2e, *, status="ok", dot=None, error=None):
    row = dict(impl=impl, dtype=dtype, d=d, seq=seq, batch=1, heads=1, causal=True, status=status, error=error,
               dot=dot or (dtype if dtype != "fp32" else {"triton": "tf32x3"}.get(impl, "ieee")))
    if status == "ok":
        for p, share in (("fwd", 0.3), ("bwd", 0.7), ("e2e", 1.0)):
            row.update({f"{p}_ms": e2e * share, f"{p}_p10_ms": e2e * share * 0.9, f"{p}_p90_ms": e2e * share * 1.1,
                        f"{p}_tflops": 1.0 / (e2e * share)})
    return row


@pytest.fixture
def sweep():
    rows = []
    for seq in (1024, 4096):
        scale = (seq / 1024) ** 2
        for d in (64, 128):
            rows += [_row("triton", "bf16", d, seq, 1.0 * scale), _row("naive", "bf16", d, seq, 3.0 * scale),
                     _row("sdpa_cudnn", "bf16", d, seq, 1.2 * scale)]
            rows += [_row("triton", "fp32", d, seq, 1.0 * scale), _row("triton_ieee", "fp32", d, seq, 4.0 * scale),
                     _row("naive", "fp32", d, seq, 2.0 * scale)]
    rows.append(_row("triton", "bf16", 64, 65536, 500.0))
    rows.append(_row("naive", "bf16", 64, 65536, 0, status="oom", error="CUDA out of memory"))
    rows.append(_row("sdpa_cudnn", "bf16", 64, 65536, 0, status="skipped (budget)", error="past the budget"))
    return pd.DataFrame(rows)


def test_latency_table_orders_ours_first_and_keeps_every_point(sweep):
    table = report.latency_table(sweep, "e2e", ours="triton")
    assert list(table.columns[:3]) == ["triton ms", "triton_ieee ms", "naive ms"]  # ours, our variants, baselines
    assert table.loc[("bf16", 64, 1024), "naive / triton"] == pytest.approx(3.0)
    assert table.loc[("bf16", 64, 1024), "triton p10"] == pytest.approx(0.9)
    # seq 65536: only ours ran; its line stays, the others' cells are empty
    line = table.loc[("bf16", 64, 65536)]
    assert line["triton ms"] == 500.0 and pd.isna(line["naive ms"])
    bf16 = report.latency_table(sweep[sweep.dtype == "bf16"], "fwd", ours="triton")
    assert list(bf16.columns[:3]) == ["triton ms", "naive ms", "sdpa_cudnn ms"]


def test_status_table_groups_what_did_not_run(sweep):
    table = report.status_table(sweep).set_index("impl")
    assert table.loc["naive", "status"] == "oom" and table.loc["naive", "seq from"] == 65536
    assert table.loc["sdpa_cudnn", "reason"] == "past the budget"
    assert report.status_table(sweep[sweep.status == "ok"]).empty


def test_figure_has_a_panel_per_measured_dtype_and_head_dim(sweep):
    ceilings = [dict(dot="bf16", tflops=700.0, what="m"), dict(dot="ieee", tflops=50.0, what="m"),
                dict(dot="tf32", tflops=400.0, what="m")]
    fig = report.plot_tflops(sweep, ceilings=ceilings, title="t")
    axes = fig.axes
    assert len(axes) == 4 and all(ax.lines for ax in axes)  # (bf16, fp32) x (64, 128), none empty
    fp32_ceilings = [line.get_ydata()[0] for line in axes[2].lines if line.get_linestyle() == ":"]
    assert sorted(fp32_ceilings) == [50.0, 400.0]
    assert all(ax.get_xlabel() == "sequence length" for ax in axes)


def test_benchmark_answer_reads_the_rows(sweep):
    text = report.benchmark_answer(sweep, ours="triton", device="NVIDIA H100", handout="2026")
    assert "one B200" in text and "on NVIDIA H100" in text
    # bf16: ours 3x faster than naive at every common point; naive ran out of memory at 65536
    assert "faster than `naive` end to end at 4 of 4 points" in text and "3x (d = 64)" in text
    # the reason of each missing point from its status; ours ran everywhere, so it is not listed
    assert "`naive` did not run at 1 points (seq 65536, oom: out of memory)" in text
    assert "`triton` did not run" not in text
    # fp32, our default (tf32x3): naive / ours = 2 everywhere; with IEEE dots 0.5: slower everywhere
    assert text.count("faster than `naive` end to end at 4 of 4 points") == 2 and "2x (d = 128)" in text
    # the dots differ (tf32x3 against IEEE), so the like-for-like variant is named: naive / triton_ieee = 0.5
    assert ("(ours multiplies in tf32x3, `naive` in ieee; like for like, `triton_ieee` (ieee) is faster at 0 of 4 "
            "points, naive's time over its 0.5x-0.5x)") in text
    assert text.count("like for like") == 1  # bf16's dots are alike
    # where the fp32 paragraph follows, it alone compares like for like
    short = report.benchmark_answer(sweep, ours="triton", device="NVIDIA H100", handout="2026", like_for_like=False)
    assert "(ours multiplies in tf32x3, `naive` in ieee: the fp32 paragraph below compares like for like)" in short
    assert "`triton_ieee`" not in short
    ieee = report.benchmark_answer(sweep, ours="triton_ieee", device="NVIDIA H100", handout="2026")
    assert "at 0 of 4 points" in ieee and "ours is slower at 4 points, seq 1024-4096" in ieee
    assert "one H100" in report.benchmark_answer(sweep, ours="triton", device="x", handout="2025")


def test_fp32_answer_says_what_the_data_say(sweep):
    ceilings = [dict(dot="ieee", tflops=51.0, what="cuBLAS 8192^3 matmul"), dict(dot="tf32", tflops=410.0, what="x")]
    kernels = pd.DataFrame([dict(name="sm90_xmma_gemm_f32f32_f32f32_f32_nn", category="matmul", calls=6, ms=2.0,
                                 tf32=False, seq=4096, d=64)])
    text = report.fp32_answer(sweep, ceilings=ceilings, kernels=kernels, long_from=1024)
    assert "`triton_ieee` takes 2x naive's end-to-end time" in text and "`triton` takes 0.5x" in text
    assert "51 TFLOP/s in ieee, 410 TFLOP/s in tf32" in text
    assert "With `triton_ieee` both sides multiply in IEEE fp32" in text and "ours is the slower" in text
    assert "tf32x3 (`triton`)" in text and "0.25x the `ieee` kernels' time" in text
    assert "Our default (`triton`) ran tf32x3 dots" in text
    # 4096^2 pairs x 64 x 2 matmuls x 2 FLOPs, x 3 for forward + backward, over 2 ms
    assert f"{3 * 4 * 4096 * 4096 * 64 / 2e-3 / 1e12:.3g} TFLOP/s of the full score matrix" in text
    tf32 = report.fp32_answer(sweep, ceilings=ceilings, kernels=kernels.assign(tf32=True), long_from=1024)
    assert "both sides multiply in IEEE fp32" not in tf32 and "with TF32 in their names" in tf32


def test_sdpa_and_leaderboard_answers_label_our_targets():
    ratios = pd.DataFrame({"fwd vs sdpa_cudnn": [2.0, 0.5], "bwd vs sdpa_cudnn": [float("nan")] * 2})
    gm = pd.DataFrame([dict(**{"pass": "fwd", "baseline": "sdpa_cudnn", "points": 2, "missing": 0,
                               "geomean speed": 1.0, "our target": 1.0, "met": True}),
                       dict(**{"pass": "bwd", "baseline": "sdpa_cudnn", "points": 0, "missing": 2,
                               "geomean speed": float("nan"), "our target": 1.0, "met": None})])
    text = report.sdpa_answer(ratios, gm)
    assert "fwd 1.00x sdpa_cudnn (our target 1.0x: met)" in text and "bwd vs sdpa_cudnn: no point ran" in text
    assert "the project's, not the handout's" in text
    # a baseline that ran at part of the grid: the verdict names the points it covers
    ratios = pd.DataFrame({"fwd vs sdpa_cudnn": [2.0, 0.5, float("nan"), float("nan")]})
    text = report.sdpa_answer(ratios, geomean_ratios(ratios))
    assert "fwd 1.00x sdpa_cudnn over the 2 of 4 points where both ran (our target 1.0x: met)" in text
    lb = pd.DataFrame([dict(impl="triton", status="ok", e2e_ms=9.0), dict(impl="sdpa_cudnn", status="ok", e2e_ms=10.0)])
    text = report.leaderboard_answer(lb, gpu="NVIDIA H100")
    assert "**9.00 ms**" in text and "0.900x cuDNN's" in text and "our own target (not the handout's)" in text
    assert ": met" in text


def test_code_answers_come_from_the_checks():
    rows = [dict(impl=impl, dtype=dtype, dot=dtype if dtype != "fp32" else "ieee", device="cuda",
                 q_shape=[2, 10, 16], n_k=10, causal=causal, saves_lse=True, O=err, dQ=err, dK=err, dV=err, worst=err)
            for impl, dtype, err in (("flash_pytorch", "fp32", 1e-6), ("triton", "bf16", 5e-2)) for causal in (True, False)]
    table = report.check_table(rows)
    assert list(table["within"]) == [True, True, False, False]  # 5e-2 is past our bf16 bound, 3e-2
    answers = report.forward_answers(table, triton_where="on a GPU")
    assert set(answers) == {("flash_forward", "a"), ("flash_forward", "b"), ("flash_forward", "c")}
    assert "bf16 on cuda: worst error 5.0e-02 over 2 cases (our bound 3e-02: NOT held)" in answers[("flash_forward", "b")]
    assert "defaults to `False`" in answers[("flash_forward", "c")] and "0 hold our bound" in answers[("flash_forward", "c")]
    assert set(report.forward_answers(table[table.impl != "triton"], triton_where="x")) == {("flash_forward", "a")}
    assert "worst error 1.0e-06 over 2 cases" in report.backward_answer(table)


def test_prewarm_line_states_the_run_and_its_first_failure():
    ok = dict(calls=36, jobs=25, workers=15, seconds=61.4, failed=[])
    assert report.prewarm_line(ok).startswith("Compiled ahead: 36 forward + backward calls in 25 jobs over 15")
    assert "61 s" in report.prewarm_line(ok) and "failed" not in report.prewarm_line(ok)
    bad = {**ok, "failed": [dict(calls=[], error="Traceback ...\nRuntimeError: out of resources\n")]}
    assert "1 job(s) failed" in report.prewarm_line(bad)
    assert report.prewarm_line(bad).endswith("RuntimeError: out of resources")


def test_benchmark_answer_counts_a_point_inside_the_spread_as_neither_win_nor_loss():
    # _row spreads each point over +-10%: 1.0 against 1.05 ms lies inside, 1.0 against 3.0 does not
    rows = pd.DataFrame([_row("triton", "bf16", 64, 1024, 1.0), _row("naive", "bf16", 64, 1024, 1.05),
                         _row("triton", "bf16", 64, 4096, 1.0), _row("naive", "bf16", 64, 4096, 3.0),
                         _row("triton", "bf16", 128, 4096, 1.0), _row("naive", "bf16", 128, 4096, 0.97)])
    text = report.benchmark_answer(rows, ours="triton", device="x", handout="2026")
    assert ("faster than `naive` end to end at 1 of 3 points (within the noise, one median inside the other's "
            "p10-p90 range, at 2)") in text
    assert "ours is slower" not in text  # 0.97 against 1.0 is inside the spread too
    # rows without a spread (an older file's): compared by their medians, no tie claimed, no error
    bare = rows.assign(e2e_p10_ms=float("nan"), e2e_p90_ms=float("nan"))
    assert "faster than `naive` end to end at 2 of 3 points;" in report.benchmark_answer(
        bare, ours="triton", device="x", handout="2026")


def test_benchmark_answer_names_our_own_missing_points(sweep):
    skipped = pd.DataFrame([_row("triton", "bf16", 128, 65536, 0, status="skipped (budget)", error="past it"),
                            _row("triton", "bf16", 64, 131072, 0, status="skipped (budget)", error="past it")])
    text = report.benchmark_answer(pd.concat([sweep, skipped]), ours="triton", device="x", handout="2026")
    assert ("`triton` did not run at 2 points (seq 65536-131072, skipped (budget): the sweep's time budget ran out "
            "before them)") in text
    # a status without a stated reason shows its row's error
    odd = pd.DataFrame([_row("naive", "fp32", 64, 65536, 0, status="error", error="RuntimeError: boom")])
    assert "(seq 65536, error: RuntimeError: boom)" in report.benchmark_answer(
        pd.concat([sweep, odd]), ours="triton", device="x", handout="2026")
