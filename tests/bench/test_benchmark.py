"""The timing harness: records, precisions, OOM rows, sweeps written as they go, and the CLI."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from systems.bench import benchmark
from systems.bench.benchmark import (BenchmarkConfig, build_parser, config_of, configs_from_args, main,
                                     run_benchmark, run_sweep, warmup_sweep)
from systems.bench.budget import SKIPPED, Budget
from systems.config import get_config
from systems.measure.results import read_records

TINY = dict(model="debug", context_length=32, batch_size=2, warmup=1, steps=3, device="cpu")


@pytest.mark.parametrize("mode", ["forward", "forward_backward", "train_step"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])  # CPU autocast runs both half types
def test_records_are_sane_for_every_mode_and_precision(mode, precision):
    r = run_benchmark(BenchmarkConfig(mode=mode, precision=precision, **TINY))
    assert r["status"] == "ok"
    assert len(r["step_times_s"]) == 3 and len(r["warmup_times_s"]) == 1
    assert r["step_mean_s"] > 0 and r["step_std_s"] >= 0
    assert r["forward_mean_s"] > 0
    # phases are timed inside the step, so they cannot add up to more than it
    phase_sum = sum(r[f"{p}_mean_s"] or 0 for p in ("forward", "backward", "optimizer"))
    assert phase_sum <= r["step_mean_s"] * 1.001
    assert (r["backward_mean_s"] is None) == (mode == "forward")
    assert (r["backward_median_s"] is None) == (mode == "forward")
    assert min(r["step_times_s"]) <= r["step_median_s"] <= max(r["step_times_s"])
    assert (r["optimizer_mean_s"] is None) == (mode != "train_step")
    assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_median_s"])
    assert r["mfu"] is None  # no GPU, no named peak
    assert r["n_params"] == get_config("debug").n_params


def test_train_step_updates_weights_and_phases_cover_the_step():
    cfg = BenchmarkConfig(mode="train_step", **TINY)
    runner = benchmark.StepRunner(cfg, torch.device("cpu"))
    before = runner.model.lm_head.weight.detach().clone()
    times = runner.step()
    assert not torch.equal(before, runner.model.lm_head.weight)
    assert set(times) == {"forward", "backward", "optimizer", "step"}


def test_oom_becomes_a_row(monkeypatch):
    def explode(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(benchmark.StepRunner, "step", explode)
    r = run_benchmark(BenchmarkConfig(**TINY))
    assert r["status"] == "oom" and "out of memory" in r["error"]
    assert "step_mean_s" not in r


def test_sweep_continues_past_oom_and_writes_rows_as_it_goes(monkeypatch, tmp_path):
    real_step = benchmark.StepRunner.step
    seen_rows = []

    def step(self):
        seen_rows.append(len(read_records(out)))  # rows on disk when this point runs
        if self.cfg.context_length == 64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_step(self)

    monkeypatch.setattr(benchmark.StepRunner, "step", step)
    out = tmp_path / "sweep.jsonl"
    cfgs = [BenchmarkConfig(**{**TINY, "context_length": c}) for c in (16, 64, 32)]
    records = run_sweep(cfgs, out_path=out, progress=False)
    assert [r["status"] for r in records] == ["ok", "oom", "ok"]
    on_disk = read_records(out)
    assert [r["context_length"] for r in on_disk] == [16, 64, 32]
    assert max(seen_rows) == 2  # the third point ran with the first two already written
    env = on_disk[0]["env"]
    for key in ("gpu", "driver", "torch", "triton", "cuda", "git_commit", "date"):
        assert key in env


def test_sweep_lists_points_past_its_budget_without_running_them(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(benchmark, "run_benchmark", lambda cfg: ran.append(cfg.context_length) or
                        {"context_length": cfg.context_length, "status": "ok"})
    ticks = iter(range(100))
    budget = Budget(seconds=1.5, clock=lambda: float(next(ticks)))  # one second per question asked
    cfgs = [BenchmarkConfig(**{**TINY, "context_length": c}) for c in (16, 32, 64)]
    records = run_sweep(cfgs, out_path=tmp_path / "b.jsonl", progress=False, budget=budget)
    assert ran == [16] and [r["status"] for r in records] == ["ok", SKIPPED, SKIPPED]
    assert [r["context_length"] for r in read_records(tmp_path / "b.jsonl")] == [16, 32, 64]


def test_warmup_sweep_reruns_train_steps_that_ran_and_lists_the_rest(monkeypatch, tmp_path):
    seen = []

    def fake_sweep(configs, **kwargs):
        assert kwargs["isolate"] is True  # a cold start needs a fresh process
        seen.extend((c.context_length, c.warmup) for c in configs)
        return [{**dataclasses.asdict(c), "status": "ok"} for c in configs]

    monkeypatch.setattr(benchmark, "run_sweep", fake_sweep)
    ok = {**dataclasses.asdict(BenchmarkConfig(**TINY)), "status": "ok", "model_overrides": None}
    oom = {**ok, "context_length": 64, "status": "oom", "error": "CUDA out of memory"}
    forward = {**ok, "mode": "forward"}
    rows = warmup_sweep([forward, ok, oom], warmups=(0, 2), out_path=tmp_path / "w.jsonl", progress=False)
    assert seen == [(32, 0), (32, 2)]  # only the train step that ran; forward records are not warm-up points
    skipped = [r for r in rows if r["status"] != "ok"]
    assert [(r["context_length"], r["warmup"]) for r in skipped] == [(64, 0), (64, 2)]
    assert skipped[0]["status"] == "skipped (train step oom in the timing sweep)"
    assert len(read_records(tmp_path / "w.jsonl")) == 2  # the skipped rows (the fake sweep wrote none)


def test_config_of_reads_a_record_back():
    cfg = BenchmarkConfig(**{**TINY, "model_overrides": {"d_ff": 256}})
    record = run_benchmark(cfg)
    assert isinstance(record["model_overrides"], str)  # flattened for the results file
    assert config_of(record) == cfg


def test_isolated_sweep_runs_in_a_fresh_process(tmp_path):
    records = run_sweep([BenchmarkConfig(**{**TINY, "warmup": 0})], out_path=tmp_path / "x.jsonl",
                        progress=False, isolate=True)
    assert records[0]["status"] == "ok" and records[0]["warmup_times_s"] == []


def test_around_measure_and_on_step_hooks_wrap_only_measured_steps():
    events = []

    class Recorder:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    run_benchmark(BenchmarkConfig(**TINY), around_measure=Recorder, on_step=lambda i: events.append(i))
    assert events == ["enter", 0, 1, 2, "exit"]


@pytest.mark.parametrize("bad, message", [
    (dict(model="gigantic"), "unknown model size"),
    (dict(model_overrides={"n_heads": 5}), "divisible by n_heads"),
    (dict(context_length=4096), "exceeds the model's maximum"),
    (dict(mode="sideways"), "mode must be"),
    (dict(precision="fp8"), "precision must be"),
    (dict(attn_impl="magic"), "unknown attention"),
])
def test_invalid_configs_raise_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        BenchmarkConfig(**{**TINY, **bad})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "systems.bench.benchmark", *args], capture_output=True, text=True)


def test_cli_prints_json_records(tmp_path):
    out = tmp_path / "cli.jsonl"
    proc = _cli("--model-size", "debug", "--context-length", "16", "32", "--warmup-steps", "1",
                "--measure-steps", "2", "--profile-type", "forward", "--use-mixed-precision", "--dtype", "bf16",
                "--device", "cpu", "--json", "--jsonl", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["context_length"] for r in rows] == [16, 32]
    assert all(r["mode"] == "forward" and r["precision"] == "bf16" for r in rows)
    assert len(read_records(out)) == 2


@pytest.mark.parametrize("args, message", [
    (["--model-size", "nope"], "unknown model size"),
    (["--model-size", "debug", "--n-heads", "5"], "divisible by n_heads"),
    (["--model-size", "debug", "--context-length", "9999"], "exceeds the model's maximum"),
    (["--model-size", "debug", "--mode", "forward", "--profile-type", "training"], "not both"),
])
def test_cli_bad_input_exits_non_zero_with_message(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_unknown_choice():
    proc = _cli("--model-size", "debug", "--precision", "fp8")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_compile_scope_blocks_compiles_each_block_lazily():
    from systems.bench.benchmark import StepRunner

    cfg = BenchmarkConfig(model="debug", context_length=16, batch_size=1, compile="blocks", device="cpu")
    runner = StepRunner(cfg, torch.device("cpu"))
    # nothing compiles until a block runs; the model itself stays the eager callable
    assert runner.train_step.forward is runner.model
    assert all(block._compiled_call_impl is not None for block in runner.model.layers)
    with pytest.raises(ValueError, match="compile"):
        BenchmarkConfig(model="debug", compile="everything")


def test_seed_tool_cli_options_parse():
    args = build_parser().parse_args(["--model-size", "2.7B", "--context-length", "128", "256", "--batch-size", "4",
                                      "--warmup-steps", "1", "--measure-steps", "2", "--profile-type", "forward",
                                      "--use-mixed-precision", "--dtype", "bf16", "--output", "snap.pickle",
                                      "--device", "cpu"])
    cfgs = configs_from_args(args)
    assert [c.context_length for c in cfgs] == [128, 256]
    c = cfgs[0]
    assert (c.model, c.batch_size, c.warmup, c.steps, c.mode, c.precision, c.device) == \
        ("2.7B", 4, 1, 2, "forward", "bf16", "cpu")
    assert args.output == "snap.pickle"
    train = configs_from_args(build_parser().parse_args(["--model-size", "debug", "--context-length", "64", "--profile-type", "training"]))
    assert train[0].mode == "train_step" and train[0].precision == "fp32"


def test_cli_writes_under_build_unless_told_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--model-size", "debug", "--context-length", "16", "--warmup-steps", "0", "--measure-steps", "2",
                 "--mode", "forward", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "step median" in out and "rows appended to build/benchmark/benchmark.jsonl" in out
    assert len(read_records(tmp_path / "build" / "benchmark" / "benchmark.jsonl")) == 1
    # a snapshot needs CUDA: refused up front on a CPU, nothing run
    assert main(["--model-size", "debug", "--context-length", "16", "--device", "cpu", "--output", "s.pickle"]) == 2
    assert "CUDA memory snapshot" in capsys.readouterr().err


def test_an_out_of_memory_step_says_what_its_state_alone_needs():
    from systems.bench.benchmark import _summary

    line = _summary({"model": "10B", "context_length": 512, "mode": "train_step", "precision": "fp32",
                     "status": "oom", "error": "CUDA out of memory.", "n_params": 10**10})
    # 20 bytes a parameter: fp32 weights, gradients, two moments and AdamW's temporary
    assert "alone need about 200 GB; python -m systems.bench.sizing --model 10B" in line
