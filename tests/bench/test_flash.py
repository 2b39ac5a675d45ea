"""The flash_benchmarking harness (systems/bench/flash.py) on the CPU: rows with medians, spreads and
model-FLOP rates, the statuses a point can end in, the time budget, the one correctness checker,
and the ratio summaries (pure pandas)."""

import math
import os
import time

import pandas as pd
import pytest
import torch

from systems.bench import flash
from systems.bench.budget import SKIPPED
from systems.bench.flash import geomean_ratios, speed_ratios
from systems.measure import flops
from systems.measure.results import ResultWriter, read_records


def _row(impl, seq, d, fwd, bwd, dtype="bf16", status="ok"):
    return dict(impl=impl, seq=seq, d=d, dtype=dtype, status=status, fwd_ms=fwd, bwd_ms=bwd)


def test_speed_ratios_and_geomeans():
    sweep = pd.DataFrame([
        _row("triton", 1024, 64, 1.0, 2.0), _row("sdpa_cudnn", 1024, 64, 2.0, 2.0), _row("sdpa_flash", 1024, 64, 4.0, 1.0),
        _row("triton", 4096, 64, 2.0, 4.0), _row("sdpa_cudnn", 4096, 64, 1.0, 8.0), _row("sdpa_flash", 4096, 64, 2.0, 4.0),
        # outside the grid: a short sequence, another head dim, fp32: all ignored
        _row("triton", 512, 64, 1.0, 1.0), _row("sdpa_cudnn", 512, 64, 100.0, 100.0),
        _row("triton", 1024, 32, 1.0, 1.0), _row("sdpa_cudnn", 1024, 32, 100.0, 100.0),
        _row("triton", 1024, 128, 1.0, 1.0, dtype="fp32"), _row("sdpa_cudnn", 1024, 128, 9.0, 9.0, dtype="fp32"),
        # cuDNN failed here: the point is missing from its columns, not a zero
        _row("triton", 8192, 128, 1.0, 1.0), _row("sdpa_cudnn", 8192, 128, None, None, status="oom"),
        _row("sdpa_flash", 8192, 128, 1.0, 1.0),
    ])
    ratios = speed_ratios(sweep)
    assert list(ratios.index) == [(64, 1024), (64, 4096), (128, 8192)]
    assert ratios.loc[(64, 1024), "fwd vs sdpa_cudnn"] == 2.0 and ratios.loc[(64, 4096), "bwd vs sdpa_cudnn"] == 2.0
    assert math.isnan(ratios.loc[(128, 8192), "fwd vs sdpa_cudnn"])
    gm = geomean_ratios(ratios).set_index(["pass", "baseline"])
    # fwd vs cuDNN: 2.0 and 0.5 -> 1.0, exactly the target; bwd vs flash: 0.5, 1.0, 1.0
    assert gm.loc[("fwd", "sdpa_cudnn"), "geomean speed"] == pytest.approx(1.0)
    assert gm.loc[("fwd", "sdpa_cudnn"), "met"] and gm.loc[("fwd", "sdpa_cudnn"), "missing"] == 1
    assert gm.loc[("bwd", "sdpa_flash"), "geomean speed"] == pytest.approx(0.5 ** (1 / 3))
    assert not gm.loc[("bwd", "sdpa_flash"), "met"] and gm.loc[("bwd", "sdpa_flash"), "points"] == 3


def test_rows_carry_medians_spreads_and_model_flop_rates():
    row = flash.time_attention("naive", batch=1, heads=2, seq=64, d=16, dtype="fp32", warmup_ms=1, rep_ms=5,
                               device="cpu")
    assert row["status"] == "ok" and row["dot"] == "ieee"
    for p, flop_pass in (("fwd", "fwd"), ("bwd", "bwd"), ("e2e", "fwd_bwd")):
        assert 0 < row[f"{p}_p10_ms"] <= row[f"{p}_ms"] <= row[f"{p}_p90_ms"]
        # the one convention: causal keeps 64 * 65 / 2 pairs per head, the backward is 2x the forward
        work = flops.attention_flops(batch=1, heads=2, n_q=64, n_k=64, d=16, causal=True, pass_=flop_pass)
        assert work == 2 * 2 * 2 * (64 * 65 // 2) * 16 * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[flop_pass]
        assert row[f"{p}_tflops"] == pytest.approx(work / (row[f"{p}_ms"] * 1e-3) / 1e12)


def test_statuses_oom_unsupported_and_memory(monkeypatch):
    unsupported = flash.time_attention("sdpa_cudnn", batch=1, heads=1, seq=32, d=16, dtype="fp32", warmup_ms=1,
                                       rep_ms=2, device="cpu")
    # this machine's SDPA has no cuDNN kernel for CPU tensors: a row that says so, not a crash
    assert unsupported["status"] == "unsupported" and "fwd_ms" not in unsupported, unsupported
    # the accounting: P, dP and dS of 1 x 2 x 1024 x 1024 fp32 plus the one-byte mask
    need = flash.naive_min_bytes(batch=1, heads=2, n_q=1024, n_k=1024, dtype="fp32")
    assert need == 3 * 2 * 1024 * 1024 * 4 + 1024 * 1024
    skipped = flash.time_attention("naive", batch=1, heads=2, seq=1024, d=16, dtype="fp32", device="cpu",
                                   free_bytes=need - 1)
    assert skipped["status"] == flash.SKIPPED_MEMORY and "GiB" in skipped["error"]

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(flash, "get_impl", lambda name: oom)
    row = flash.time_attention("naive", batch=1, heads=1, seq=32, d=16, dtype="fp32", device="cpu")
    assert row["status"] == "oom" and "injected" in row["error"] and row["fwd_tflops"] is None


def test_dot_precision_of_each_side():
    assert flash.dot_of("naive", "bf16") == "bf16" and flash.dot_of("triton", "fp16") == "fp16"
    assert flash.dot_of("naive", "fp32") == ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    pytest.importorskip("triton")
    assert flash.dot_of("triton_tf32x3", "fp32") == "tf32x3" and flash.dot_of("triton_ieee", "fp32") == "ieee"


def test_ours_are_the_projects_implementations_not_the_baselines():
    assert all(flash.is_ours(name) for name in (*flash.TRITON_VARIANTS, "flash_pytorch", "flash_triton"))
    assert not any(flash.is_ours(name) for name in ("naive", "sdpa", *flash.SDPA_BACKENDS))
    # the backends named ours are systems.attention's, so a rename there fails here
    assert set(flash.OUR_BACKENDS) <= set(flash.BACKENDS)


def test_budget_skips_what_it_cannot_afford(monkeypatch):
    # each pass takes seq / 32 * 10 ms (a fake timing) and each clock reading advances 1 s. Seq 64 is
    # estimated from seq 32 at 10 ms x 2080 / 528 pairs per pass: (6 untimed + 1 warm-up + 3 timed
    # calls) x 39.4 ms x 3 passes = 1.18 s, within the 2.5 s left; seq 128 from seq 64: 2.38 s, past
    # the 1.5 s left
    def fake(impl, *, seq, **kw):
        return flash._add_rates(dict(impl=impl, seq=seq, batch=kw["batch"], heads=kw["heads"], d=kw["d"],
                                     dtype=kw["dtype"], causal=kw["is_causal"], status="ok",
                                     **{f"{p}_ms": seq / 32 * 10 for p in flash.PASSES}))

    monkeypatch.setattr(flash, "time_attention", fake)
    ticks = iter(range(1000))
    cfg = flash.SweepConfig(seq_lens=(32, 64, 128), head_dims=(16,), dtypes=("fp32",), impls={"fp32": ("naive",)},
                            warmup_ms=1, rep_ms=2, budget_s=4.5)
    rows = flash.flash_benchmarking(cfg, device="cpu", progress=False, clock=lambda: float(next(ticks)))
    assert list(rows["status"]) == ["ok", "ok", SKIPPED]
    assert "4.5 s budget" in rows["error"].iloc[-1] and pd.isna(rows["e2e_tflops"].iloc[-1])


def test_past_the_budget_a_series_its_backend_refused_stays_unsupported(monkeypatch):
    # sdpa refuses every length of this series; the budget runs out after the first point (each
    # clock reading advances 1 s): the next points are not tried, and their rows say why they
    # could not have run, not only that the budget ended
    def fake(impl, *, seq, **kw):
        return dict(impl=impl, seq=seq, batch=kw["batch"], heads=kw["heads"], d=kw["d"], dtype=kw["dtype"],
                    causal=kw["is_causal"], status="unsupported", error="No available kernel")

    monkeypatch.setattr(flash, "time_attention", fake)
    ticks = iter(range(1000))
    cfg = flash.SweepConfig(seq_lens=(32, 64, 128), head_dims=(16,), dtypes=("fp32",), impls={"fp32": ("sdpa",)},
                            warmup_ms=1, rep_ms=2, budget_s=1.5)
    rows = flash.flash_benchmarking(cfg, device="cpu", progress=False, clock=lambda: float(next(ticks)))
    assert list(rows["status"]) == ["unsupported"] * 3
    assert rows["error"].iloc[0] == "No available kernel"
    # both name the length that was tried
    assert list(rows["error"].iloc[1:]) == ["not tried (past the budget); at seq 32: No available kernel"] * 2


def test_the_sweep_records_the_tile_plans_its_triton_points_ran_with(monkeypatch, tmp_path):
    flash_triton = pytest.importorskip("systems.attention.flash_triton")
    plan = dict(kernel="fwd", dtype="torch.bfloat16", SEQ_BUCKET=1024, HEAD_DIM=64, IS_CAUSAL=True,
                INPUT_PRECISION="ieee", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, origin="tuned", compiled=1)
    monkeypatch.setattr(flash_triton, "tuned_plans", lambda: [plan])
    monkeypatch.setattr(flash, "time_attention", lambda impl, **kw: dict(impl=impl, status="ok"))
    for impls, expected in ((("naive", "triton"), [plan]), (("naive",), [])):
        path = tmp_path / f"plans_{len(impls)}.jsonl"
        cfg = flash.SweepConfig(seq_lens=(128,), head_dims=(64,), dtypes=("bf16",), impls={"bf16": impls})
        flash.flash_benchmarking(cfg, device="cpu", progress=False, plans_writer=ResultWriter(path))
        # the rows as written, less the environment stamp every results row carries
        assert [{k: v for k, v in r.items() if k != "env"} for r in read_records(path)] == expected


def test_our_points_run_before_the_baselines():
    # a budget cut takes the last points: the baselines' longest, never the whole of ours first
    cfg = flash.SweepConfig(seq_lens=(256, 128), head_dims=(16,), dtypes=("bf16",),
                            impls={"bf16": ("naive", "triton")}, first=("triton",))
    assert cfg.points() == [("bf16", 16, 128, "triton"), ("bf16", 16, 256, "triton"),
                            ("bf16", 16, 128, "naive"), ("bf16", 16, 256, "naive")]
    assert flash.SweepConfig(seq_lens=(128,), head_dims=(16,), dtypes=("bf16",), impls={"bf16": ("naive", "triton")},
                             first=()).points() == [("bf16", 16, 128, "naive"), ("bf16", 16, 128, "triton")]


def test_estimate_counts_do_benchs_calls():
    cfg = flash.SweepConfig(warmup_ms=10, rep_ms=50, min_reps=3)
    # 100 ms per call: 6 untimed + 1 warm-up + 3 timed calls; 1 ms: 6 + 10 + 50
    assert flash.estimate_point_s({"fwd": 100.0}, cfg) == pytest.approx(1.0)
    assert flash.estimate_point_s({"fwd": 1.0}, cfg) == pytest.approx(0.066)


def test_checker_finds_a_wrong_implementation(monkeypatch):
    good = flash.check_errors("flash_pytorch", shape_q=(2, 40, 16), n_k=50, causal=True, dtype="fp32")
    # fp32 tiles against float64: a few fp32 ulps
    assert good["worst"] < 1e-5 and good["saves_lse"]
    assert not flash.check_errors("naive", shape_q=(2, 40, 16), n_k=50, causal=True, dtype="fp32")["saves_lse"]
    wrong = flash.get_impl("naive")
    monkeypatch.setattr(flash, "get_impl", lambda name: lambda q, k, v, c: wrong(q, k, v, not c))
    assert flash.check_errors("naive", shape_q=(2, 40, 16), n_k=50, causal=True, dtype="fp32")["worst"] > 1e-2


def test_unknown_implementation_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown implementation 'cuda_magic'; choose one of triton"):
        flash.get_impl("cuda_magic")
    with pytest.raises(ValueError, match="unknown implementations \\['cuda_magic'\\] for fp32"):
        flash.SweepConfig(impls={"fp32": ("naive", "cuda_magic")})
    with pytest.raises(ValueError, match="unknown dtypes \\['float32'\\]"):
        flash.SweepConfig(dtypes=("float32",))
    with pytest.raises(ValueError, match="min_reps must be at least 1"):
        flash.SweepConfig(min_reps=0)


@pytest.mark.slow
def test_interpreter_check_runs_the_triton_kernels(tmp_path):
    pytest.importorskip("triton")
    rows = flash.check_in_interpreter(out_path=tmp_path / "check.jsonl", dtypes=("fp32",))
    assert [r["impl"] for r in rows] == ["triton"] * len(flash.CHECK_CASES)
    # the interpreter's dots are numpy fp32: exact to rounding, and L is saved for the backward
    assert all(r["worst"] < 1e-5 and r["saves_lse"] for r in rows), rows


def test_sweep_warm_calls_cover_each_kernel_class_once():
    cfg = flash.SweepConfig(seq_lens=(128, 256, 8192, 16384), head_dims=(16, 32), dtypes=("bf16", "fp32"),
                            impls={"bf16": ("triton", "naive"), "fp32": ("triton", "triton_ieee", "sdpa_flash")})
    calls = flash.sweep_warm_calls(cfg)
    # bf16 switches to the TMA kernels above TMA_MIN_SEQ (4096): its shortest length on each side;
    # fp32 never does, so one length; the PyTorch and SDPA baselines compile nothing of ours
    want = {("triton", "bf16", d, s) for d in (16, 32) for s in (128, 8192)}
    want |= {(impl, "fp32", d, 128) for impl in ("triton", "triton_ieee") for d in (16, 32)}
    assert {(c.impl, c.dtype, c.shape_q[-1], c.shape_q[-2]) for c in calls} == want
    assert len(calls) == len(want)


def test_check_warm_calls_are_the_checks_triton_calls():
    calls = flash.check_warm_calls(impls=("flash_pytorch", "triton"), dtypes=("fp32",))
    assert [(c.impl, c.shape_q, c.n_k, c.causal) for c in calls] == [
        ("triton", tuple(q), n_k, causal) for q, n_k, causal in flash.CHECK_CASES]


def test_prewarm_runs_its_calls_in_workers_and_reports_failures():
    # on a CPU the workers run PyTorch implementations: the mechanism (workers, grouping, errors)
    # is what this checks; that compiles land in Triton's cache needs a GPU
    ok = [flash.WarmCall("naive", "fp32", (1, 1, 16, 8), 16, True),
          flash.WarmCall("flash_pytorch", "fp32", (1, 1, 16, 8), 16, True)]
    report = flash.prewarm(ok, device="cpu", processes=2)
    assert report["failed"] == [] and report["calls"] == 2 and report["jobs"] == 2 and report["workers"] == 2
    bad = flash.WarmCall("naive", "fp32", (1, 1, 16, 8), 8, True)  # more queries than keys: naive refuses
    report = flash.prewarm([*ok, bad], device="cpu", processes=2)
    assert len(report["failed"]) == 1
    # the failing call shares its job with the other naive call (one job per implementation here)
    assert [c["n_k"] for c in report["failed"][0]["calls"]] == [16, 8]
    assert "ValueError" in report["failed"][0]["error"]


def test_prewarm_pins_tritons_cache_directory(monkeypatch):
    # inductor points TRITON_CACHE_DIR at its own cache where it is unset; pinned, this process
    # keeps reading the directory the workers compiled into
    import triton

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    default = triton.knobs.cache.dir
    flash.prewarm([], device="cpu")
    assert os.environ["TRITON_CACHE_DIR"] == default
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/chosen")
    flash.prewarm([], device="cpu")
    assert os.environ["TRITON_CACHE_DIR"] == "/tmp/chosen"


def test_a_worker_leaves_nothing_running(tmp_path):
    # the worker starts a child that would outlive it; once the worker is done, the child is gone
    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 >/dev/null 2>&1 & echo $! > {pid_file}"]
    assert flash.run_leaving_nothing(cmd, env=dict(os.environ), timeout_s=30) is None
    child = int(pid_file.read_text())
    deadline = time.time() + 5
    while time.time() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)
    failing = flash.run_leaving_nothing(["sh", "-c", "echo boom; exit 3"], env=dict(os.environ), timeout_s=30)
    assert failing is not None and "boom" in failing
    assert "timed out" in flash.run_leaving_nothing(["sleep", "5"], env=dict(os.environ), timeout_s=0.2)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a killed orphan may linger as a zombie until init reaps it
