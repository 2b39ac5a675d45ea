"""Notebook 05's rendering, from hand-made rows and from a real CPU point."""

from __future__ import annotations

import pandas as pd

from systems.analysis.attention_memory import attention_memory_accounting
from systems.bench.attention import AttentionPoint, run_attention_point
from systems.report import attention_compile as report

GIB = 2**30


def test_decomposition_of_a_cpu_point_finds_three_score_sized_tensors():
    row = {**run_attention_point(AttentionPoint(4, 64, 8), device="cpu", n_forward=1, n_backward=1, warmup=1),
           "status": "ok"}
    df, text = report.decomposition_text([row], device="cpu")
    assert "**3.000** score-sized tensors" in text and "the accounting's 3" in text
    assert df["bytes"].iloc[-1] == 0  # nothing left unexplained on a CPU
    assert report.decomposition_text([], device="cpu") == (None, "")


def test_accounting_text_says_which_phase_does_not_fit():
    acct = attention_memory_accounting(batch=8, seq=32768, d=16, free_bytes=70 * GIB)
    text = report.accounting_text(acct, oom_phase="warm-up backward", free_note="torch.cuda.mem_get_info")
    assert "forward peaks at 64.08 GiB" in text and "and fits" in text
    assert "4 score-sized tensors" in text and "128 GiB, which does **not** fit" in text


def test_sweep_table_picks_one_memory_unit():
    rows = [{"d": 16, "seq": 256, "status": "ok", "mem_before_backward_bytes": 3 * 2**20, "peak_rise_bytes": 5 * 2**20,
             "saved_bytes": 2**21},
            {"d": 16, "seq": 512, "status": "oom", "oom_phase": "warm-up backward"}]
    table = report.sweep_table(rows)
    assert list(table.columns[-3:]) == ["mem before bwd MiB", "peak rise MiB", "saved MiB"]
    assert table.loc[0, "peak rise MiB"] == 5 and pd.isna(table.loc[1, "saved MiB"])


def _rec(model, mode, compiled, step):
    return {"model": model, "mode": mode, "compile": "blocks" if compiled else "none", "status": "ok",
            "batch_size": 4, "context_length": 512, "step_median_s": step, "forward_median_s": step / 3,
            "backward_median_s": step / 2, "first_step_s": step + 5, "first_step_overhead_s": 5.0}


def test_model_compile_table_uses_the_handouts_size_names_and_the_text_compares_forward_and_step():
    recs = [_rec("xl-2025", "forward", False, 0.3), _rec("xl-2025", "forward", True, 0.1),
            _rec("xl-2025", "train_step", False, 1.0), _rec("xl-2025", "train_step", True, 0.8)]
    table = report.model_compile_table(recs, handout="2025")
    assert set(table["size"]) == {"xl"}
    text = report.model_compile_text(table, recs, smoke=False)
    assert "forward (inference): xl 3.00×" in text and "helps the inference forward more" in text
    recs[1] = _rec("xl-2025", "forward", True, 0.3)  # no forward gain: the text must not claim one
    text = report.model_compile_text(report.model_compile_table(recs, handout="2025"), recs, smoke=False)
    assert "helps the inference forward no more" in text
