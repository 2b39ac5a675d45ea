"""Notebook 05's rendering, from hand-made rows and from a real CPU point."""

from __future__ import annotations

import pandas as pd

from systems.analysis.attention_memory import attention_memory_accounting
from systems.bench.attention import SKIPPED_PAST_OOM, AttentionPoint, run_attention_point
from systems.bench.budget import SKIPPED
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


def _rec(model, mode, compiled, step, **extra):
    return {"model": model, "mode": mode, "compile": "blocks" if compiled else "none", "status": "ok",
            "precision": "fp32", "tf32": True, "batch_size": 4, "context_length": 512, "step_median_s": step,
            "forward_median_s": step / 3, "backward_median_s": step / 2, "first_step_s": step + 5,
            "first_step_overhead_s": 5.0, **extra}


def test_model_compile_table_uses_the_handouts_size_names_and_the_text_compares_forward_and_step():
    recs = [_rec("xl-2025", "forward", False, 0.3), _rec("xl-2025", "forward", True, 0.1),
            _rec("xl-2025", "train_step", False, 1.0), _rec("xl-2025", "train_step", True, 0.8)]
    table = report.model_compile_table(recs, handout="2025")
    assert set(table["size"]) == {"xl"}
    text = report.model_compile_text(table, recs, handout="2025", smoke=False)
    assert "forward (inference): xl 3.00×" in text and "helps the inference forward more" in text
    recs[1] = _rec("xl-2025", "forward", True, 0.3)  # no forward gain: the text must not claim one
    text = report.model_compile_text(report.model_compile_table(recs, handout="2025"), recs, handout="2025",
                                     smoke=False)
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
    text = report.model_compile_text(report.model_compile_table(recs, handout="2025"), recs, handout="2025",
                                     smoke=False)
    assert ("Over the 2 sizes compiled in both modes, compiling helps the inference forward no more "
            "(median 1.50×)") in text
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


def _point(d, seq, status="ok", **extra):
    return {"d": d, "seq": seq, "batch_size": 2, "dtype": "fp32", "device": "cuda", "status": status, **extra}


def test_out_of_memory_lengths_are_compared_per_head_dim_in_plain_words():
    eager = [_point(16, 1024), _point(16, 2048, "oom"), _point(32, 1024), _point(32, 2048, "oom")]
    # compiled: d 16 fails one doubling later; d 32 ran 2048, then the budget stopped it
    compiled = [_point(16, 2048), _point(16, 4096, "oom"), _point(32, 2048),
                _point(32, 4096, "skipped (budget)", error="the sweep's time budget was spent")]
    assert report.oom_comparison_text(eager, compiled) == (
        "Eager attention first runs out of memory at seq 2,048 for every head dim; compiled attention first runs "
        "out of memory at seq 4,096 for d = 16 (d = 32 ran up to seq 2,048, then the sweep's time budget was "
        "spent), 2× the length at which eager does.")
    same = [_point(16, 1024), _point(16, 2048, "oom"), _point(32, 1024), _point(32, 2048, "oom")]
    assert report.oom_comparison_text(eager, same).endswith("for every head dim, the same length as eager.")
    mixed = [_point(16, 2048, "oom"), _point(32, 4096, "oom")]
    assert ("compiled attention first runs out of memory at seq 2,048 for d = 16, seq 4,096 for d = 32, against "
            "eager's: 1× at d = 16, 2× at d = 32.") in report.oom_comparison_text(eager, mixed)


def test_peaks_are_compared_at_the_longest_length_both_ran_in_score_sized_tensors():
    # batch 2, seq 1024, fp32: a score-sized tensor is 2 * 1024² * 4 B = 8 MiB; the six (batch, seq, d)
    # tensors at d 16 are 6 * 2 * 1024 * 16 * 4 B = 0.75 MiB. Eager's rise holds 4 score tensors, compiled's 2;
    # with 1 MiB allocated before, the peaks are 33.75 and 17.75 MiB: eager / compiled 1.90×.
    mib, vectors, score = 2**20, 786432, 8 * 2**20
    def ran(seq, n_score):
        rise = n_score * score + vectors
        return _point(16, seq, start_bytes=mib, peak_rise_bytes=rise, peak_bytes=mib + rise)
    eager = [ran(512, 4), ran(1024, 4), _point(16, 2048, "oom")]
    compiled = [ran(512, 2), ran(1024, 2), _point(16, 2048, start_bytes=mib, peak_rise_bytes=1, peak_bytes=mib + 1)]
    text = report.peak_comparison_text(eager, compiled, device="cuda")
    assert text.startswith("At seq 1,024, the longest length both ran,")
    assert "is 17.75 MiB compiled against 33.75 MiB eager at d = 16 (eager / compiled 1.90×)" in text
    assert ("that is 2.0 score-sized tensors (batch × seq × seq in fp32, 8.00 MiB each) compiled against "
            "4.0 eager") in text
    assert ("eager's backward holds P, dP, the dP·P temporary that CUDA softmax backward allocates and dS at once; "
            "the compiled backward holds 2.") in text
    # the same count both ways: no claim that compiling dropped any
    assert "holds" not in report.peak_comparison_text(eager, eager, device="cuda")
    assert report.peak_comparison_text(eager, [_point(16, 1024, "oom")], device="cuda") == ""
    # CPU kernels hold one score-sized tensor less, so eager's 4 are not the accounting's 3: no names
    assert "holds" not in report.peak_comparison_text(eager, compiled, device="cpu")


def test_quadratic_is_decided_by_the_fitted_exponent():
    # batch 2, fp32: a score-sized tensor is 8 seq² bytes, so saved = 8 seq² is one of them (P)
    quad = [_point(16, s, saved_bytes=8 * s * s) for s in (256, 512, 1024)]
    text = report.quadratic_text(quad, quad)
    assert "grows as seq^2.00" in text and "eager's saved memory: seq^2.00" in text
    assert "is 1.00 score-sized tensors at d = 16, seq = 1,024" in text and "stays quadratic in seq" in text
    # P plus a linear term as large as P at seq 512: the fit lands between 1 and 2
    mixed = [_point(16, s, saved_bytes=8 * s * s + 4096 * s) for s in (256, 512, 1024)]
    text = report.quadratic_text(quad, mixed)
    assert "between linear and quadratic" in text and "stays quadratic" not in text
    linear = [_point(16, s, saved_bytes=3 * s) for s in (256, 512, 1024)]
    text = report.quadratic_text(quad, linear)
    assert "seq^1.00" in text and "not the growth of a saved seq × seq matrix" in text
    assert report.quadratic_text(quad, quad[:1]) == ""


def test_model_compile_text_names_the_setting_the_uncompiled_sizes_and_why_the_largest_gain():
    # 2026: preset 2.7B is the handout's xl. small's eager forward runs at 20 TFLOP/s, large's at 60: the
    # largest gain (small, 0.3 / 0.1 = 3.00×) is at the lowest eager rate, so the text says why.
    recs = [_rec("small", "forward", False, 0.3, achieved_tflops=20.0, n_params=128_000_000),
            _rec("small", "forward", True, 0.1, achieved_tflops=60.0),
            _rec("large", "forward", False, 0.3, achieved_tflops=60.0),
            _rec("large", "forward", True, 0.2, achieved_tflops=90.0),
            _rec("2.7B", "forward", False, 0.5, n_params=3_406_809_600),
            {**_rec("2.7B", "forward", True, 0.5), "status": SKIPPED,
             "error": "compile-time budget: 37 s spent + ~2 s predicted > 39 s"}]
    text = report.model_compile_text(report.model_compile_table(recs, handout="2026"), recs, handout="2026",
                                     smoke=False)
    assert text.startswith("Setting: fp32 with TF32 matmuls, context 512, batch 4; compiled means each Transformer "
                           "block compiled on its own")
    assert ("Not compiled: xl (3.41 B parameters): inference forward (compile-time budget: 37 s spent + ~2 s "
            "predicted > 39 s); no compiled timings for it.") in text
    assert "2.7B" not in text and "The compile-time budget is the share" in text
    assert ("The largest gain, small's inference forward (3.00×), is where eager is least efficient: it runs its "
            "matmul FLOPs at 20 TFLOP/s against 60 for large") in text
    # where the largest gain is not at the lowest eager rate, no reason is given
    recs[2]["achieved_tflops"] = 10.0
    text = report.model_compile_text(report.model_compile_table(recs, handout="2026"), recs, handout="2026",
                                     smoke=False)
    assert "The largest gain" not in text


def test_a_size_compiled_in_one_measurement_says_which_timings_it_has():
    # 10B's eager train step ran out of memory, so its compiled train step was skipped (not a budget
    # skip: no budget note); its inference forward compiled, and the text names that one
    recs = [_rec("10B", "forward", False, 0.5, n_params=12_800_000_000), _rec("10B", "forward", True, 0.4),
            {**_rec("10B", "train_step", False, 1.0), "status": "oom"},
            {**_rec("10B", "train_step", True, 1.0), "status": SKIPPED_PAST_OOM,
             "error": "eager ran out of memory at this size"}]
    text = report.model_compile_text(report.model_compile_table(recs, handout="2026"), recs, handout="2026",
                                     smoke=False)
    assert ("Not compiled: 10B (12.8 B parameters): train step (eager ran out of memory at this size); its compiled "
            "timings: forward (inference) only.") in text
    assert "The compile-time budget is the share" not in text and "Out of memory in eager" not in text


def test_a_run_without_compiled_points_says_nothing_was_compiled():
    recs = [_rec("debug", "forward", False, 0.01, tf32=False)]
    text = report.model_compile_text(report.model_compile_table(recs, handout="2026"), recs, handout="2026",
                                     smoke=True)
    assert text.startswith("Setting: fp32 with TF32 off, context 512, batch 4; nothing compiled.")


def test_timing_text_says_how_much_of_the_grid_ran_and_which_dims_failed():
    def row(d, seq, status="ok"):
        return {"d": d, "seq": seq, "status": status, "batch_size": 8, "oom_phase": "warm-up backward",
                "forward_ms_median": 1.0, "backward_ms_median": 2.0, "n_forward": 10, "forward_tflops": 1.0,
                "backward_tflops": 1.0}

    rows = [row(d, s) for d in (16, 32) for s in (256, 1024)] + [row(16, 4096, "oom"), row(32, 4096, "oom")]
    text = report.timing_text(rows, max_seq_len=8192)
    assert "**d = 16, seq = 4,096**" in text
    assert "At seq 4,096 every head dim ran out of memory; every point up to seq 1,024 ran." in text
    rows[-1] = row(32, 4096)  # d = 32 fits at 4096: only one of the two fails
    assert "At seq 4,096 1 of 2 head dims ran out of memory; every point up to" in report.timing_text(
        rows, max_seq_len=8192)


def test_budget_skips_are_neither_fits_nor_failures():
    def row(d, seq, status="ok", error=None):
        return {"d": d, "seq": seq, "status": status, "error": error, "batch_size": 8, "oom_phase": "warm-up backward",
                "forward_ms_median": 1.0, "backward_ms_median": 2.0, "n_forward": 10, "forward_tflops": 1.0,
                "backward_tflops": 1.0}

    # d = 32 was skipped for the budget at 4096: one head dim tried there, and it failed; "every
    # head dim" alone would claim d = 32 too
    rows = [row(16, 1024), row(32, 1024), row(16, 4096, "oom"), row(32, 4096, "skipped (budget)")]
    assert ("At seq 4,096 every head dim tried ran out of memory (1; the budget skipped d = 32); every point up to "
            "seq 1,024 ran.") in report.timing_text(rows, max_seq_len=8192)
    # a variant stopped by the budget before any failure is not said never to run out of memory
    compiled = [row(16, 1024), row(16, 2048, "skipped (budget)", "the sweep's time budget")]
    text = report.oom_comparison_text([row(16, 1024), row(16, 2048, "oom")], compiled)
    assert "compiled attention did not run out of memory at any length it ran (d = 16 ran up to seq 1,024, then " \
           "the sweep's time budget)" in text and "never" not in text
