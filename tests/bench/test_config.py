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
