"""Memory tooling on the CPU: the offline timeline on a hand-made snapshot, allocation listing,
saved-tensor accounting, the seed-tool CLI, and checkpointing wrappers."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from systems.bench import memory as bench_memory
from systems.measure import memory
from systems.parallel import checkpoint as checkpointing
from systems.bench.benchmark import build_parser, configs_from_args
from systems.config import get_config
from systems.model import TransformerLM
from systems.optim import cross_entropy

MiB = 2**20


def _frames(file: str, line: int, name: str) -> list[dict]:
    return [{"filename": file, "line": line, "name": name},
            {"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]


def _synthetic_snapshot() -> dict:
    """One block (3 MiB) alive before recording, then: A=1 MiB and B=4 MiB allocated in forward,
    A freed, C=2 MiB allocated in backward, B freed, D=0.5 MiB in the optimizer."""
    fwd = _frames("/repo/systems/model.py", 10, "forward")
    bwd = _frames("/x/site-packages/torch/_tensor.py", 5, "backward")
    opt = _frames("/repo/systems/optim.py", 40, "step")
    ev = []

    def alloc(addr, size, frames):
        ev.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames})

    def free(addr, size):
        for action in ("free_requested", "free_completed"):
            ev.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": []})

    alloc(0x1000_0000, 1 * MiB, fwd)  # A
    alloc(0x2000_0000, 4 * MiB, fwd)  # B
    free(0x1000_0000, 1 * MiB)
    alloc(0x3000_0000, 2 * MiB, bwd)  # C
    alloc(0x3100_0000, MiB // 4, [])  # frameless (autograd thread): inherits backward
    free(0x3100_0000, MiB // 4)
    free(0x2000_0000, 4 * MiB)
    alloc(0x4000_0000, MiB // 2, opt)  # D
    segments = [{"device": 0, "address": 0x9000_0000, "total_size": 8 * MiB, "stream": 0, "blocks": [
        {"size": 3 * MiB, "requested_size": 3 * MiB, "state": "active_allocated", "frames": []},
        {"size": 5 * MiB, "state": "inactive"}]},
        {"device": 0, "address": 0x3000_0000, "total_size": 4 * MiB, "stream": 0, "blocks": [
            {"address": 0x3000_0000, "size": 2 * MiB, "requested_size": 2 * MiB, "state": "active_allocated",
             "frames": _frames("/repo/systems/model.py", 10, "forward")},
            {"address": 0x3100_0000 - 0x0000_0000, "size": MiB // 2, "state": "inactive"},
            {"address": 0x4000_0000, "size": MiB // 2, "requested_size": MiB // 2, "state": "active_allocated",
             "frames": opt}]}]
    return {"device_traces": [ev], "segments": segments}


def test_timeline_curve_and_peak_on_synthetic_snapshot():
    tl = memory.build_timeline(_synthetic_snapshot())
    # x=0 is the pre-existing 3 MiB block; each alloc/free_completed moves the curve once
    expected = np.array([3, 4, 8, 7, 9, 9.25, 9, 5, 5.5]) * MiB
    np.testing.assert_array_equal(tl.total, expected.astype(np.int64))
    assert tl.peak_bytes == int(9.25 * MiB) and tl.peak_index == 5
    assert tl.baseline_bytes == 3 * MiB
    assert [(p.name, p.start, p.end) for p in tl.phases] == [("forward", 1, 3), ("backward", 4, 7), ("optimizer", 8, 8)]
    assert tl.phase_peaks() == {"forward": 8 * MiB, "backward": int(9.25 * MiB), "optimizer": int(5.5 * MiB)}
    assert sum(a.preexisting for a in tl.allocations) == 1  # C and D are live at the end but traced


def test_free_of_allocation_made_before_recording_counts_from_the_start():
    snap = {"device_traces": [[{"action": "free_completed", "addr": 8, "size": 1000, "frames": []},
                               {"action": "alloc", "addr": 16, "size": 10, "frames": []}]], "segments": []}
    tl = memory.build_timeline(snap)
    assert tl.total.tolist() == [1000, 0, 10]


def test_render_timeline_writes_png_and_html(tmp_path):
    tl = memory.render_timeline(_synthetic_snapshot(), tmp_path / "t.png", top_k=2)
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "snapshot.pickle" in (tmp_path / "t.html").read_text()
    assert tl.peak_bytes == int(9.25 * MiB)


def test_empty_snapshot_gives_a_clear_error():
    with pytest.raises(ValueError, match="no device_traces"):
        memory.build_timeline({"device_traces": [[]], "segments": []})


def test_largest_allocations_sizes_and_user_source_lines():
    df = memory.largest_allocations(_synthetic_snapshot(), k=3)
    assert df["size_bytes"].tolist() == [4 * MiB, 3 * MiB, 2 * MiB]
    assert df["source"].iloc[0] == "systems/model.py:10 forward"  # torch frames are dropped
    assert df["source"].iloc[1] == "(allocated before recording)"
    assert df["phase"].iloc[2] == "backward"
    assert df["size_mib"].iloc[0] == 4.0


def test_user_frames_parse_profiler_style_frames():
    frames = [{"filename": "none", "line": 0, "name": "/repo/systems/model.py(51): forward"},
              {"filename": "none", "line": 0, "name": "torch/nn/modules/module.py(1782): _call_impl"}]
    assert memory.user_frames(frames) == ["systems/model.py:51 forward"]
    assert memory.classify_frames(frames) == "forward"


def test_match_allocation_size_counts_residual_sized_blocks():
    nbytes = memory.residual_stream_bytes(batch_size=2, context_length=64, d_model=2048)
    assert nbytes == 2 * 64 * 2048 * 4 == 1 * MiB
    m = memory.match_allocation_size(_synthetic_snapshot(), nbytes)
    assert m["n_matches"] == 1 and m["by_phase"] == {"forward": 1}


def test_saved_tensor_report_on_debug_block():
    cfg = get_config("debug")
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    block = model.layers[0]
    b, t = 2, 32
    x = torch.randn(b, t, cfg.d_model)
    rep = memory.saved_tensor_report(block, x, torch.arange(t))
    assert rep.n_saved > 10 and rep.total_bytes > 0
    # the attention probabilities (b, h, t, t) fp32 are saved by softmax's backward
    assert rep.by_op["bytes"].max() >= b * cfg.n_heads * t * t * 4
    assert len(rep.by_op) == 5 and rep.by_op["share"].is_monotonic_decreasing
    assert 0 < rep.by_op["share"].sum() <= 1.0 + 1e-12
    assert rep.param_bytes_excluded > 0  # the matmuls save their weights, which are not activations
    assert rep.grad_bytes == rep.expected_grad_bytes == memory.block_grad_bytes_expected(cfg.d_model, cfg.d_ff)
    # the total is a set of unique storages, so it is at most the sum over pack calls
    assert rep.total_bytes <= rep.n_saved * max(b * cfg.n_heads * t * t * 4, b * t * cfg.d_ff * 4)


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


def test_record_snapshot_is_a_warning_no_op_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: record_snapshot records")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        with memory.record_snapshot(tmp_path / "s.pickle") as p:
            assert p is None
    assert not (tmp_path / "s.pickle").exists()


def _grads(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    cross_entropy(model(inputs), targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["group1", "group2", "group3", "nested2", "nested3"])
def test_checkpointing_gives_the_plain_gradients(how):
    cfg = get_config("debug", n_layers=5)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    ref = _grads(model, inputs, targets)
    names = [n for n, _ in model.named_parameters()]
    if how.startswith("group"):
        checkpointing.apply_activation_checkpointing(model, int(how[-1]))
    else:
        checkpointing.apply_nested_checkpointing(model, branching=int(how[-1]))
    assert [n for n, _ in model.named_parameters()] == names  # parameters keep their names
    with checkpointing.count_block_forwards(model) as calls:
        got = _grads(model, inputs, targets)
    # recomputation runs the same ops on the same inputs, so the gradients are bitwise equal
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0)
    assert sum(calls.values()) > cfg.n_layers  # each block ran again in the backward
    checkpointing.remove_activation_checkpointing(model)
    with checkpointing.count_block_forwards(model) as calls:
        _grads(model, inputs, targets)
    assert sum(calls.values()) == cfg.n_layers


def test_checkpointing_rejects_bad_group_size():
    model = TransformerLM(get_config("debug"))
    with pytest.raises(ValueError, match="group_size"):
        checkpointing.apply_activation_checkpointing(model, 3)
    with pytest.raises(ValueError, match="branching"):
        checkpointing.apply_nested_checkpointing(model, branching=1)


def test_cpu_snapshot_of_a_harness_train_step_has_the_three_phases(tmp_path):
    from systems.bench.benchmark import BenchmarkConfig, run_benchmark

    cfg = BenchmarkConfig(model="debug", context_length=32, batch_size=2, warmup=1, steps=1,
                          mode="train_step", device="cpu")
    path = tmp_path / "train.pickle"
    rec = run_benchmark(cfg, around_measure=memory.snapshot_recorder(path, "cpu"), on_step=memory.step_marker("cpu"))
    assert rec["status"] == "ok"
    tl = memory.build_timeline(path)
    assert [p.name for p in tl.phases] == ["forward", "backward", "optimizer"]
    assert len(tl.steps) == 1


@pytest.mark.slow
def test_notebook_04_smoke(tmp_path):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["04"], profile="smoke", out_dir=tmp_path, report=False, progress=False)
    assert runs and runs[0].ok, runs[0].error if runs else "no run"
    assert (tmp_path / "figures" / "04_memory_timeline_train_step.png").exists()
