"""The trace reader on synthetic Chrome traces: steps, communication against computation, overlap."""

from __future__ import annotations

import gzip
import json

import pytest

from systems.measure.trace import comm_compute_intervals, launched_spans, overlap_stats


def _launch(ts: float, correlation: int, tid: int) -> dict:
    """The host side of a kernel launch, tied to its kernel by "correlation"."""
    return {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": ts, "dur": 5, "pid": 0, "tid": tid,
            "args": {"correlation": correlation}}


def _kernel(name: str, ts: float, dur: float, stream: int, correlation: int) -> dict:
    return {"ph": "X", "name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": correlation, "stream": stream}}


def test_overlap_stats_from_a_gpu_trace(tmp_path, trace_event):
    """Exposed communication = NCCL kernel time with no other kernel running, per step."""
    ev = trace_event
    events = [
        ev("step", "gpu_user_annotation", 1000, 100), ev("step", "gpu_user_annotation", 1100, 100),
        # step 1: compute 1000-1060, comm 1050-1080 -> 10 overlapped, 20 exposed
        ev("ampere_sgemm", "kernel", 1000, 40), ev("elementwise", "kernel", 1030, 30),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 1050, 30),
        # step 2: comm 1100-1140 entirely under compute 1090-1150 (a memcpy counts as compute)
        ev("Memcpy DtoD", "gpu_memcpy", 1090, 60), ev("ncclDevKernel_AllReduce", "kernel", 1100, 40),
        ev("aten::mm", "cpu_op", 900, 500),  # CPU ops are ignored when kernels exist
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    iv = comm_compute_intervals(path)
    assert iv.kind == "gpu" and len(iv.steps) == 2
    stats = overlap_stats(iv)
    assert stats["comm_ms"] == pytest.approx(70 / 2 / 1e3)
    assert stats["overlapped_ms"] == pytest.approx(50 / 2 / 1e3)
    assert stats["exposed_comm_ms"] == pytest.approx(20 / 2 / 1e3)
    assert stats["overlap_pct"] == pytest.approx(100 * 50 / 70)
    assert stats["exposed_comm_pct_of_step"] == pytest.approx(100 * 20 / 200)


def test_gpu_step_annotations_on_two_streams_count_once(tmp_path, trace_event):
    """Kineto writes one gpu_user_annotation per (range, stream): a naive-DDP step that launches
    NCCL kernels from its own thread shows up on the compute and the NCCL stream, with the same
    External id. They are one step, not two (else every per-step number is halved)."""
    ev = trace_event
    events = [
        # NCCL stream's annotations first, as a trace may order them
        ev("step", "gpu_user_annotation", 1060, 40, 20, ext=11),
        ev("step", "gpu_user_annotation", 1160, 40, 20, ext=12),
        ev("step", "gpu_user_annotation", 1000, 90, 7, ext=11),
        ev("step", "gpu_user_annotation", 1100, 90, 7, ext=12),
        ev("step", "user_annotation", 900, 150, 1, ext=11),
        ev("sgemm", "kernel", 1000, 60, 7), ev("adam", "kernel", 1080, 10, 7),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 1060, 40, 20),
        ev("sgemm", "kernel", 1100, 60, 7), ev("adam", "kernel", 1180, 10, 7),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 1160, 40, 20),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    iv = comm_compute_intervals(path)
    assert iv.steps == [(0.0, 100.0), (100.0, 200.0)]
    stats = overlap_stats(iv)
    assert stats["profiled_steps"] == 2
    assert stats["step_window_ms"] == pytest.approx(100 / 1e3)
    assert stats["comm_ms"] == pytest.approx(40 / 1e3)  # per step, over 2 steps
    assert stats["exposed_comm_ms"] == pytest.approx(30 / 1e3)  # of 40, 1080-1090 is under adam


def test_gpu_steps_are_where_their_launches_ran_not_the_host_ranges(tmp_path, trace_event):
    """The shape of a real overlapped-DDP trace (torch 2.11, H100): the host runs ahead, so each
    CPU "step" range ends long before its kernels do; the phases nest inside the step, so Kineto
    gives the step no GPU annotation (only the innermost range, "forward", gets one); the backward
    and its NCCL all-reduces are launched by autograd's thread. Each GPU step must run from its
    first kernel to its last, NCCL kernels included, whichever thread launched them."""
    ev = trace_event
    main, autograd, compute, nccl = 1, 2, 7, 20
    events = [
        ev("step", "user_annotation", 0, 30, main), ev("forward", "user_annotation", 1, 9, main),
        ev("step", "user_annotation", 31, 20, main), ev("forward", "user_annotation", 32, 5, main),
        ev("forward", "gpu_user_annotation", 100, 40, compute, ext=2),  # the forward's kernels only
    ]
    kernels = [  # (name, start, duration, stream, launch time, launching thread)
        ("sgemm_fwd", 100, 40, compute, 2, main),
        ("sgemm_bwd", 140, 60, compute, 12, autograd),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 150, 30, nccl, 14, autograd),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 195, 15, nccl, 20, autograd),  # outlasts the backward
        ("adam", 210, 10, compute, 25, main),
        ("sgemm_fwd", 220, 40, compute, 33, main),
        ("sgemm_bwd", 260, 60, compute, 40, autograd),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 25, nccl, 42, autograd),
        ("adam", 325, 10, compute, 48, main),
    ]
    for i, (name, start, dur, stream, launched_at, thread) in enumerate(kernels):
        events += [_kernel(name, start, dur, stream, correlation=i), _launch(launched_at, correlation=i, tid=thread)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))

    assert launched_spans(events, "step") == [(100.0, 220.0), (220.0, 335.0)]
    iv = comm_compute_intervals(path)
    assert iv.origin == 100.0
    assert iv.steps == [(0.0, 120.0), (120.0, 235.0)]
    # every NCCL kernel lies inside a step window: the figure of one step shows its communication
    for a, b in iv.comm:
        assert any(lo <= a and b <= hi for lo, hi in iv.steps), (a, b)
    stats = overlap_stats(iv)
    assert stats["step_window_ms"] == pytest.approx(235 / 2 / 1e3)  # not the host's (51 - 0) / 2
    # comm 150-180, 195-210, 300-325 (70 us); exposed: 200-210 (the backward ends at 200, adam
    # starts at 210) and 320-325 (backward ends at 320, adam starts at 325)
    assert stats["comm_ms"] == pytest.approx(70 / 2 / 1e3)
    assert stats["exposed_comm_ms"] == pytest.approx(15 / 2 / 1e3)


def test_copy_engine_exchange_counts_as_communication(tmp_path):
    """systems.parallel.peer copies gradients (memcpys, no kernel) on the stream of its symmetric-
    memory barriers: those memcpys are communication; a memcpy on the compute stream is not."""
    events = [
        {"ph": "X", "name": "step", "cat": "gpu_user_annotation", "ts": 1000, "dur": 200, "pid": 0, "tid": 1},
        _kernel("nvjet_sm90_tst_320x64", 1000, 150, stream=1, correlation=1),
        _kernel("Memcpy DtoD (Device -> Device)", 1150, 20, stream=1, correlation=2) | {"cat": "gpu_memcpy"},
        _kernel("Memcpy PtoP (Device -> Device)", 1010, 100, stream=7, correlation=3) | {"cat": "gpu_memcpy"},
        _kernel("void c10d::symmetric_memory::barrier_kernel<...>", 1160, 30, stream=7, correlation=4),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    stats = overlap_stats(comm_compute_intervals(path))
    assert stats["comm_ms"] == pytest.approx(130 / 1e3)
    # the copy runs under the matmul; the barrier's last 20 us run beside nothing
    assert stats["exposed_comm_ms"] == pytest.approx(20 / 1e3)
