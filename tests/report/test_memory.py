"""Notebook 04's rendering: the timeline drawing, and answers computed from hand-made rows."""

from __future__ import annotations

from types import SimpleNamespace

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
    text = report.timeline_answer({"train_step": ({"context_length": 128}, tl)}, cfg=get_config("debug"))
    # forward 3 -> 7 MiB (a ramp), backward 7 -> 5 MiB (falls from where the forward ended); the
    # optimizer only allocates (5 -> 5.5 MiB, never above where it ends): not a spike
    assert "The forward rises from 3.00 MiB to 7.00 MiB (peak 8.00 MiB)" in text
    assert "The backward falls from 7.00 MiB to 5.00 MiB (peak 9.25 MiB)" in text
    assert "falls in the **backward** phase" in text
    assert "only in part" in text and "the optimizer rises no higher than where it starts or ends" in text
    # the debug model's gradients are not what moved here, so no drop or backward is explained by them
    assert "zero_grad" not in text and "of gradients while freeing" not in text


def _timeline(levels_gib: list[float], spans: list[tuple[str, int, int]]):
    """A Timeline drawn by hand: the live bytes at each event and the phases' (name, first, last) events."""
    import numpy as np

    from systems.measure.memory import PhaseSpan, Timeline

    total = (np.asarray(levels_gib) * GIB).astype(np.int64)
    phases = [PhaseSpan(name, a, b, int(total[a:b + 1].max())) for name, a, b in spans]
    return Timeline(x=np.arange(len(total)), total=total, allocations=[], phases=phases, steps=[], device=0)


# a model of 2**28 fp32 parameters: 1 GiB of weights, and as much of gradients and of each AdamW moment
ONE_GIB_MODEL = SimpleNamespace(n_params=2**28)
SPANS = [("forward", 2, 3), ("backward", 4, 5), ("optimizer", 6, 7)]


def test_timeline_answer_short_context_backward_climbs():
    # start 4 GiB (weights, moments, old gradients); zero_grad frees the 1 GiB of gradients; the forward
    # keeps 0.5 GiB; the backward writes 1 GiB of gradients and frees those 0.5 GiB: 3.5 + 1 - 0.5 = 4
    tl = _timeline([4, 3, 3.25, 3.5, 4.5, 4, 5, 4], SPANS)
    text = report.timeline_answer({"train_step": ({"context_length": 128}, tl)}, cfg=ONE_GIB_MODEL)
    assert "starts from 4.00 GiB, 4.00× the 1.00 GiB of fp32 parameters" in text
    assert ("previous step's gradients, all allocated before recording began. Before the forward allocates anything "
            "it drops 1.00 GiB to 3.00 GiB") in text
    assert "`optimizer.zero_grad(set_to_none=True)`" in text
    assert ("The forward rises from 3.00 GiB to 3.50 GiB (peak 3.50 GiB): the 512 MiB it adds are the activations "
            "autograd saves") in text
    assert ("The backward rises from 3.50 GiB to 4.00 GiB (peak 4.50 GiB): it writes 1.00 GiB of gradients while "
            "freeing the 512 MiB the forward kept (3.50 GiB + 1.00 GiB − 512 MiB = 4.00 GiB), and the gradients "
            "outweigh what it frees, so memory climbs") in text
    assert "its spike of 1.00 GiB is one more parameter-sized fp32 buffer" in text
    assert "falls in the **optimizer** phase" in text
    # the backward climbs on from the forward: no peak between them, and the answer says so
    assert "only in part" in text and "the backward does not fall from where the forward ended" in text
    assert "a peak marks the boundary" not in text and "the optimizer is a short spike" in text


def test_timeline_answer_long_context_backward_falls():
    # the forward keeps 1.5 GiB, more than the 1 GiB of gradients: 4.5 + 1 - 1.5 = 4, a fall
    tl = _timeline([4, 3, 3.75, 4.5, 5.5, 4, 5, 4], SPANS)
    text = report.timeline_answer({"train_step": ({"context_length": 2048}, tl)}, cfg=ONE_GIB_MODEL)
    assert "The backward falls from 4.50 GiB to 4.00 GiB" in text
    assert "(4.50 GiB + 1.00 GiB − 1.50 GiB = 4.00 GiB), and what it frees outweighs the gradients" in text
    assert "So yes, the peaks tell each stage" in text and "a peak marks the boundary" in text


def test_timeline_answer_without_a_drop_names_no_gradients_freed():
    # a CPU profiler snapshot does not see the old gradients freed: the step starts where the forward does
    tl = _timeline([3, 3, 3.25, 3.5, 4.5, 4, 5, 4], SPANS)
    text = report.timeline_answer({"train_step": ({"context_length": 128}, tl)}, cfg=ONE_GIB_MODEL)
    assert "3.00× the 1.00 GiB of fp32 parameters" in text and "the weights and AdamW's state, all allocated" in text
    assert "zero_grad" not in text and "drops" not in text


def test_timeline_answer_says_why_the_table_peak_is_higher():
    fwd = _timeline([12.75, 17.25, 12.75], [("forward", 1, 2)])
    step = _timeline([4, 3, 3.25, 3.5, 4.5, 4, 5, 4], SPANS)
    rows = {"forward": {"context_length": 2048, "peak_gib": 17.5, "peak_source": "allocator", "status": "ok"},
            "train_step": {"context_length": 128, "peak_gib": 5.5, "peak_source": "allocator", "status": "ok"}}
    text = report.timeline_answer({"forward": (rows["forward"], fwd), "train_step": (rows["train_step"], step)},
                                  cfg=ONE_GIB_MODEL)
    assert ("These timeline peaks (17.25 GiB forward, 5.00 GiB training step) are below the peaks in the tables of "
            "(b) and (c) (17.50 GiB, 5.50 GiB), though both are read from the same measured step: the timeline adds up the bytes each allocation "
            "asked for") in text
    assert "`torch.cuda.max_memory_allocated`" in text and "multiple of 512 bytes" in text
    # these hand-drawn timelines list no allocations, so no block accounts for any of the gap
    assert ("raises the timeline peaks by 0.00 MiB of the forward's 256 MiB gap and 0.00 MiB of the training "
            "step's 512 MiB gap, leaving 256 MiB (forward) and 512 MiB (training step)") in text
    # on a CPU the table's peak is the timeline's own: nothing to explain
    same = {**rows["forward"], "peak_gib": 17.25, "peak_source": "profiler snapshot"}
    assert "timeline peaks" not in report.timeline_answer({"forward": (same, fwd)}, cfg=ONE_GIB_MODEL)


def test_peak_note_counts_the_gap_the_allocators_blocks_account_for():
    import numpy as np

    from systems.measure.memory import Allocation, PhaseSpan, Timeline

    # the weights: 100 MiB requested before recording, in a 101 MiB block the snapshot shows; one
    # activation of 50 MiB + 1 byte, freed before the snapshot, so only its 512-byte rounding is known
    weights = Allocation(addr=0, size=100 * MIB, start=0, end=None, preexisting=True, block_size=101 * MIB)
    act = Allocation(addr=1, size=50 * MIB + 1, start=1, end=2)
    total = np.array([100 * MIB, 150 * MIB + 1, 100 * MIB], dtype=np.int64)
    tl = Timeline(x=np.arange(3), total=total, allocations=[weights, act],
                  phases=[PhaseSpan("forward", 1, 2, int(total.max()))], steps=[], device=0)
    # by hand: the blocks peak at 101 MiB + 50 MiB + 512 bytes, 1 MiB + 511 bytes above the timeline's
    # 150 MiB + 1 byte; against a table peak of 153 MiB that leaves 2 MiB − 512 bytes. Exact integer bytes,
    # printed to two decimals of a MiB
    row = {"context_length": 128, "peak_gib": 153 * MIB / GIB, "peak_source": "allocator", "status": "ok"}
    text = report.timeline_answer({"forward": (row, tl)}, cfg=ONE_GIB_MODEL)
    assert "These timeline peaks (150 MiB forward) are below the peaks in the tables of (b) and (c) (153 MiB)" in text
    assert ("raises the timeline peaks by 1.00 MiB of the forward's 3.00 MiB gap, leaving 2.00 MiB (forward) that "
            "the sizes the snapshot records do not account for.") in text
    # a table peak the blocks reach exactly: nothing is left
    covered = {**row, "peak_gib": (151 * MIB + 512) / GIB}
    text = report.timeline_answer({"forward": (covered, tl)}, cfg=ONE_GIB_MODEL)
    assert "raises the timeline peaks by 1.00 MiB of the forward's 1.00 MiB gap; they cover the whole gap." in text
    # a table peak below the blocks' (a block counted past the tables' window): more than the gap (1 MiB - 1 byte)
    short = {**row, "peak_gib": 151 * MIB / GIB}
    text = report.timeline_answer({"forward": (short, tl)}, cfg=ONE_GIB_MODEL)
    assert "raises the timeline peaks by more than the forward's 1,024 KiB gap; they cover the whole gap." in text


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
    # under the handout's assumption bisection reaches the same floor at less compute: both are named
    assert "Recursive bisection gets there" in text and "O(N log N) block forwards" in text
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
