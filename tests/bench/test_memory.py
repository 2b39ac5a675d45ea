"""Notebook 04's measurements on the CPU with the debug model: the peak sweep, one block, the
train step's per-phase peaks, and the checkpointing sweeps (an out-of-memory k is a row)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from systems.bench import memory as bench
from systems.config import get_config
from systems.measure.results import read_records
from systems.model import TransformerLM
from systems.train import OptimizerSpec, build_optimizer


def test_handout_profiles_are_the_handouts_words():
    assert bench.handout_profile("2025") == bench.MemoryProfile("2.7B", (128, 256, 512), 4)
    assert bench.handout_profile("2026") == bench.MemoryProfile("xl", (128, 2048), 4)
    assert bench.CHECKPOINT_RUN == {"model": "2.7B", "batch_size": 4, "context_length": 2048}  # 2026's xl
    with pytest.raises(ValueError, match="handout must be one of"):
        bench.handout_profile("2024")


def test_peak_sweep_rows_on_a_cpu(tmp_path):
    out = tmp_path / "peaks.jsonl"
    rows = bench.run_peak_sweep(model="debug", contexts=(16,), batch_size=2, device="cpu", precisions=("fp32",),
                                snapshot_dir=tmp_path / "snap", out_path=out, progress=False)
    assert [(r["mode"], r["status"]) for r in rows] == [("forward", "ok"), ("train_step", "ok")]
    fwd, step = rows
    assert Path(step["snapshot"]).exists() and step["peak_source"] == "profiler snapshot"
    # the cumulative per-phase marks never fall, and the last one is the step's peak
    marks = [step[f"peak_{p}_gib"] for p in ("forward", "backward", "optimizer")]
    assert marks == sorted(marks) and marks[-1] == step["peak_gib"]
    assert fwd.get("peak_backward_gib") is None and fwd["peak_gib"] > fwd["start_gib"] > 0
    assert step["start_gib"] > fwd["start_gib"]  # gradients and AdamW state exist before the step
    assert len(read_records(out)) == 2


def test_measure_block_gradients_match_the_parameter_count():
    row = bench.measure_block(model="debug", batch_size=2, context_length=32, device="cpu")
    cfg = get_config("debug")
    assert row["grad_bytes"] == row["expected_grad_bytes"] == (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) * 4
    assert len(row["top_ops"]) == 5 and row["saved_bytes"] > row["residual_bytes"]
    assert row["attention_matrix_bytes"] == 2 * cfg.n_heads * 32 * 32 * 4


def _lm(n_layers: int = 4):
    cfg = get_config("debug", n_layers=n_layers)
    torch.manual_seed(0)
    lm = TransformerLM(cfg)
    batch = torch.randint(0, cfg.vocab_size, (2, 32))
    return lm, batch, torch.roll(batch, 1, dims=1)


def test_measure_train_step_reads_each_phase_apart():
    lm, x, y = _lm()
    m = bench.measure_train_step(lm, x, y, optimizer=build_optimizer(lm, OptimizerSpec()), warmup=1, steps=1)
    assert m["activation_peak_bytes"] == max(m["peak_forward_bytes"], m["peak_backward_bytes"])
    assert m["peak_bytes"] == max(m["activation_peak_bytes"], m["peak_optimizer_bytes"])
    assert m["rise_bytes"] == m["activation_peak_bytes"] - m["start_bytes"] and m["step_ms"] > 0
    # forward + backward only: no optimizer phase
    m = bench.measure_train_step(lm, x, y, warmup=1, steps=1, grads_to_none=False)
    assert "peak_optimizer_bytes" not in m
    with pytest.raises(ValueError, match="warmup"):
        bench.measure_train_step(lm, x, y, warmup=0, grads_to_none=False)


def test_checkpoint_groups_sweep_goes_on_past_an_out_of_memory_k(tmp_path, monkeypatch):
    real = bench.measure_train_step

    def fails_at_two(model, *args, **kwargs):
        if model.layer_runner.group_size == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(bench, "measure_train_step", fails_at_two)
    rows = bench.run_checkpoint_groups(model="debug", model_overrides={"n_layers": 4}, batch_size=2, context_length=16,
                                       device="cpu", out_path=tmp_path / "g.jsonl", progress=False)
    assert [(r["group_size"], r["status"]) for r in rows] == [(1, "ok"), (2, "oom"), (4, "ok")]
    assert "out of memory" in rows[1]["error"] and rows[0]["n_groups"] == 4
    assert rows[0]["activation_peak_bytes"] > 0 and "peak_optimizer_bytes" in rows[0]
    assert len(read_records(tmp_path / "g.jsonl")) == 3
    assert bench.group_sizes_for(6) == [1, 2, 4, 6] and bench.group_sizes_for(8) == [1, 2, 4, 8]


def test_checkpoint_strategies_count_forwards_and_save_memory():
    rows = bench.run_checkpoint_strategies(model="debug", layers=(4,), batch_size=1, context_length=32, device="cpu")
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"none", "one_level", "nested", "chain"}
    assert by["none"]["block_forwards"] == 4 and by["one_level"]["block_forwards"] == 8
    assert by["chain"]["block_forwards"] == 4 + 4 * 5 // 2
    # with the gradients kept allocated, what checkpointing removes is activations
    assert by["chain"]["rise_bytes"] <= by["nested"]["rise_bytes"] < by["none"]["rise_bytes"]
