"""Kernel tables from torch.profiler traces, the nsys CSV parser, and notebook 02 (smoke)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from systems.bench import profile as BP
from systems.measure import flops
from systems.measure import profiler as P
from systems.report import kernel_profiling as KP
from systems.bench.benchmark import BenchmarkConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nsys"


# ----------------------------------------------------------------------------- categories and names


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_execute_kernel__5x_cublas", "matmul"),
    ("ampere_sgemm_128x64_tn", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>(...)", "matmul"),
    ("aten::mm", "matmul"),
    ("aten::bmm", "matmul"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(...)", "reduction/softmax"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(T3)",
     "reduction/softmax"),
    ("aten::_softmax", "reduction/softmax"),
    ("aten::mean", "reduction/softmax"),
    ("Memcpy DtoD (Device -> Device)", "copy/memset"),
    ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(...)>(int, T3)", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>()",
     "copy/memset"),
    ("aten::copy_", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)", "elementwise"),
    ("aten::mul", "elementwise"),
    ("aten::add_", "elementwise"),
    ("aten::masked_fill_", "elementwise"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>(...)", "optimizer"),
    ("void at::native::indexing_backward_kernel<float, 4>(const long *, ...)", "other"),
    ("aten::index", "other"),
])
def test_categorize(name, category):
    assert P.categorize(name) == category


def test_short_kernel_name():
    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
           "at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)")
    assert P.short_kernel_name(mul) == "vectorized_elementwise_kernel [MulFunctor]"
    assert P.short_kernel_name("aten::mm") == "aten::mm"
    assert P.short_kernel_name("ampere_sgemm_128x64_tn") == "ampere_sgemm_128x64_tn"


# ----------------------------------------------------------------------------- a real CPU profile


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
    totals = res.range_totals().set_index("range")
    phases = totals.loc[list(P.PHASE_RANGES), "kernel_ms_per_step"].sum()
    assert phases == pytest.approx(totals.loc[P.STEP_RANGE, "kernel_ms_per_step"])
    # the attention ranges nest inside forward
    assert (items.loc[items["softmax"], "forward"]).all()
    # the optimizer range rule: all its operators are "optimizer", none elsewhere
    assert (items.loc[items["optimizer step"], "category"] == "optimizer").all()
    assert not (items.loc[~items["optimizer step"], "category"] == "optimizer").any()
    cats = res.categories()
    assert list(cats["category"]) == list(P.CATEGORIES)
    assert cats["share"].sum() == pytest.approx(1.0)


def test_cpu_summary_and_timeline(cpu_train_profile):
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
    fig = KP.plot_step_timeline(res.trace_path)
    assert fig.axes[0].get_xlabel().startswith("time since step start")


def test_attention_flops_reference():
    cfg = BenchmarkConfig(model="debug", context_length=64, batch_size=3, device="cpu")
    m = cfg.model_config()
    fl = BP.attention_flops(cfg)
    # QK^T: (B, H, T, d_head) x (B, H, d_head, T) -> 2 B H T^2 d_head FLOPs per layer
    assert fl["scores_matmul_flops"] == 2 * 3 * m.n_heads * 64 * 64 * m.d_head * m.n_layers
    assert fl["final_matmul_flops"] == fl["scores_matmul_flops"]
    assert fl["softmax_flops"] == flops.SOFTMAX_FLOPS_PER_ELEMENT * 3 * m.n_heads * 64 * 64 * m.n_layers


# ----------------------------------------------------------------------------- a synthetic CUDA trace


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


MM = "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_kernel__5x_cublas"
MUL = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
       "at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)")
SOFTMAX = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(...)"


def _cuda_trace() -> dict:
    """Two steps of forward (mm, softmax), backward (mm from autograd's thread), optimizer (mul).

    GPU kernels run later than their launch; the first forward's last kernel ends after the
    forward range on the CPU, as it would without a synchronise.
    """
    ev, corr = [], [0]

    def launch(t, name, gpu_ts, dur, tid=1, cat="kernel"):
        corr[0] += 1
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t, 2, tid=tid, correlation=corr[0]))
        ev.append(_x(cat, name, gpu_ts, dur, tid=7, correlation=corr[0], stream=7))

    for s, base in enumerate((0.0, 1000.0)):
        ev.append(_x("user_annotation", "step", base, 900))
        ev.append(_x("user_annotation", "forward", base + 10, 200))
        ev.append(_x("user_annotation", "softmax", base + 60, 20))
        ev.append(_x("user_annotation", "backward", base + 300, 300))
        ev.append(_x("user_annotation", "optimizer step", base + 700, 100))
        launch(base + 20, MM, base + 30, 100)
        launch(base + 65, SOFTMAX, base + 135, 40)
        launch(base + 150, MUL, base + 205, 15 if s == 0 else 5)  # ends at 220 > forward's end 210 in step 0
        launch(base + 320, MM, base + 330, 200, tid=2)  # backward kernels come from autograd's thread
        launch(base + 330, "Memcpy DtoD (Device -> Device)", base + 540, 10, tid=2, cat="gpu_memcpy")
        launch(base + 710, MUL, base + 720, 30)
    ev.append(_x("cuda_runtime", "cudaLaunchKernel", 5000, 2, correlation=999))  # outside any step
    ev.append(_x("kernel", MM, 5010, 50, tid=7, correlation=999))
    ev.append({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}})
    return {"traceEvents": ev}


def test_cuda_trace_attribution(tmp_path):
    path = tmp_path / "cuda.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_cuda_trace(), f)
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
    # the elementwise mul in the optimizer range is "optimizer"; in forward it stays "elementwise"
    step = res.kernels()
    mul = step[step["name"] == MUL].set_index("category")
    assert mul.loc["optimizer", "total_ms"] == pytest.approx(0.06)
    assert mul.loc["elementwise", "total_ms"] == pytest.approx(0.02)
    soft = res.kernels(ranges="softmax")
    assert list(soft["name"]) == [SOFTMAX]

    totals = res.range_totals().set_index("range")
    assert totals.loc["step", "kernel_ms_per_step"] == pytest.approx((100 + 40 + 10 + 200 + 10 + 30) / 1e3)
    assert totals.loc["forward", "wall_ms_per_step"] == pytest.approx(0.2)
    assert totals.loc["optimizer step", "kernels_per_step"] == 1

    cats = res.categories().set_index("category")
    assert cats.loc["matmul", "ms_per_step"] == pytest.approx(0.3)
    assert cats.loc["optimizer", "kernels_per_step"] == 1

    # forward span: range start to the later of range end and last kernel end
    assert res.phase_spans_ms("forward") == pytest.approx([0.210, 0.200])
    fig = KP.plot_step_timeline(path, step=0)
    assert "GPU kernels" in fig.axes[0].get_title()


# ----------------------------------------------------------------------------- nsys CSV


def test_nsys_parser_current_format_with_preamble():
    df = P.parse_nsys_kern_sum((FIXTURES / "cuda_gpu_kern_sum_2024.csv").read_text(), n_steps=3)
    assert list(df.columns) == list(P.kernel_table(pd.DataFrame(columns=["name", "category", "dur"])).columns)
    assert len(df) == 6
    assert df.loc[0, "category"] == "matmul"
    assert df.loc[0, "total_ms"] == pytest.approx(50.0)
    assert df.loc[0, "instances"] == 150 and df.loc[0, "instances_per_step"] == 50
    assert df.loc[0, "mean_us"] == pytest.approx(333.3333, rel=1e-4)
    assert df["share"].sum() == pytest.approx(1.0)
    # quoted names keep their commas
    soft = df[df["category"] == "reduction/softmax"]
    assert any(n.startswith("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10,")
               for n in soft["name"])
    assert set(df["category"]) == {"matmul", "reduction/softmax", "elementwise", "copy/memset", "other"}
    assert (df["total_ms"].diff().dropna() <= 0).all()


def test_nsys_parser_old_format():
    df = P.parse_nsys_kern_sum((FIXTURES / "gpukernsum_2021.csv").read_text())
    assert len(df) == 3
    assert df.loc[0, "name"] == "ampere_sgemm_128x64_tn"
    assert df.loc[0, "share"] == pytest.approx(0.7)
    assert df.loc[0, "mean_us"] == pytest.approx(233.3333, rel=1e-4)  # the old 'Average' column, in ns
    assert list(df["category"]) == ["matmul", "reduction/softmax", "copy/memset"]
    assert df.loc[2, "kernel"] == "unrolled_elementwise_kernel [FillFunctor]"


def test_nsys_parser_header_first_line():
    df = P.parse_nsys_kern_sum((FIXTURES / "cuda_gpu_kern_sum_no_preamble.csv").read_text())
    assert list(df["category"]) == ["matmul", "elementwise"]
    assert df["total_ms"].sum() == pytest.approx(2.0)


def test_nsys_parser_rejects_other_text():
    with pytest.raises(ValueError, match="Time"):
        P.parse_nsys_kern_sum("Generating SQLite file\nSKIPPED: report.sqlite does not contain CUDA kernel data.\n")


def test_nsys_command_captures_the_nvtx_range(tmp_path):
    cmd = BP.nsys_command(BenchmarkConfig(model="debug", context_length=64), tmp_path / "rep", steps=2)
    assert cmd[:2] == ["nsys", "profile"]
    assert "--capture-range=nvtx" in cmd and f"--nvtx-capture={P.NSYS_CAPTURE_RANGE}" in cmd
    assert cmd[cmd.index("--steps") + 1] == "2"
    cfg = json.loads(cmd[cmd.index("--config-json") + 1])
    assert cfg["model"] == "debug"


# ----------------------------------------------------------------------------- notebook


@pytest.mark.slow
def test_notebook_02_smoke(tmp_path):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["02"], profile="smoke", out_dir=tmp_path, report=False, progress=False)
    assert runs and runs[0].ok, runs[0].error if runs else "no run"
    assert (tmp_path / "figures" / "02_kernel_profiling_train_step_timeline.png").exists()
    rows = pd.read_json(tmp_path / "results" / "02_kernel_profiling_summary.jsonl", lines=True)
    assert len(rows) == 12 and (rows["status"] == "ok").all()
