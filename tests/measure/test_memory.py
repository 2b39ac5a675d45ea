"""Memory tooling on the CPU: the timeline of a hand-made snapshot, allocation listing, the one
saved-tensor counter, gradients measured from allocator changes, and the probe that reads
allocated bytes the same way on both devices."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from systems.attention.naive import naive_attention
from systems.config import get_config
from systems.measure import memory
from systems.model import TransformerLM

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


def test_block_total_counts_each_allocation_as_its_allocator_block():
    # P: 3 MiB requested before recording, the snapshot's segment shows its block is 4 MiB; X: a 1000-byte
    # request, freed before the snapshot, so only its 512-byte rounding (1024) is known; Y: 2 MiB requested,
    # still allocated at the end in a 3 MiB block. Exact: every size is an integer number of bytes.
    ev = [{"action": "alloc", "addr": 0x1000, "size": 1000, "frames": []},
          {"action": "alloc", "addr": 0x2000_0000, "size": 2 * MiB, "frames": []},
          {"action": "free_completed", "addr": 0x1000, "size": 1000, "frames": []}]
    segments = [{"device": 0, "address": 0x9000_0000, "blocks": [
                    {"size": 4 * MiB, "requested_size": 3 * MiB, "state": "active_allocated", "frames": []}]},
                {"device": 0, "address": 0x2000_0000, "blocks": [
                    {"size": 3 * MiB, "requested_size": 2 * MiB, "state": "active_allocated", "frames": []}]}]
    tl = memory.build_timeline({"device_traces": [ev], "segments": segments})
    assert tl.total.tolist() == [3 * MiB, 3 * MiB + 1000, 5 * MiB + 1000, 5 * MiB]  # the requests
    assert tl.block_total().tolist() == [4 * MiB, 4 * MiB + 1024, 7 * MiB + 1024, 7 * MiB]
    # where every request is a 512-byte multiple and every block shown is the request, the two agree
    synthetic = memory.build_timeline(_synthetic_snapshot())
    np.testing.assert_array_equal(synthetic.block_total(), synthetic.total)


def test_free_of_allocation_made_before_recording_counts_from_the_start():
    snap = {"device_traces": [[{"action": "free_completed", "addr": 8, "size": 1000, "frames": []},
                               {"action": "alloc", "addr": 16, "size": 10, "frames": []}]], "segments": []}
    tl = memory.build_timeline(snap)
    assert tl.total.tolist() == [1000, 0, 10]


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


def test_record_snapshot_is_a_warning_no_op_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: record_snapshot records")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        with memory.record_snapshot(tmp_path / "s.pickle") as p:
            assert p is None
    assert not (tmp_path / "s.pickle").exists()


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


def test_saved_tensor_report_counts_the_softmax_output_once_and_measures_the_gradients():
    cfg = get_config("debug")
    block = TransformerLM(cfg).layers[0]
    b, t = 2, 64
    x = torch.randn(b, t, cfg.d_model, requires_grad=True)  # as the report makes it: its input is saved too
    rep = memory.saved_tensor_report(block, x, torch.arange(t))
    by_op = memory.saved_tensors(block, x, torch.arange(t)).by_op().set_index("op")
    # softmax saves P and P @ V saves it again: one storage, charged to softmax
    assert by_op.loc["SoftmaxBackward0", "bytes"] == b * cfg.n_heads * t * t * 4
    assert by_op["bytes"].sum() == rep.total_bytes
    back = rep.backward
    # the forward left the saved tensors (but not the input, made before) and the output allocated
    assert back.output_bytes == b * t * cfg.d_model * 4
    assert back.forward_bytes >= rep.total_bytes - b * t * cfg.d_model * 4
    # the backward frees the saved tensors and writes the gradients; after dropping the output,
    # exactly the gradients stay (CPU: the tracker counts storage bytes, no allocator rounding)
    assert back.backward_change_bytes < 0
    assert back.grad_bytes == back.expected_grad_bytes


def test_saved_tensors_of_naive_attention_is_the_probability_matrix_and_leaks_nothing():
    b, s, d = 2, 16, 4
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    saved = memory.saved_tensors(naive_attention, q, k, v, exclude=(q, k, v))
    # exact: the softmax output P (b x s x s fp32) is the only non-input storage autograd keeps
    assert saved.total_bytes() == b * s * s * 4
    assert {t.op for t in saved.tensors if t.kind == "activation"} == {"SoftmaxBackward0", "BmmBackward0"}
    assert saved.total_bytes("excluded") == 3 * b * s * d * 4
    # after the call nothing it made is alive: the hooks pack detached aliases, so softmax's saved
    # output does not refer back to the node that saves it (a cycle the garbage collector cannot see)
    with memory.LiveTensorTracker() as tracker:
        memory.saved_tensors(naive_attention, q, k, v)
        gc.collect()
        assert tracker.live_bytes() == 0


def test_saved_tensors_rejects_an_unknown_kind():
    q = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="kind must be one of"):
        memory.saved_tensors(torch.sin, q).total_bytes("weights")


def test_tracker_counts_new_storages_only_and_follows_their_death():
    x = torch.randn(256)  # 1 KiB, made before the tracker: neither it nor its views count
    with memory.LiveTensorTracker() as tracker:
        view = x.view(16, 16).t()
        x.mul_(2)
        assert tracker.live_bytes() == 0
        y = x * 2
        z = y + 1
        assert tracker.live_bytes() == 2 * 1024
        del y
        assert tracker.live_bytes() == 1024
        assert tracker.take_peak() == 2 * 1024  # then the high-water mark restarts from what is live
        assert tracker.take_peak() == 1024
    del view, z


def test_probe_marks_give_per_phase_peaks_on_a_cpu():
    probe = memory.MemoryProbe("cpu")
    with probe:
        marks = memory.ProbeMarks(probe)
        marks.mark("start")
        a = torch.zeros(1024)  # 4 KiB
        b = torch.zeros(2048)  # 8 KiB
        del b
        marks.mark("forward")
        c = torch.zeros(256)  # 1 KiB
        marks.mark("backward")
    assert marks.peak_bytes("forward") == 12 * 1024
    assert marks.allocated_bytes("forward") == 4 * 1024
    assert marks.peak_bytes("backward") == 5 * 1024  # not cumulative: this phase's own high-water mark
    assert marks.ms("start", "backward") >= 0
    del a, c


def test_allocator_bytes_rounds_like_the_cuda_caching_allocator():
    assert memory.allocator_bytes(1, "cuda") == 512 and memory.allocator_bytes(513, "cuda") == 1024
    assert memory.allocator_bytes(513, "cpu") == 513
