"""The fields every harness shares, checked once, before any work."""

import argparse

import pytest
import torch

from systems.bench.config import RunConfig, model_argument


@pytest.mark.parametrize("bad, message", [
    (dict(model="huge"), "unknown model size"),
    (dict(model="xl"), "names two sizes"),
    (dict(model="debug", context_length=4096), "exceeds the model's maximum 256 .*--max-context"),
    (dict(model="debug", context_length=64, batch_size=0), "batch_size must be"),
    (dict(model="debug", context_length=64, device="tpu"), "device must be"),
])
def test_bad_fields_fail_with_a_readable_message(bad, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_a_config_error():
    with pytest.raises(ValueError, match="no CUDA GPU.*--device cpu"):
        RunConfig(model="debug", context_length=64, device="cuda")


def test_world_size_must_split_the_batch():
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        RunConfig(model="debug", context_length=64, batch_size=4).check_world_size(3)


@pytest.mark.parametrize("tool", ["benchmark", "train_step", "flash", "flash_tuning", "fused", "allreduce", "ddp",
                                  "fsdp", "leaderboard", "profile"])
def test_commands_write_under_build_unless_told(tool, monkeypatch):
    """No command writes into the committed results/ unless the user names it: every output
    option defaults to nothing or to a path under build/."""
    import argparse
    import importlib

    seen = {}

    def capture(parser, args=None, namespace=None):
        seen["parser"] = parser
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    module = importlib.import_module(f"systems.bench.{tool}")
    with pytest.raises(SystemExit):
        module.main([])
    outputs = [a for a in seen["parser"]._actions if a.dest in ("out", "out_dir", "jsonl", "output")]
    for action in outputs:
        assert action.default is None or str(action.default).startswith("build/"), (tool, action.dest, action.default)
    from systems.bench.ddp import DDPBenchConfig
    from systems.bench.fsdp import FSDPBenchConfig
    from systems.bench.leaderboard import LeaderboardConfig

    for path in (DDPBenchConfig.out_path, DDPBenchConfig.overlap_path, DDPBenchConfig.trace_dir,
                 FSDPBenchConfig.fsdp_path, FSDPBenchConfig.opt_path, FSDPBenchConfig.gather_path,
                 LeaderboardConfig.out_path):
        assert path.startswith("build/"), path


def test_an_unknown_model_is_a_one_line_usage_error_before_anything_runs(capsys):
    from systems.bench import train_step

    with pytest.raises(SystemExit) as exc:
        train_step.main(["--model", "nosuch", "--variants", "ours_eager"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model size 'nosuch'; choose one of debug" in err
    assert "ours_graphs_overlap_split" not in err  # the usage line names VARIANT, not all the variants
    assert "'xl' names two sizes" in str(pytest.raises(argparse.ArgumentTypeError, model_argument, "xl").value)


def test_run_cli_ends_a_failed_distributed_run_with_its_error_and_status_1(capsys):
    from systems.bench.config import run_cli
    from systems.parallel.launch import DistributedRunError

    def failing() -> int:
        raise DistributedRunError("rank 1 of 2 was killed by signal SIGKILL", rank=1)

    assert run_cli(failing) == 1
    assert capsys.readouterr().err == "error: rank 1 of 2 was killed by signal SIGKILL\n"
    assert run_cli(lambda: 0) == 0

    def other() -> int:
        raise ValueError("not ours to catch")

    with pytest.raises(ValueError):  # any other error keeps its traceback
        run_cli(other)


def test_a_world_size_below_one_is_a_config_error_not_a_division():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        RunConfig(model="debug", context_length=64).check_world_size(0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0, backend="gloo"), "world_size must be a positive integer"),
    (dict(world_size=2, backend="bogus"), "backend must be one of"),
    (dict(world_size=2, backend="gloo", timeout_s=0.0), "--timeout-s must be positive"),
])
def test_launch_options_are_checked_before_any_process_starts(kwargs, message):
    from systems.bench.config import check_launch

    with pytest.raises(ValueError, match=message):
        check_launch(**kwargs)
    assert check_launch(world_size=2, backend="gloo", timeout_s=30.0) == 2  # a good set passes


def test_under_torchrun_the_launchers_world_size_is_the_one_checked(monkeypatch):
    # torchrun sets WORLD_SIZE and the command's --world-size is ignored: the batch must split over 4
    from systems.bench.config import check_launch

    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert check_launch(world_size=2, backend="gloo") == 4
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        RunConfig(model="debug", context_length=64, batch_size=2).check_world_size(check_launch(world_size=2,
                                                                                                backend="gloo"))


@pytest.mark.parametrize("tool, argv, message", [
    ("ddp", ["--model", "debug", "--context-length", "64", "--world-size", "0"], "world_size must be a positive"),
    ("fsdp", ["--model", "debug", "--context-length", "64", "--backend", "bogus"], "backend must be one of"),
    ("leaderboard", ["--model", "debug", "--context-length", "64", "--world-size", "-1"], "world_size must be"),
    ("ddp", ["--model", "debug", "--context-length", "64", "--out-dir", "/proc/no/such"], "cannot create /proc/no"),
    ("train_step", ["--model", "debug", "--variants", "ours_eager", "--out", "/proc/no/such.jsonl"],
     "cannot create /proc/no"),
    ("benchmark", ["--model", "debug", "--jsonl", "."], "is not a file"),
    ("allreduce", ["--sizes-mb", "-1"], "--sizes-mb must all be positive"),
    ("flash", ["--grid", "smoke", "--device", "cpu", "--budget-s", "0"], "--budget-s must be positive"),
])
def test_bad_launch_and_output_options_are_one_line_usage_errors(tool, argv, message, capsys, tmp_path, monkeypatch):
    import importlib

    monkeypatch.chdir(tmp_path)  # the tools make their default build/<tool>/ folders where they run
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"systems.bench.{tool}").main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and message in err[-1] and "Traceback" not in "\n".join(err)


def test_output_arguments_name_what_is_wrong_with_the_path(tmp_path):
    from systems.bench.config import out_dir_argument, out_file_argument

    assert out_file_argument(str(tmp_path / "new" / "rows.jsonl")) == str(tmp_path / "new" / "rows.jsonl")
    assert (tmp_path / "new").is_dir()
    assert out_dir_argument(str(tmp_path / "dir")) == str(tmp_path / "dir") and (tmp_path / "dir").is_dir()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a file"):
        out_file_argument(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="a file is in the way"):
        out_dir_argument(str(tmp_path / "a_file"))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create /proc/no: .*give another results path"):
        out_file_argument("/proc/no/such.jsonl")


@pytest.mark.parametrize("tool, argv", [
    ("train_step", ["--model", "debug", "--variants", "ours_eager", "--steps", "0"]),
    ("flash", ["--device", "bogus"]),
])
def test_a_bad_option_leaves_the_last_runs_results_file_as_it_was(tool, argv, tmp_path, monkeypatch):
    # a results file is started afresh (the old rows moved aside) only once every option is good
    import importlib

    monkeypatch.chdir(tmp_path)

    out = tmp_path / "rows.jsonl"
    out.write_text('{"kept": 1}\n')
    with pytest.raises(SystemExit):
        importlib.import_module(f"systems.bench.{tool}").main([*argv, "--out", str(out)])
    assert out.read_text() == '{"kept": 1}\n' and not (tmp_path / "rows.jsonl.previous").exists()
