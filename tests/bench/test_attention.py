"""The attention sweep driver (OOM rows, budget, isolation), its memory columns checked against
the accounting on a CPU, and the whole-model compile sweep."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from systems.analysis.attention_memory import attention_memory_accounting
from systems.attention.naive import naive_attention
from systems.bench.attention import (SKIPPED_PAST_OOM, AttentionPoint, AttentionSweepConfig, is_skipped,
                                     run_attention_point, run_attention_sweep, run_model_compile_sweep,
                                     sdpa_one_head, simulated_memory_limit, smallest_oom)
from systems.bench.budget import SKIPPED
from systems.measure.memory import saved_tensors
from systems.measure.results import read_records
from systems.report.attention_compile import model_compile_table, ratio_table, saved_memory_fits, sweep_table

TINY = dict(batch_size=2, n_forward=2, n_backward=2, warmup=1, device="cpu")


def test_injected_oom_becomes_a_row_and_the_sweep_goes_on(tmp_path):
    cfg = AttentionSweepConfig(head_dims=(4, 8), seq_lens=(8, 16, 32), max_seq_len=64, **TINY)
    out = tmp_path / "attn.jsonl"
    # d=4 fails at seq 16 (listed): 32 is skipped, no doubling; d=8 fails at 64 (found by doubling)
    rows = run_attention_sweep(cfg, out_path=out, progress=False,
                               fail_if=lambda p: (p.d == 4 and p.seq >= 16) or p.seq >= 64)
    got = [(r["d"], r["seq"], r["status"]) for r in rows]
    assert got == [(4, 8, "ok"), (4, 16, "oom"), (4, 32, SKIPPED_PAST_OOM),
                   (8, 8, "ok"), (8, 16, "ok"), (8, 32, "ok"), (8, 64, "oom")]
    assert [is_skipped(r) for r in rows] == [s == SKIPPED_PAST_OOM for _, _, s in got]
    oom = rows[1]
    assert oom["oom_phase"] == "warm-up forward" and "injected" in oom["error"]
    for r in rows:
        if r["status"] == "ok":
            assert r["forward_ms_median"] > 0 and r["backward_ms_median"] > 0
            assert r["forward_tflops"] > 0 and r["n_forward"] == 2
    # every row was written as it was produced, stamped with the environment
    written = read_records(out)
    assert [(r["d"], r["seq"], r["status"]) for r in written] == got
    assert all("env" in r for r in written)
    assert smallest_oom(rows)["seq"] == 16
    table = sweep_table(rows)
    assert list(table["status"]) == [s for _, _, s in got]


def test_doubling_stops_at_max_seq_len_without_oom():
    cfg = AttentionSweepConfig(head_dims=(4,), seq_lens=(8,), max_seq_len=32, **TINY)
    rows = run_attention_sweep(cfg, progress=False)
    assert [(r["seq"], r["status"]) for r in rows] == [(8, "ok"), (16, "ok"), (32, "ok")]
    assert smallest_oom(rows) is None


def test_non_oom_errors_propagate():
    def broken(q, k, v):
        raise RuntimeError("shape mismatch, not memory")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_attention_point(AttentionPoint(2, 8, 4), fn=broken, device="cpu", n_forward=1, n_backward=1, warmup=1)


def test_real_runtime_oom_message_is_caught():
    # an allocator failure reported as a plain RuntimeError (older paths) counts as OOM too
    def fails_in_backward(q, k, v):
        out = naive_attention(q, k, v)

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise RuntimeError("CUDA out of memory. Tried to allocate 32.00 GiB")

        return Boom.apply(out)

    row = run_attention_point(AttentionPoint(2, 8, 4), fn=fails_in_backward, device="cpu",
                              n_forward=1, n_backward=1, warmup=1)
    assert row["status"] == "oom" and row["oom_phase"] == "warm-up backward"


def test_saved_tensor_bytes_of_naive_attention_is_the_probability_matrix():
    b, s, d = 2, 16, 4
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    count = lambda fn: saved_tensors(fn, q, k, v, exclude=(q, k, v)).total_bytes()  # noqa: E731
    # exact: softmax output P (b x s x s fp32) is the only non-input tensor autograd keeps
    assert count(naive_attention) == b * s * s * 4
    acct = attention_memory_accounting(batch=b, seq=s, d=d)
    assert acct.attrs["saved_bytes"] == b * s * s * 4
    # fused SDPA keeps O and the row logsumexp instead: linear in seq
    assert count(sdpa_one_head) < b * s * s * 4
    row = run_attention_point(AttentionPoint(b, s, d), device="cpu", n_forward=1, n_backward=1, warmup=1)
    assert row["saved_tensor_bytes"] == row["saved_bytes"] == b * s * s * 4


def test_point_memory_matches_the_cpu_accounting_exactly():
    # the CPU tracker counts storage bytes with no allocator rounding, and the CPU softmax
    # backward needs no temporary: the accounting for cpu kernels must hold to the byte
    b, s, d = 4, 64, 8
    row = run_attention_point(AttentionPoint(b, s, d), device="cpu", n_forward=1, n_backward=1, warmup=1)
    a = attention_memory_accounting(batch=b, seq=s, d=d, device="cpu").attrs
    assert row["start_bytes"] == 0
    assert row["peak_rise_bytes"] == a["peak_bytes"] == a["backward_peak_bytes"]
    assert row["mem_before_backward_bytes"] == a["before_backward_bytes"]
    assert row["activation_bytes"] == a["saved_bytes"] + a["vector_bytes"]  # P and O
    assert row["forward_ms_p10"] <= row["forward_ms_median"] <= row["forward_ms_p90"]


def test_sdpa_one_head_matches_naive():
    q, k, v = (torch.randn(2, 16, 8, dtype=torch.float64) for _ in range(3))
    # float64 on both paths: any difference is summation order only
    torch.testing.assert_close(sdpa_one_head(q, k, v), naive_attention(q, k, v), rtol=1e-10, atol=1e-12)


def test_simulated_memory_limit():
    fail_if = simulated_memory_limit(8 * 2**20, device="cpu")
    assert not fail_if(AttentionPoint(8, 256, 16))  # peak ~6 MiB
    assert fail_if(AttentionPoint(8, 512, 16))  # peak ~24 MiB


def test_saved_memory_fits_from_sweep_rows():
    rows = [{"status": "ok", "d": d, "seq": s, "saved_tensor_bytes": 8 * s * s * 4}
            for d in (16, 32) for s in (64, 128, 256)]
    rows.append({"status": "oom", "d": 16, "seq": 512, "saved_tensor_bytes": None})
    fits = saved_memory_fits(rows)
    assert list(fits["d"]) == [16, 32]
    assert np.allclose(fits["exponent"], 2.0)


def test_compiled_sweep_and_ratio_table():
    # aot_eager: the torch.compile path (Dynamo + AOTAutograd) without code generation, fast on a CPU
    cfg = AttentionSweepConfig(head_dims=(4,), seq_lens=(8, 16), grow_until_oom=False, compiled=True,
                               compile_backend="aot_eager", compile_dynamic=True, **TINY)
    fail_if = lambda p: p.seq == 16
    comp = run_attention_sweep(cfg, progress=False, fail_if=fail_if)
    eager = run_attention_sweep(AttentionSweepConfig(head_dims=(4,), seq_lens=(8, 16), grow_until_oom=False, **TINY),
                                progress=False)
    assert [r["status"] for r in comp] == ["ok", "oom"] and comp[0]["compile_backend"] == "aot_eager"
    table = ratio_table(eager, comp)
    assert list(table["seq"]) == [8, 16]
    assert table.loc[0, "fwd speedup"] > 0 and np.isnan(table.loc[1, "fwd speedup"])
    assert list(table["compiled"]) == ["ok", "oom"]


def test_bad_sweep_config():
    with pytest.raises(ValueError, match="increasing"):
        AttentionSweepConfig(seq_lens=(64, 32))
    with pytest.raises(ValueError, match="n_forward"):
        AttentionSweepConfig(n_forward=0)


def _fake_bench(calls):
    """Stands in for run_benchmark: compiled points report 10 s of compilation per layer in their first
    step (no real compilation); eager 'large' runs out of memory."""
    def bench(cfg):
        compiled = cfg.compile != "none"
        calls.append((cfg.model, cfg.mode, compiled))
        n_layers = cfg.model_config().n_layers
        step = 0.01 * n_layers
        first = step + (10.0 * n_layers if compiled else 0.1)
        rec = {"model": cfg.model, "mode": cfg.mode, "compile": cfg.compile, "status": "ok",
               "batch_size": cfg.batch_size, "context_length": cfg.context_length,
               "first_step_s": first, "step_median_s": step, "step_mean_s": step,
               "forward_mean_s": step / 3, "backward_mean_s": step / 2,
               "forward_median_s": step / 3, "backward_median_s": step / 2}
        if cfg.model == "large" and not compiled:
            rec = {**rec, "status": "oom"}
        return rec
    return bench


def test_model_compile_sweep_budget_and_table(tmp_path):
    calls = []
    ticks = iter(range(0, 10_000, 50))  # every timed call appears to take 50 s of wall time
    recs = run_model_compile_sweep(["small", "medium", "large"], modes=("train_step", "forward"), device="cpu",
                                   budget_s=120, out_path=tmp_path / "m.jsonl", progress=False,
                                   bench_fn=_fake_bench(calls), clock=lambda: float(next(ticks)))
    status = {(r["model"], r["mode"], r["compile"] != "none"): r["status"] for r in recs}
    # eager: every size; compiled small train_step (50 s) and forward (50 s) run; medium train_step
    # predicted 100 s (24/12 layers x 50 s) on top of 100 s spent > 120 s: skipped, as is medium forward;
    # large compiled is skipped because eager ran out of memory there
    assert status[("small", "train_step", True)] == "ok" and status[("small", "forward", True)] == "ok"
    assert status[("medium", "train_step", True)] == SKIPPED  # the budget's mark, which the report reads
    assert "budget" in next(r["error"] for r in recs if r["model"] == "medium" and r["compile"] != "none")
    assert status[("large", "train_step", True)] == SKIPPED_PAST_OOM
    # either skip is a point not run, by the one predicate the report uses
    assert {r["status"] for r in recs if is_skipped(r)} == {SKIPPED, SKIPPED_PAST_OOM}
    assert "out of memory" in next(r["error"] for r in recs if r["model"] == "large" and r["compile"] != "none")
    assert ("large", "train_step", True) not in calls
    assert len(read_records(tmp_path / "m.jsonl")) == len(recs) == 12
    small = next(r for r in recs if r["model"] == "small" and r["compile"] != "none" and r["mode"] == "train_step")
    assert small["first_step_overhead_s"] == pytest.approx(120.0)
    table = model_compile_table(recs, handout="2026").set_index(["size", "measurement"])
    assert table.loc[("small", "train step"), "speedup"] == pytest.approx(1.0)
    assert table.loc[("small", "forward+backward"), "eager ms"] == pytest.approx((0.12 / 3 + 0.12 / 2) * 1e3)
    assert np.isnan(table.loc[("medium", "train step"), "speedup"])


def test_model_compile_sweep_budget_prediction_follows_compile_scope():
    def compiled_status(scope):
        ticks = iter(range(0, 10_000, 50))  # every timed call takes 50 s
        recs = run_model_compile_sweep(["small", "medium"], modes=("forward",), device="cpu", compile_scope=scope,
                                       budget_s=120, progress=False, bench_fn=_fake_bench([]),
                                       clock=lambda: float(next(ticks)))
        return [r["status"] for r in recs if r["compile"] != "none"]

    # one graph for the whole model: medium (24 layers) is predicted at 2 x small's 50 s, 150 > 120
    assert compiled_status("model") == ["ok", SKIPPED]
    # one graph per block, shared by all layers: predicted at small's 50 s, 100 <= 120
    assert compiled_status("blocks") == ["ok", "ok"]


def test_model_compile_sweep_eager_debug_runs_for_real():
    recs = run_model_compile_sweep(["debug"], context_length=16, batch_size=2, modes=("train_step",), device="cpu",
                                   compile_scope=None, tf32=False, warmup=1, steps=1, progress=False)
    assert len(recs) == 1 and recs[0]["status"] == "ok" and recs[0]["first_step_overhead_s"] is not None
    table = model_compile_table(recs, handout="2026")
    assert set(table["measurement"]) == {"forward (in train step)", "forward+backward", "train step"}


def test_isolated_sweep_runs_in_a_child_process_and_returns_its_rows(tmp_path):
    from systems.bench.attention import AttentionSweepConfig, run_attention_sweep

    cfg = AttentionSweepConfig(batch_size=1, head_dims=(16, 32), seq_lens=(32,), grow_until_oom=False,
                               n_forward=1, n_backward=1, warmup=1, device="cpu")
    out = tmp_path / "rows.jsonl"
    out.write_text('{"stale": true}\n')  # a previous run's rows are replaced, not extended
    rows = run_attention_sweep(cfg, out_path=out, progress=False, isolate=True)
    assert [(r["d"], r["seq"], r["status"]) for r in rows] == [(16, 32, "ok"), (32, 32, "ok")]
    assert rows[0]["env"]["torch"]  # written by the child's ResultWriter


def test_isolated_sweep_rejects_what_cannot_cross_processes(tmp_path):
    from systems.bench.attention import AttentionSweepConfig, run_attention_sweep

    with pytest.raises(ValueError, match="cannot carry"):
        run_attention_sweep(AttentionSweepConfig(device="cpu"), out_path=tmp_path / "x.jsonl",
                            fail_if=lambda p: False, isolate=True)


def test_a_spent_budget_skips_the_remaining_points():
    cfg = AttentionSweepConfig(head_dims=(4,), seq_lens=(8, 16), max_seq_len=64, deadline=time.time() - 1, **TINY)
    rows = run_attention_sweep(cfg, progress=False)
    # no point starts after the deadline, and doubling stops at the first skipped point
    assert [(r["seq"], r["status"]) for r in rows] == [(8, SKIPPED), (16, SKIPPED), (32, SKIPPED)]
