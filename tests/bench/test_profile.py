"""systems.bench.profile: a real CPU profile of the harness's step, the summary row, the plans of
both handouts, the sweep's OOM / budget / longest-context rules, and the nsys command line."""

from __future__ import annotations

import json

import pytest
import torch

from systems.bench import profile as BP
from systems.bench.benchmark import BenchmarkConfig
from systems.bench.budget import SKIPPED, Budget
from systems.measure import flops
from systems.measure import profiler as P
from tests.fixtures.traces import MM, MUL, SOFTMAX, write_cuda_trace


@pytest.fixture(scope="module")
def cpu_train_profile(tmp_path_factory):
    cfg = BenchmarkConfig(model="debug", context_length=32, batch_size=2, warmup=1, steps=1,
                          mode="train_step", device="cpu")
    path = tmp_path_factory.mktemp("trace") / "train.json.gz"
    return BP.profile_config(cfg, profile_steps=2, trace_path=path)


def test_cpu_profile_steps_and_ranges(cpu_train_profile):
    res = cpu_train_profile
    assert res.n_steps == 2  # the profiler's own warm-up step is not in the trace
    assert res.trace_path is not None and res.trace_path.exists()
    names = set(res.ranges["name"])
    assert {P.STEP_RANGE, *P.PHASE_RANGES, *P.ATTENTION_RANGES} <= names
    for key in ("plain_forward_s", "profiled_forward_s", "plain_optimizer_s", "profiled_step_s"):
        assert res.timings[key] > 0


def test_cpu_kernel_table_counts_match_the_model(cpu_train_profile):
    res, m = cpu_train_profile, cpu_train_profile.config.model_config()
    fwd = res.kernels(ranges="forward").set_index("name")
    # reference: each block runs 7 Linear layers (q, k, v, out, w1, w2, w3), each one aten::mm on CPU,
    # plus the LM head; naive attention runs two 4-D matmuls (aten::bmm) and one softmax per block
    assert fwd.loc["aten::mm", "instances_per_step"] == 7 * m.n_layers + 1
    assert fwd.loc["aten::bmm", "instances_per_step"] == 2 * m.n_layers
    assert fwd.loc["aten::_softmax", "instances_per_step"] == m.n_layers
    assert fwd.loc["aten::mm", "category"] == "matmul"
    assert fwd["share"].sum() == pytest.approx(1.0)
    assert (fwd["total_ms"].diff().dropna() <= 0).all()  # sorted like nsys, largest first
    # mean is total / instances
    row = fwd.loc["aten::mm"]
    assert row["mean_us"] * row["instances"] == pytest.approx(row["total_ms"] * 1e3)


def test_cpu_ranges_partition_the_step(cpu_train_profile):
    res = cpu_train_profile
    items = res.items
    # every operator of a step belongs to exactly one phase
    assert (items[list(P.PHASE_RANGES)].sum(axis=1) == 1).all()
    assert set(items["phase"]) == set(P.PHASE_RANGES)
    totals = res.range_totals().set_index("range")
    phases = totals.loc[list(P.PHASE_RANGES), "kernel_ms_per_step"].sum()
    assert phases == pytest.approx(totals.loc[P.STEP_RANGE, "kernel_ms_per_step"])
    # the attention ranges nest inside forward
    assert (items.loc[items["softmax"], "forward"]).all()
    # the optimizer's operators are categorised by what they compute (this asserted an "optimizer"
    # category from a range rule before): our AdamW on a CPU is per-parameter elementwise operators
    opt = items[items["optimizer step"]]
    assert (opt["phase"] == "optimizer step").all()
    assert opt.groupby("category")["dur"].sum().idxmax() == "elementwise"
    cats = res.categories()
    assert list(cats["category"]) == list(P.CATEGORIES)
    assert cats["share"].sum() == pytest.approx(1.0)


def test_cpu_summary(cpu_train_profile):
    res = cpu_train_profile
    harness = {"harness_forward_s": res.timings["plain_forward_s"], "harness_forward_std_s": 0.0}
    row = BP.summarize(res, harness, label="debug")
    fwd = res.kernels(ranges="forward")
    assert row["top_forward_kernel"] == fwd.loc[0, "kernel"] and row["top_forward_share"] == fwd.loc[0, "share"]
    assert row["top_fwd_bwd_name"] == res.kernels(ranges=["forward", "backward"]).loc[0, "name"]
    assert row["optimizer_kernels_per_step"] > 0 and 0 < row["optimizer_elementwise_share"] <= 1
    # the forward range sits inside the timer's interval, and its operators' self time inside the range
    # (timing-independent inequalities: this machine's CPU is shared, so no ratio is asserted)
    assert row["profiled_forward_span_s"] <= res.timings["profiled_forward_s"] + 1e-6
    assert row["forward_kernel_s"] <= row["profiled_forward_span_s"] + 1e-6
    assert row["softmax_to_matmul_flops"] == pytest.approx(
        flops.SOFTMAX_FLOPS_PER_ELEMENT / (4 * res.config.model_config().d_head))
    # the phases' shares of the step's kernel time add up to one (they partition the step)
    shares = [row[f"phase_share_{p.replace(' ', '_')}"] for p in P.PHASE_RANGES]
    assert sum(shares) == pytest.approx(1.0) and all(s > 0 for s in shares)
    # the backward's own category shares, measured: they add up to one, and with the forward's and the
    # optimizer's, each weighted by its phase's share, give the step's (the phases partition it)
    assert sum(row[f"bwd_share_{c}"] for c in P.CATEGORIES) == pytest.approx(1.0)
    opt = res.categories(ranges="optimizer step").set_index("category")["share"]
    for c in P.CATEGORIES:
        assert row[f"share_{c}"] == pytest.approx(row["phase_share_forward"] * row[f"fwd_share_{c}"]
                                                  + row["phase_share_backward"] * row[f"bwd_share_{c}"]
                                                  + row["phase_share_optimizer_step"] * opt[c])
    # the model's shape, recorded for the report to count weight matmuls by
    m = res.config.model_config()
    assert (row["n_layers"], row["fused_projections"]) == (m.n_layers, m.fused_projections)
    # without a harness dict, the profile's own unprofiled steps are the harness
    own = BP.summarize(res)
    assert own["harness_forward_s"] == res.timings["plain_forward_s"]
    assert own["span_vs_harness"] == pytest.approx(own["profiled_forward_span_s"] / own["harness_forward_s"] - 1)


def test_attention_flops_reference():
    cfg = BenchmarkConfig(model="debug", context_length=64, batch_size=3, device="cpu")
    m = cfg.model_config()
    fl = BP.attention_flops(cfg)
    # QK^T: (B, H, T, d_head) x (B, H, d_head, T) -> 2 B H T^2 d_head FLOPs per layer
    assert fl["scores_matmul_flops"] == 2 * 3 * m.n_heads * 64 * 64 * m.d_head * m.n_layers
    assert fl["final_matmul_flops"] == fl["scores_matmul_flops"]
    assert fl["softmax_flops"] == flops.SOFTMAX_FLOPS_PER_ELEMENT * 3 * m.n_heads * 64 * 64 * m.n_layers
    # one fp32 read of the scores and one fp32 write of the probabilities per element
    assert BP.softmax_bytes(cfg) == 2 * 4 * 3 * m.n_heads * 64 * 64 * m.n_layers
    assert BP.softmax_bytes(BenchmarkConfig(model="debug", context_length=64, precision="bf16", device="cpu")) is None


def test_cuda_trace_attribution(tmp_path):
    path = tmp_path / "cuda.json.gz"
    write_cuda_trace(path)
    items, ranges = P.parse_trace(P.load_trace(path))
    assert set(items["device"]) == {"cuda"}
    items = P.attribute(items, ranges)
    assert len(items) == 12  # the kernel outside every step is dropped
    res = BP.ProfileResult(BenchmarkConfig(model="debug", context_length=64, device="cpu"), "cuda", 2, items, ranges, {}, path)

    fwd = res.kernels(ranges="forward").set_index("kernel")
    assert fwd.loc[MM, "total_ms"] == pytest.approx(0.2)  # 100 us in each of 2 steps
    assert fwd.loc[MM, "instances_per_step"] == 1
    assert fwd["share"].sum() == pytest.approx(1.0)
    assert fwd.loc[MM, "share"] == pytest.approx(200 / (200 + 80 + 20))
    # the backward mm was launched on thread 2, inside the main thread's backward range
    bwd = res.kernels(ranges="backward").set_index("kernel")
    assert bwd.loc[MM, "total_ms"] == pytest.approx(0.4)
    assert bwd.loc["Memcpy DtoD (Device -> Device)", "category"] == "copy/memset"
    # the elementwise mul is "elementwise" wherever it runs; the optimizer range says where (this
    # asserted an "optimizer" category for it inside the optimizer range before)
    step = res.kernels()
    mul = step[step["name"] == MUL].set_index("category")
    assert mul.loc["elementwise", "total_ms"] == pytest.approx(0.06 + 0.02)
    opt = res.kernels(ranges="optimizer step")
    assert list(opt["name"]) == [MUL] and opt.loc[0, "total_ms"] == pytest.approx(0.06)
    soft = res.kernels(ranges="softmax")
    assert list(soft["name"]) == [SOFTMAX]

    totals = res.range_totals().set_index("range")
    assert totals.loc["step", "kernel_ms_per_step"] == pytest.approx((100 + 40 + 10 + 200 + 10 + 30) / 1e3)
    assert totals.loc["forward", "wall_ms_per_step"] == pytest.approx(0.2)
    assert totals.loc["optimizer step", "kernels_per_step"] == 1

    cats = res.categories().set_index("category")
    assert cats.loc["matmul", "ms_per_step"] == pytest.approx(0.3)
    assert cats.loc["elementwise", "kernels_per_step"] == 2  # one mul in forward, one in the optimizer

    # forward span: range start to the later of range end and last kernel end
    assert res.phase_spans_ms("forward") == pytest.approx([0.210, 0.200])


# ----------------------------------------------------------------------------- plans


def test_handout_plans_cover_what_each_handout_asks():
    p25 = BP.handout_plan("2025", full=True)
    assert list(p25.sizes) == ["small", "medium", "large", "xl", "2.7B"]
    assert p25.sizes["xl"][0] == "xl-2025"
    assert p25.contexts == (128, 256, 512, 1024) and not p25.longest
    assert len(p25.points()) == 5 * 4 * 2
    p26 = BP.handout_plan("2026", full=True)
    assert list(p26.sizes) == list(BP.DEFAULT_2026_SIZES) and p26.longest
    # a ladder of powers of two above 128 to climb until the train step runs out of memory
    assert p26.contexts[0] == 256 and all(b == 2 * a for a, b in zip(p26.contexts, p26.contexts[1:]))
    assert list(BP.handout_plan("2026", full=True, sizes=["medium", "xl"]).sizes.values()) == [
        ("medium", {}), ("2.7B", {})]
    # past the model's 2048-token RoPE table the plan raises the model's maximum context
    assert p26.config("small", 8192, "train_step").model_overrides == {"context_length": 8192}
    assert p26.config("small", 1024, "forward").model_overrides == {}
    smoke = BP.handout_plan("2026", full=False)
    assert smoke.longest and smoke.profile_steps == 1 and max(smoke.contexts) <= 128
    with pytest.raises(ValueError, match="unknown size"):
        BP.handout_plan("2026", full=True, sizes=["xl-2025"])
    with pytest.raises(ValueError, match="ascending"):
        BP.ProfilePlan(sizes=BP.SMOKE_SIZES, contexts=(64, 32))
    with pytest.raises(ValueError, match="profile_steps"):
        BP.ProfilePlan(sizes=BP.SMOKE_SIZES, contexts=(32,), profile_steps=0)


# ----------------------------------------------------------------------------- the sweep's rules


def _fake_profiles(monkeypatch, oom_from: dict[str, int]):
    """profile_config that runs nothing: out of memory from a context on, per size and mode."""
    calls = []

    def fake(cfg, *, profile_steps, trace_path=None):
        calls.append((cfg.model_overrides.get("d_model", 64), cfg.context_length, cfg.mode))
        limit = oom_from.get(cfg.mode)
        if limit is not None and cfg.context_length >= limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return cfg  # stands in for the ProfileResult

    monkeypatch.setattr(BP, "profile_config", fake)
    monkeypatch.setattr(BP, "summarize", lambda cfg, label=None: {"label": label, "context_length": cfg.context_length,
                                                                  "mode": cfg.mode, "status": "ok"})
    return calls


def test_longest_context_climb_stops_at_the_first_train_step_oom(monkeypatch):
    calls = _fake_profiles(monkeypatch, {"train_step": 64})
    plan = BP.ProfilePlan(sizes=BP.SMOKE_SIZES, contexts=(16, 32, 64, 128), longest=True, device="cpu")
    summary, results = BP.profile_sweep(plan, progress=False)
    # per size: train + forward at 16 and 32, then the train step at 64 runs out of memory and the
    # climb ends there (no forward at 64, nothing at 128)
    assert [(c, m) for _, c, m in calls] == [(16, "train_step"), (16, "forward"), (32, "train_step"),
                                             (32, "forward"), (64, "train_step")] * 2
    oom = summary[summary["status"] == "oom"]
    assert list(oom["label"]) == list(BP.SMOKE_SIZES) and set(oom["context_length"]) == {64}
    assert "out of memory" in oom["error"].iloc[0]
    assert len(results) == 8
    # the detailed tables' point: the biggest size, then the longest context, that ran
    assert plan.largest(results, "forward") == ("debug-wide", 32, "forward")
    assert plan.largest({}, "forward") is None
    assert plan.trace_point() == ("debug", 16, "train_step")


def test_fixed_contexts_skip_longer_ones_after_an_oom_and_keep_going(monkeypatch, tmp_path):
    from systems.measure.results import ResultWriter, read_records

    calls = _fake_profiles(monkeypatch, {"train_step": 32})
    plan = BP.ProfilePlan(sizes={"debug": ("debug", {})}, contexts=(16, 32, 64), device="cpu")
    out = tmp_path / "rows.jsonl"
    summary, _ = BP.profile_sweep(plan, writer=ResultWriter(out), progress=False)
    status = {(r.context_length, r.mode): r.status for r in summary.itertuples()}
    assert status == {(16, "train_step"): "ok", (16, "forward"): "ok", (32, "train_step"): "oom",
                      (32, "forward"): "ok", (64, "train_step"): "skipped (out of memory at context 32)",
                      (64, "forward"): "ok"}
    assert (64, "train_step") not in {(c, m) for _, c, m in calls}  # skipped, not tried
    assert len(read_records(out)) == 6  # every point is a row on disk


def test_points_past_the_budget_are_rows_not_runs(monkeypatch):
    calls = _fake_profiles(monkeypatch, {})
    ticks = iter(range(100))
    budget = Budget(seconds=2.5, clock=lambda: float(next(ticks)))  # one second per question asked
    plan = BP.ProfilePlan(sizes={"debug": ("debug", {})}, contexts=(16, 32), device="cpu")
    summary, _ = BP.profile_sweep(plan, budget=budget, progress=False)
    assert list(summary["status"]) == ["ok", "ok", SKIPPED, SKIPPED]
    assert len(calls) == 2


def test_nsys_command_captures_the_nvtx_range(tmp_path):
    cmd = BP.nsys_command(BenchmarkConfig(model="debug", context_length=64), tmp_path / "rep", steps=2)
    assert cmd[:2] == ["nsys", "profile"]
    assert "--capture-range=nvtx" in cmd and f"--nvtx-capture={P.NSYS_CAPTURE_RANGE}" in cmd
    assert cmd[cmd.index("--steps") + 1] == "2"
    cfg = json.loads(cmd[cmd.index("--config-json") + 1])
    assert cfg["model"] == "debug"
