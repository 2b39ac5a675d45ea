"""The FSDP benchmark: trace timelines, optimizer-state bytes, the large-model attempt, the checks."""

from __future__ import annotations

import pytest
import torch

from systems.bench import fsdp as fsdp_bench
from systems.measure.results import read_records


def test_gpu_trace_timeline_merges_the_step_across_streams(tmp_path, trace_event):
    """A synthetic GPU trace: the step range has one annotation per stream (NCCL stream listed
    first); the step is their union. Forward gathers pair with units in issue order."""
    import json

    from systems.bench.fsdp import gather_timing, trace_timeline

    ev = trace_event
    events = [
        ev("step", "gpu_user_annotation", 1000, 300, 20, ext=5),  # NCCL stream: gathers .. reduce
        ev("step", "gpu_user_annotation", 1010, 490, 7, ext=5),  # compute stream, to the optimizer
        ev("fsdp_unit:0", "gpu_user_annotation", 1010, 40, 7, ext=6),
        ev("fsdp_unit:1", "gpu_user_annotation", 1066, 34, 7, ext=7),
        ev("ncclDevKernel_AllGather_RING_LL", "kernel", 1000, 10, 20),
        ev("ncclDevKernel_AllGather_RING_LL", "kernel", 1015, 50, 20),  # ends after layer 1 would start
        ev("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "kernel", 1250, 50, 20),
        ev("sgemm", "kernel", 1010, 40, 7), ev("sgemm", "kernel", 1066, 34, 7),
        ev("adam", "kernel", 1400, 100, 7),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    timeline = trace_timeline(path)
    assert timeline["kind"] == "gpu"
    assert timeline["step"] == pytest.approx((0.0, 0.5))
    assert [u[0] for u in timeline["units"]] == [0, 1]
    rows = gather_timing(timeline)
    assert [r["in_time"] for r in rows] == [True, False]
    assert rows[1]["stall_ms"] == pytest.approx(0.015)  # compute idle 1050-1065 waiting for the gather


def test_optimizer_state_bytes_counts_local_shards():
    """FSDP2's AdamW moments are DTensors whose numel() is global; only the local shard is held."""
    from types import SimpleNamespace

    from systems.bench.fsdp import optimizer_state_bytes

    class GlobalView(torch.Tensor):  # stands in for a DTensor sharded over 2 ranks
        def to_local(self):
            return torch.zeros(self.numel() // 2, dtype=self.dtype)

    p = torch.zeros(8)
    opt = SimpleNamespace(state={p: {"exp_avg": torch.zeros(8).as_subclass(GlobalView),
                                     "exp_avg_sq": torch.zeros(8).as_subclass(GlobalView),
                                     "step": torch.tensor(1.0)}})
    assert optimizer_state_bytes(opt) == 2 * 4 * 4 + 4


def test_large_model_configs_append_rows_of_another_model():
    base = fsdp_bench.FSDPBenchConfig(model="debug", context_length=32)
    fsdp_first, sharded = fsdp_bench.large_model_configs(base, model="small")
    assert (fsdp_first.model, fsdp_first.opt_variants, fsdp_first.fsdp_variants, fsdp_first.precisions) == (
        "small", (), ("fsdp",), ("bf16",))
    assert (sharded.opt_variants, sharded.fsdp_variants) == (("ddp_sharded",), ())
    for big in (fsdp_first, sharded):
        assert big.append and not big.profile and big.fsdp_path == base.fsdp_path and big.opt_path == base.opt_path
    with pytest.raises(ValueError, match="nothing to run"):
        fsdp_bench.FSDPBenchConfig(precisions=())
    with pytest.raises(ValueError, match="must differ"):
        fsdp_bench.large_model_configs(base, model="debug")
    with pytest.raises(ValueError, match="optimizer-sharding variants"):
        fsdp_bench.FSDPBenchConfig(opt_variants=("zero3",))
    assert fsdp_bench.notebook_config(profile="full", handout="2026").model == "2.7B"
    assert fsdp_bench.notebook_config(profile="full", handout="2025").model == "xl-2025"


@pytest.mark.slow
def test_attempt_turns_a_failed_run_into_a_row(tmp_path, monkeypatch):
    """A run that fails (here: a rank raises) leaves an "error" row naming what failed, and the
    rows already in the file stay."""
    from systems.parallel import launch

    out = tmp_path / "fsdp.jsonl"
    out.write_text('{"model": "debug", "variant": "fsdp", "status": "ok"}\n')
    cfg = fsdp_bench.FSDPBenchConfig(model="small", context_length=32, fsdp_path=str(out), append=True,
                                     opt_path=str(tmp_path / "opt.jsonl"), gather_path=str(tmp_path / "g.jsonl"))

    def failing(*args, **kwargs):
        raise launch.DistributedRunError("rank 1 of 2 was killed by signal SIGKILL without raising a Python error\nmore")

    monkeypatch.setattr(fsdp_bench, "launch", failing)
    result = fsdp_bench.attempt(cfg, world_size=2, backend="gloo")
    rows = read_records(out)
    assert [r["status"] for r in rows] == ["ok", "error"]
    assert rows[1]["model"] == "small" and rows[1]["variant"] == "ddp,ddp_sharded,fsdp2,fsdp"
    assert rows[1]["error"].startswith("rank 1 of 2 was killed by signal SIGKILL")
    assert result["fsdp"][0]["status"] == "error"


@pytest.mark.slow
def test_the_sharded_optimizer_is_bit_equal_and_fsdp_rounds(tmp_path):
    """The notebook's check of the code deliverables on 2 gloo ranks: ShardedOptimizer changes only
    who updates a parameter (bit equality); FSDP sums half-batch gradients in another order, so
    its weights land within a few float32 spacings (weights ~3, spacing 2.4e-7) of one process."""
    rows = fsdp_bench.check_against_unsharded(tmp_path / "check.jsonl")
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["sharded_bit_equal"] and r["sharded_max_abs_diff"] == 0.0
        assert 0 <= r["fsdp_max_abs_diff"] < 1e-6


def test_the_progress_line_names_the_steps_highest_peak_and_its_phase():
    mib = 2**20
    assert fsdp_bench._peak_text({"peak_fwd_bwd": 100 * mib, "peak_opt_step": 130 * mib}) == \
        "peak 130 MiB (in the optimizer step)"
    assert fsdp_bench._peak_text({"peak_fwd_bwd": 100 * mib, "peak_opt_step": None}) == \
        "peak 100 MiB (in the forward + backward)"
    assert fsdp_bench._peak_text({"status": "ok"}) == "peak n/a"  # a CPU keeps no allocator statistics
