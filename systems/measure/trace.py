"""Communication/computation overlap from a torch.profiler Chrome trace.

GPU traces: communication = kernels whose name contains "nccl"; computation = every other kernel,
memcpy and memset (the GPU is busy with non-communication work). CPU (gloo) traces have no
kernels: communication = the "gloo:*" ranges the gloo worker threads record, computation = the
"aten::*" operators of the other threads.

exposed communication = time some communication runs while no computation does
                      = |comm| - |comm ∩ compute|, on the unions of the intervals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from systems.measure.profiler import load_trace

STEP_MARK = "train_step"  # the record_function range the benchmark puts around each step


@dataclass
class TraceIntervals:
    """Intervals in microseconds from the trace's first step start."""

    kind: str  # "gpu" or "cpu"
    comm: list[tuple[float, float]]
    compute: list[tuple[float, float]]
    steps: list[tuple[float, float]] = field(default_factory=list)


def _load(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace."""
    trace = load_trace(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _span(e: dict) -> tuple[float, float]:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def gpu_annotation_spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    """GPU-side spans of the record_function ranges called ``name``, one per range.

    Kineto writes one "gpu_user_annotation" event per (range, CUDA stream) that ran its kernels
    (GpuUserEventMap is keyed by device and stream), all carrying the CPU range's "External id".
    A step whose NCCL kernels were launched from the range's thread (naive, flat DDP; FSDP's
    forward all-gathers) therefore appears twice, once on the compute stream and once on the
    NCCL stream; counting both would halve every per-step number. Events with the same id are
    merged into one span (first start, last end); events without an id stay separate.
    """
    merged: dict[object, list[float]] = {}
    for i, e in enumerate(events):
        if e.get("cat") != "gpu_user_annotation" or e["name"] != name:
            continue
        ext = (e.get("args") or {}).get("External id")
        key = ("id", ext) if ext is not None else ("event", i)
        a, b = _span(e)
        if key in merged:
            merged[key][0] = min(merged[key][0], a)
            merged[key][1] = max(merged[key][1], b)
        else:
            merged[key] = [a, b]
    return sorted((a, b) for a, b in merged.values())


def trace_intervals(path: str | Path) -> TraceIntervals:
    events = _load(path)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if kernels:
        comm = [_span(e) for e in kernels if "nccl" in e["name"].lower()]
        compute = [_span(e) for e in kernels if "nccl" not in e["name"].lower()]
        steps = gpu_annotation_spans(events, STEP_MARK)  # one per step, not one per stream
        kind = "gpu"
    else:
        comm_events = [e for e in events if e["name"].startswith("gloo:")]
        comm_threads = {e.get("tid") for e in comm_events}
        comm = [_span(e) for e in comm_events]
        compute = [_span(e) for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
                   and e.get("tid") not in comm_threads]
        steps = []
        kind = "cpu"
    if not steps:
        steps = [_span(e) for e in events if e.get("cat") == "user_annotation" and e["name"] == STEP_MARK]
    origin = min([s for s, _ in steps] or [s for s, _ in comm + compute] or [0.0])

    def shift(xs):
        return sorted((a - origin, b - origin) for a, b in xs)

    return TraceIntervals(kind=kind, comm=shift(comm), compute=shift(compute), steps=shift(steps))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of (union xs) ∩ (union ys), by a merge of the two sorted unions."""
    xs, ys = union(xs), union(ys)
    i = j = 0
    length = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            length += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return length


def overlap_stats(iv: TraceIntervals) -> dict:
    """Comm, compute, overlapped and exposed time (ms, per profiled step) and the overlap percentage."""
    n_steps = max(1, len(iv.steps))
    comm, compute = total(iv.comm), total(iv.compute)
    both = intersection(iv.comm, iv.compute)
    window = (max(b for _, b in iv.steps) - min(a for a, _ in iv.steps)) if iv.steps else \
        (max(b for _, b in iv.comm + iv.compute) - min(a for a, _ in iv.comm + iv.compute)
         if iv.comm or iv.compute else 0.0)
    per_step = 1e-3 / n_steps  # us over all steps -> ms per step
    return {
        "trace_kind": iv.kind, "profiled_steps": len(iv.steps),
        "step_window_ms": window * per_step,
        "comm_ms": comm * per_step, "compute_ms": compute * per_step,
        "overlapped_ms": both * per_step, "exposed_comm_ms": (comm - both) * per_step,
        "overlap_pct": 100.0 * both / comm if comm > 0 else None,
        "exposed_comm_pct_of_step": 100.0 * (comm - both) / window if window > 0 else None,
    }


def plot_streams(ax, iv: TraceIntervals, *, title: str = "", step: int | None = 0) -> None:
    """Two lanes, computation and communication, over one profiled step (or all with step=None)."""
    lo, hi = (iv.steps[step] if (step is not None and iv.steps) else
              (0.0, max(b for _, b in iv.comm + iv.compute)))

    def clip(xs):
        return [(max(a, lo) / 1e3, (min(b, hi) - max(a, lo)) / 1e3) for a, b in union(xs) if b > lo and a < hi]

    compute_label = "compute kernels" if iv.kind == "gpu" else "compute (aten ops)"
    comm_label = "NCCL kernels" if iv.kind == "gpu" else "gloo all-reduce"
    ax.broken_barh(clip(iv.compute), (10, 8), facecolors="tab:blue", label=compute_label)
    ax.broken_barh(clip(iv.comm), (0, 8), facecolors="tab:orange", label=comm_label)
    ax.set_yticks([4, 14], [comm_label, compute_label])
    ax.set_xlim(lo / 1e3, hi / 1e3)
    ax.set_xlabel("time in step (ms)")
    if title:
        ax.set_title(title)
