"""systems.bench.sizing: the closed forms it adds up, checked against hand arithmetic."""

import pytest

from systems.bench import sizing
from systems.config import get_config
from systems.measure.flops import train_step_flops
from systems.measure.hardware import GPU_PEAKS


def test_a_run_is_sized_from_the_handouts_accounting():
    n = get_config("2.7B").n_params
    rows = {r["scheme"]: r for r in sizing.size_run(model="2.7B", world_size=8, gpu="H100", context_length=512,
                                                      global_batch=16, mfu=0.5)}
    assert list(rows) == ["DDP", "DDP + sharded optimizer", "ZeRO-1", "FSDP"]
    # DDP: fp32 weights, gradients, two moments and one AdamW temporary, 4 bytes each: 20 bytes a parameter
    assert rows["DDP"]["total_GB"] == pytest.approx(20 * n / 1e9)
    # FSDP shards all of it over 8 GPUs; the sharded optimizer only the moments and the temporary
    assert rows["FSDP"]["total_GB"] == pytest.approx(20 * n / 8 / 1e9)
    assert rows["DDP + sharded optimizer"]["total_GB"] == pytest.approx((8 + 12 / 8) * n / 1e9)
    assert rows["DDP"]["left_for_activations_GB"] == pytest.approx(80 - 20 * n / 1e9)
    # the all-reduce's ring: 2 (N-1)/N of the fp32 gradients, at half of NVLink's 900 GB/s
    assert rows["DDP"]["comm_GB"] == pytest.approx(2 * 7 / 8 * 4 * n / 1e9)
    assert rows["DDP"]["comm_s"] == pytest.approx(rows["DDP"]["comm_GB"] / 450)
    flops = train_step_flops(get_config("2.7B"), batch=16, seq=512)
    assert rows["FSDP"]["compute_s"] == pytest.approx(flops / 8 / (GPU_PEAKS["H100"].bf16_tflops * 1e12 * 0.5))


def test_one_gpu_is_one_row_and_unlisted_figures_must_be_given():
    rows = sizing.size_run(model="debug", world_size=1, gpu="H100", context_length=64, global_batch=2, mfu=0.4)
    assert [r["scheme"] for r in rows] == ["one GPU"] and rows[0]["comm_GB"] == 0
    with pytest.raises(ValueError, match="--memory-gb"):
        sizing.size_run(model="debug", world_size=2, gpu="A100", context_length=64, global_batch=2, mfu=0.4)
    rows = sizing.size_run(model="debug", world_size=2, gpu="A100", context_length=64, global_batch=2, mfu=0.4,
                           memory_gb=80)
    assert rows[0]["comm_s"] != rows[0]["comm_s"]  # no NVLink figure listed for it: no time, not a guess
    with pytest.raises(ValueError, match="mfu"):
        sizing.size_run(model="debug", world_size=2, gpu="H100", context_length=64, global_batch=2, mfu=40)
    with pytest.raises(ValueError, match="link_gb_s must be positive"):  # would print a negative time
        sizing.size_run(model="debug", world_size=2, gpu="H100", context_length=64, global_batch=2, mfu=0.4,
                        link_gb_s=-5.0)


def test_cli_prints_the_table_and_names_what_does_not_fit(capsys):
    assert sizing.main(["--model", "8B", "--world-size", "1", "8", "--gpu", "H100"]) == 0
    captured = capsys.readouterr()
    assert "left_for_activations_GB" in captured.out and "activations not counted" in captured.out
    assert "does not fit before activations: 8B on 1 (one GPU); 8B on 8 (DDP)" in captured.err
    with pytest.raises(SystemExit) as exc:
        sizing.main(["--model", "xl"])  # ambiguous between the handouts: a usage error
    assert exc.value.code == 2


def test_the_readmes_sizing_commands_run(capsys):
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m systems.bench.sizing ")]
    assert len(commands) >= 2
    for line in commands:
        assert sizing.main(shlex.split(line)[3:]) == 0, line
    assert "left_for_activations_GB" in capsys.readouterr().out
