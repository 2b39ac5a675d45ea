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


def test_forward_and_step_gains_are_compared_over_the_sizes_both_ran():
    # small and medium ran both ways; large's step ran but its forward was not compiled. Over the
    # shared sizes the step gains more (1.6×, 1.8×) than the forward (1.5×, 1.5×), though large's
    # low step gain alone would pull the step's median under the forward's.
    recs = []
    for model, fwd_gain, step_gain in (("small", 1.5, 1.6), ("medium", 1.5, 1.8), ("large", None, 1.1)):
        recs += [_rec(model, "train_step", False, 1.0), _rec(model, "train_step", True, 1.0 / step_gain),
                 _rec(model, "forward", False, 0.3)]
        if fwd_gain:
            recs.append(_rec(model, "forward", True, 0.3 / fwd_gain))
    text = report.model_compile_text(report.model_compile_table(recs, handout="2025"), recs, smoke=False)
    assert "over the 2 sizes both ran, compiling helps the inference forward no more (median 1.50×)" in text
    assert "(median 1.70×)" in text


def test_a_point_whose_bytes_fit_but_failed_is_explained_by_the_allocators_blocks():
    gib = 2**30
    # d 16, seq 32,768, batch 8, fp32: a score-sized tensor is 32 GiB, the backward's four 128 GiB
    acct = report.attention_memory_accounting(batch=8, seq=32768, d=16, dtype="fp32", device="cuda",
                                              free_bytes=139 * gib)
    error = ("CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "10.93 GiB is free. Of the allocated memory 96.16 GiB is allocated by PyTorch, and 31.98 GiB is "
             "reserved by PyTorch but unallocat")
    text = report.accounting_text(acct, oom_phase="warm-up backward", free_note="measured", error=error)
    assert "128 GiB, which fits" in text
    assert ("By bytes it fits; by the allocator's blocks it does not. Asked for 32.00 GiB more, PyTorch held "
            "31.98 GiB reserved but unallocated (about one score-sized block") in text
    assert "which had 10.93 GiB left" in text
    # without the allocator's sizes, or where the bytes do not fit, nothing is claimed about blocks
    assert "allocator's blocks" not in report.accounting_text(acct, oom_phase="warm-up backward", free_note="m")
    tight = report.attention_memory_accounting(batch=8, seq=32768, d=16, dtype="fp32", device="cuda",
                                               free_bytes=100 * gib)
    assert "allocator's blocks" not in report.accounting_text(tight, oom_phase="warm-up backward", free_note="m",
                                                              error=error)
