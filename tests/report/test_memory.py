"""Notebook 04's rendering: the timeline drawing, and answers computed from hand-made rows."""

from __future__ import annotations

import pytest

from systems.config import get_config
from systems.report import memory as report
from tests.measure.test_memory import _synthetic_snapshot

GIB = 2**30
MIB = 2**20


def test_render_timeline_writes_png_and_html(tmp_path):
    tl = report.render_timeline(_synthetic_snapshot(), tmp_path / "t.png", top_k=2)
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "snapshot.pickle" in (tmp_path / "t.html").read_text()
    assert tl.peak_bytes == int(9.25 * MIB)


def test_timeline_answer_checks_each_stage_on_the_curve():
    from systems.measure.memory import build_timeline

    tl = build_timeline(_synthetic_snapshot())
    text = report.timeline_answer({"train_step": ({"context_length": 128}, tl)})
    # forward 3 -> 7 MiB (a ramp), backward peaks at 9.25 and ends at 5 (a descent); the optimizer
    # only allocates (5 -> 5.5 MiB, never above where it ends): not a spike
    assert "the forward (rises from 3.00 MiB to 7.00 MiB, peak 8.00 MiB)" in text
    assert "falls in the **backward** phase" in text
    assert "only in part" in text and "not so for the optimizer" in text


def test_fmt_bytes_picks_a_unit():
    assert report.fmt_bytes(3 * GIB) == "3.00 GiB"
    assert report.fmt_bytes(80 * MIB) == "80.00 MiB" and report.fmt_bytes(512 * MIB) == "512 MiB"
    assert report.fmt_bytes(2 * MIB, unit_of=GIB) == "0.00 GiB"


def _row(mode, precision, context, peaks, status="ok"):
    """A peak-sweep row; ``peaks`` are the cumulative high-water marks (GiB) up to each phase's end."""
    row = {"mode": mode, "precision": precision, "context_length": context, "batch_size": 4, "status": status}
    if status == "ok":
        row.update({f"peak_{p}_gib": v for p, v in zip(("forward", "backward", "optimizer"), peaks)})
        row["peak_gib"] = max(peaks)
        row["start_gib"] = 50.0 if mode == "train_step" else 12.7
    return row


def _sweep():
    return [_row("forward", "fp32", 128, [13.0]), _row("forward", "bf16", 128, [13.1]),
            _row("train_step", "fp32", 128, [51.0, 51.4, 63.9]), _row("train_step", "bf16", 128, [52.0, 52.3, 63.9]),
            _row("train_step", "fp32", 2048, [], status="oom")]


def test_peak_phase_is_where_the_cumulative_high_water_mark_stops_rising():
    assert report.peak_phase(_row("train_step", "fp32", 1, [51.0, 51.4, 63.9])) == "optimizer"
    assert report.peak_phase(_row("train_step", "fp32", 1, [51.0, 70.0, 70.0])) == "backward"


def test_precision_answer_names_the_optimizer_when_it_sets_the_peak():
    cfg = get_config("2.7B")
    text = report.precision_answer(_sweep(), cfg=cfg, label="xl")
    assert "**optimizer** phase" in text and "adamw_foreach_" in text
    assert "out of memory: train_step fp32 at context 2048".lower() in text.lower()
    assert "at most 1%" in text and "not significant" in text
    table = report.precision_table(_sweep())
    assert list(table["bf16 / fp32"].round(4)[:2]) == [round(13.1 / 13.0, 4), 1.0]
    # a step whose peak is in the backward says so, and does not blame the optimizer
    rows = [_row("train_step", "fp32", 128, [5.0, 9.0, 9.0]), _row("train_step", "bf16", 128, [4.0, 7.0, 7.0])]
    text = report.precision_answer(rows, cfg=cfg, label="xl")
    assert "**backward** phase" in text and "adamw_foreach_" not in text and "significant" in text


def test_peak_table_has_two_numbers_per_context():
    table = report.peak_table(_sweep(), "fp32")
    assert list(table["context"]) == [128, 2048]
    assert table.loc[0, "forward peak GiB"] == 13.0 and table.loc[0, "train step peak GiB"] == 63.9
    assert table.loc[1, "train step status"] == "oom"


def _groups():
    # forward + backward peaks differ by GiB; the AdamW step's peak is the same ~64 GiB for every k
    return [{"group_size": k, "n_groups": 32 // k, "n_layers": 32, "status": "ok", "activation_peak_bytes": int(a * GIB),
             "peak_optimizer_bytes": int(63.9 * GIB) + k * MIB, "peak_bytes": int(max(a, 63.9) * GIB), "step_ms": 2000.0}
            for k, a in ((1, 55.0), (2, 58.5), (4, 71.5))] + [
        {"group_size": 8, "n_groups": 4, "n_layers": 32, "status": "oom"}]


def test_groups_answer_ranks_by_the_activation_peak_not_the_optimizer_tie():
    block = {"n_layers": 32, "residual_bytes": 80 * MIB, "saved_bytes": 4 * GIB, "batch_size": 4,
             "context_length": 2048}
    text = report.groups_answer(_groups(), block=block, label="xl")
    assert "**k = 1, 55.00 GiB**" in text
    assert "58.50 GiB at k = 2" in text and "out of memory at k = 8" in text
    assert "above the forward + backward peak for k = 1, 2" in text  # where the total would tie
    assert f"{(32 * 80 / 4096) ** 0.5:.2f}" in text  # k* from the block's measured A and r
    table = report.groups_table(_groups(), block=block)
    assert table.loc[0, "fwd+bwd − lowest GiB"] == 0 and table.loc[1, "fwd+bwd − lowest GiB"] == pytest.approx(3.5)
    # the model: 16 r + 2 A against 32 r + A, i.e. A - 16 r more at k = 2
    assert table.loc[1, "model − model at lowest GiB"] == pytest.approx((4 * GIB - 16 * 80 * MIB) / GIB)
    assert "no group size fits" in report.groups_answer(_groups()[3:], block=block, label="xl").lower()


def test_plan_answer_shows_the_runner_and_the_measured_strategies():
    rows = [{"strategy": s, "label": s, "n_layers": n, "rise_bytes": b * MIB, "forwards_per_block": f,
             "block_forwards": int(f * n), "step_ms": 1.0}
            for n, scale in ((8, 1), (16, 2)) for s, b, f in
            (("none", 100 * scale, 1.0), ("one_level", 40 * scale ** 0.5, 2.0), ("nested", 30 + scale, 3.0),
             ("chain", 29, 5.5 * scale))]
    text = report.plan_answer(rows)
    assert "def _run_chain" in text and "ChainCheckpointing.__call__" in text
    assert "**O(1)**" in text and "**O(N²)**" in text
    assert "2.00× (none)" in text and "1.00× (chain)" in text
    assert len(report.strategies_table(rows)) == 8


def test_largest_answer_names_the_attention_scores_by_size(tmp_path):
    import pandas as pd

    cfg = get_config("2.7B")
    scores = 4 * cfg.n_heads * 2048 * 2048 * 4
    table = pd.DataFrame([{"size_bytes": scores, "size_mib": scores / MIB, "tensor (by size)":
                           report.known_tensors(cfg, batch_size=4, context=2048)[scores], "count": 64,
                           "phase": "forward", "source": "attention/naive.py:21 naive_attention",
                           "stack": "attention/naive.py:21 naive_attention <- systems/model.py:89 forward"}])
    text = report.largest_answer(table, {"context_length": 2048, "precision": "fp32"})
    assert "**2,048.0 MiB**" in text and "(b, h, T, T) attention scores, fp32" in text
    assert "`attention/naive.py:21 naive_attention` ×64" in text and "systems/model.py:89 forward" in text


def test_timeline_links_describe_each_picture(tmp_path):
    figures = tmp_path / "figures"
    timelines = {"train_step": ({"context_length": 128}, None)}
    text = report.timeline_links(timelines, figures=figures, stem="04_memory", out_dir=tmp_path)
    assert text == ("**train_step**, context 128: ![active memory over the train step, context 128, by allocation]"
                    "(figures/04_memory_timeline_train_step.png) "
                    "([memory_viz page](figures/04_memory_timeline_train_step.html))")
    assert report.timeline_links({}, figures=figures, stem="04_memory", out_dir=tmp_path).startswith("No timeline")
