"""The 8B leaderboard step's composition (checkpointing + bucketed DDP + ZeRO-1 sharded fused
AdamW + fused summed cross-entropy) against plain single-process training, on 2 gloo ranks."""

import pytest
import torch

from systems.config import get_config
from systems.bench import leaderboard as lb
from systems.parallel.launch import spawn

# eager blocks: Inductor's CPU compile of the debug model would dominate the test (the GPU compiles)
CFG = dict(model="debug", context_length=32, batch_size=4, precision="fp32", lr=1e-2, bucket_size_mb=0.05,
           compile_blocks=False, out_path=None)
STEPS = 2


def _train_worker(ctx, cfg_dict):
    cfg = lb.LeaderboardConfig(**cfg_dict)
    model, step, losses = lb.make_training(cfg, ctx)
    for _ in range(STEPS):
        step()
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def _reference() -> dict:
    from systems.model import TransformerLM
    from systems.optim import AdamW, cross_entropy

    cfg = lb.LeaderboardConfig(**CFG)
    mcfg = get_config("debug", context_length=cfg.context_length)
    torch.manual_seed(cfg.seed)
    model = TransformerLM(mcfg)
    opt = AdamW(model.parameters(), lr=cfg.lr)
    batches = [lb.rank_batch(cfg, rank=r, world_size=2, vocab_size=mcfg.vocab_size, device=torch.device("cpu"))
               for r in range(2)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    for _ in range(STEPS):
        # each rank's loss is a sum over its tokens and DDP averages the ranks' gradients: the
        # full batch's summed loss divided by the world size
        loss = cross_entropy(model(x), y) * y.numel() / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_save", ["none", "attention"])
def test_leaderboard_step_equals_single_process_training(checkpoint_save):
    results = spawn(_train_worker, 2, "gloo", args=({**CFG, "checkpoint_save": checkpoint_save},), timeout_s=120)
    ref = _reference()
    for rank_params in results:
        for name, p in rank_params.items():
            # fp32 throughout; the fused loss sums chunk by chunk and the all-reduce sums in another
            # order, so only rounding differs, amplified a little by AdamW's division by sqrt(v)
            torch.testing.assert_close(p, ref[name].detach(), rtol=1e-4,
                                       atol=1e-5, msg=name)


def test_config_errors_are_readable():
    with pytest.raises(ValueError, match="checkpoint_save must be one of none, attention"):
        lb.LeaderboardConfig(**{**CFG, "checkpoint_save": "all"}).plan()
    with pytest.raises(ValueError, match="set checkpoint_group too"):
        lb.LeaderboardConfig(**{**CFG, "checkpoint_group": 0, "checkpoint_save": "attention"}).plan()
    with pytest.raises(ValueError, match="precision"):
        lb.LeaderboardConfig(model="debug", context_length=64, precision="fp8")
    with pytest.raises(ValueError, match="evenly"):
        lb.LeaderboardConfig(model="debug", context_length=64, batch_size=3).check_world_size(2)


def test_cli_rejects_a_batch_that_does_not_split():
    with pytest.raises(SystemExit) as exc:
        lb.main(["--global-batch", "3", "--world-size", "2", "--model", "debug"])
    assert exc.value.code == 2


def test_cli_checkpoint_group_0_turns_checkpointing_off_without_a_second_flag(monkeypatch, capsys):
    seen = []

    def fake_run(cfg, *, world_size, backend):
        seen.append(cfg)
        return {"step_s": 0.5, "world_size": world_size, "backend": "gloo", "tflops_per_gpu": 0.00123,
                "per_rank": [{"peak_memory_gib": None}]}

    monkeypatch.setattr(lb, "run_leaderboard", fake_run)
    assert lb.main(["--model", "debug", "--context-length", "64", "--checkpoint-group", "0"]) == 0
    assert lb.main(["--model", "debug", "--context-length", "64"]) == 0
    assert [(c.checkpoint_group, c.checkpoint_save) for c in seen] == [(0, "none"), (1, "attention")]
    assert "0.00123 TFLOP/s per GPU" in capsys.readouterr().out  # a CPU's small rate is not printed as 0


def test_attention_defaults_to_ours_on_a_gpu(monkeypatch):
    # the handout: a submission's implementation must be its own; the Triton kernels need a GPU
    monkeypatch.setattr(lb.LeaderboardConfig, "resolved_device", lambda self: torch.device("cpu"))
    assert lb.LeaderboardConfig(model="debug", context_length=64).attn_impl == "sdpa"
    monkeypatch.setattr(lb.LeaderboardConfig, "resolved_device", lambda self: torch.device("cuda"))
    assert lb.LeaderboardConfig(model="debug", context_length=64).attn_impl == "flash_triton"
    assert lb.LeaderboardConfig(model="debug", context_length=64, attn_impl="sdpa").attn_impl == "sdpa"


def test_sdpa_backend_is_validated_and_restricts_sdpa():
    with pytest.raises(ValueError, match="sdpa_backend"):
        lb.LeaderboardConfig(model="debug", context_length=64, sdpa_backend="fastest")
    with lb.sdpa_backends("cudnn"):
        # the math and memory-efficient fallbacks are off inside; flash stays as cuDNN's fallback
        assert not torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()
    with lb.sdpa_backends("auto"):
        assert torch.backends.cuda.math_sdp_enabled()


def _committed_rows():
    from systems.measure.env import REPO_ROOT
    from systems.measure.results import read_records

    return read_records(REPO_ROOT / lb.COMMITTED_ROWS)


def test_only_the_leaderboards_configuration_passes():
    committed = _committed_rows()[-1]  # 8B, 2 x H200 (139.8 GiB), nccl: the leaderboard's configuration
    assert lb.leaderboard_mismatch(committed) is None
    # what `python -m systems.bench.leaderboard --model debug --context-length 64 --backend gloo` appends on a CPU
    debug = dict(model="debug", batch_size=2, context_length=64, precision="bf16", world_size=2, backend="gloo",
                 status="ok", step_s=0.02, env=dict(gpu=None, gpu_count=0))
    why = lb.leaderboard_mismatch(debug)
    assert "model 'debug'" in why and "context_length 64" in why and "no GPU" in why and "gloo" in why
    small_gpus = {**committed, "env": {**committed["env"], "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1}}
    assert "it needs 130 GiB" in lb.leaderboard_mismatch(small_gpus)
    assert "world_size 1" in lb.leaderboard_mismatch({**committed, "world_size": 1})


@pytest.mark.slow
def test_a_debug_row_from_the_cli_is_never_shown_as_the_8b_step(tmp_path):
    # the command line on this CPU (2 gloo ranks, the debug model) appends a row; the notebook's
    # reader passes over it and shows the committed 8B row instead
    from systems.measure.env import REPO_ROOT
    from systems.report.fast_train_step import leaderboard_row

    out = tmp_path / "12_leaderboard_8b.jsonl"
    assert lb.main(["--model", "debug", "--context-length", "32", "--backend", "gloo", "--warmup", "1", "--steps", "1",
                    "--no-compile-blocks", "--out", str(out)]) == 0
    row, source, passed_over = leaderboard_row([out, REPO_ROOT / lb.COMMITTED_ROWS])
    assert source == lb.COMMITTED_ROWS and row["model"] == "8B" and row["env"]["gpu"]
    assert len(passed_over) == 1 and "model 'debug'" in passed_over[0] and "no GPU" in passed_over[0]
