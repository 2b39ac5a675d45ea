"""The one reader of torch.profiler's Chrome traces: events, kernels, named ranges, and the
interval arithmetic that tells communication that overlaps computation from communication that
does not.

Range names: the training step (``systems.train``) opens ``STEP_RANGE`` around each step and
``PHASE_RANGES`` around its phases, so every profile of a step can be cut the same way.

GPU traces: kernels (memcpy and memset included) are device work; communication is a kernel
whose name contains "nccl" or symmetric memory's barrier kernel, and every memcpy on a stream
that runs one of those (the copy-engine exchange of ``systems.parallel.peer`` copies gradients
on the stream of its barriers). CPU (gloo) traces have no kernels: communication is the "gloo:*"
ranges the gloo worker threads record, computation the "aten::*" operators of the other threads.

    exposed communication = time some communication runs while no computation does
                          = |comm| - |comm ∩ compute|, on the unions of the intervals.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

STEP_RANGE = "step"
PHASE_RANGES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}
GRAD_SYNC_RANGE = "gradient sync"
# device-side event categories (older profilers wrote "memcpy" / "memset")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver", "runtime", "driver")

Interval = tuple[float, float]


def load_trace(path: str | Path) -> dict:
    """A Chrome trace (.json or .json.gz) as exported by torch.profiler, with a one-line error that
    names the file when it cannot be read."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the profiler trace {path}: {exc}") from exc


def complete_events(trace: dict | list | str | Path) -> list[dict]:
    """The complete ("X") events that carry a duration, from a trace or its file."""
    if isinstance(trace, (str, Path)):
        trace = load_trace(trace)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def category(e: dict) -> str:
    return str(e.get("cat", "")).lower()


def span(e: dict) -> Interval:
    start = float(e["ts"])
    return start, start + float(e["dur"])


def device_events(events: list[dict]) -> list[dict]:
    return [e for e in events if category(e) in DEVICE_CATEGORIES]


def is_comm_kernel(name: str) -> bool:
    n = name.lower()
    return "nccl" in n or "symmetric_memory::" in n  # c10d::symmetric_memory::barrier_kernel and its kin


def stream_of(e: dict):
    return (e.get("args") or {}).get("stream")


def comm_events(kernels: list[dict]) -> list[dict]:
    """The device events that communicate: comm kernels, and memcpys on the streams that run them."""
    streams = {stream_of(e) for e in kernels if is_comm_kernel(e["name"])} - {None}
    return [e for e in kernels if is_comm_kernel(e["name"])
            or (category(e) in ("gpu_memcpy", "memcpy") and stream_of(e) in streams)]


def is_gather(name: str) -> bool:
    n = name.lower()
    return "allgather" in n or "all_gather" in n


def is_reduce_scatter(name: str) -> bool:
    n = name.lower()
    return "reducescatter" in n or "reduce_scatter" in n or n.startswith("gloo:all_reduce")


def gpu_annotation_spans(events: list[dict], name: str) -> list[Interval]:
    """GPU-side spans of the record_function ranges called ``name``, one per range.

    Kineto writes one "gpu_user_annotation" event per (range, CUDA stream) that ran its kernels,
    all carrying the CPU range's "External id". A step whose NCCL kernels were launched from the
    range's thread therefore appears once on the compute stream and once on the NCCL stream;
    counting both would halve every per-step number. Events with the same id are merged into one
    span (first start, last end); events without an id stay separate.
    """
    merged: dict[object, list[float]] = {}
    for i, e in enumerate(events):
        if category(e) != "gpu_user_annotation" or e["name"] != name:
            continue
        ext = (e.get("args") or {}).get("External id")
        key = ("id", ext) if ext is not None else ("event", i)
        a, b = span(e)
        if key in merged:
            merged[key][0] = min(merged[key][0], a)
            merged[key][1] = max(merged[key][1], b)
        else:
            merged[key] = [a, b]
    return sorted((a, b) for a, b in merged.values())


def cpu_range_spans(events: list[dict], name: str) -> list[Interval]:
    """CPU-side spans of the record_function ranges called ``name``."""
    return sorted(span(e) for e in events if category(e) == "user_annotation" and e["name"] == name)


def launched_spans(events: list[dict], name: str) -> list[Interval]:
    """GPU-side spans of the device work *launched* inside each CPU range called ``name``: from
    the first start to the last end of the kernels (memcpy, memset) whose launch call, matched by
    its "correlation" id, ran during that range, on any thread.

    This is where a step ran on the GPU. Kineto's gpu_user_annotation is no substitute for a
    range with nested ranges (a step and its phases): a kernel is tied to the innermost range of
    the thread that launched it, so an outer range gets no GPU span of its own, and the backward's
    kernels (launched by autograd's thread, NCCL's too when hooks start them) belong to no range.
    The CPU range is none either: the host runs ahead of the GPU. Empty when the trace has no
    launch correlations.
    """
    launch_ts = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in events
                 if category(e) in LAUNCH_CATEGORIES}
    launch_ts.pop(None, None)
    ranges = cpu_range_spans(events, name)
    spans: list[list[float]] = [[float("inf"), float("-inf")] for _ in ranges]
    for e in device_events(events):
        ts = launch_ts.get((e.get("args") or {}).get("correlation"))
        if ts is None:
            continue
        for span_, (lo, hi) in zip(spans, ranges):
            if lo <= ts <= hi:
                a, b = span(e)
                span_[0], span_[1] = min(span_[0], a), max(span_[1], b)
                break
    return [(a, b) for a, b in spans if a < b]


# ----------------------------------------------------------------------------- interval arithmetic


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def total(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def intersection(xs: list[Interval], ys: list[Interval]) -> float:
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


# ----------------------------------------------------------------------------- communication and computation


@dataclass
class TraceIntervals:
    """Communication and computation intervals, in microseconds from the first step's start."""

    kind: str  # "gpu" or "cpu"
    comm: list[Interval]
    compute: list[Interval]
    steps: list[Interval] = field(default_factory=list)
    events: list[dict] = field(default_factory=list, repr=False)  # what they were read from
    origin: float = 0.0  # the trace time (us) of 0 here

    def shift(self, intervals: list[Interval]) -> list[Interval]:
        return sorted((a - self.origin, b - self.origin) for a, b in intervals)


def comm_compute_intervals(trace: dict | list | str | Path, *, step_range: str = STEP_RANGE) -> TraceIntervals:
    """Communication and computation in a (rank's) trace, and the spans of its steps."""
    events = complete_events(trace)
    kernels = device_events(events)
    if kernels:
        kind = "gpu"
        communicating = {id(e) for e in comm_events(kernels)}
        comm = [span(e) for e in kernels if id(e) in communicating]
        compute = [span(e) for e in kernels if id(e) not in communicating]
        steps = launched_spans(events, step_range) or gpu_annotation_spans(events, step_range)
    else:
        kind = "cpu"
        gloo = [e for e in events if e["name"].startswith("gloo:")]
        comm_threads = {e.get("tid") for e in gloo}
        comm = [span(e) for e in gloo]
        compute = [span(e) for e in events if category(e) == "cpu_op" and e["name"].startswith("aten::")
                   and e.get("tid") not in comm_threads]
        steps = []
    steps = steps or cpu_range_spans(events, step_range)
    origin = min([s for s, _ in steps] or [s for s, _ in comm + compute] or [0.0])
    iv = TraceIntervals(kind=kind, comm=[], compute=[], events=events, origin=origin)
    iv.comm, iv.compute, iv.steps = iv.shift(comm), iv.shift(compute), iv.shift(steps)
    return iv


def overlap_stats(iv: TraceIntervals) -> dict:
    """Comm, compute, overlapped and exposed time (ms per profiled step) and the overlap share."""
    n_steps = max(1, len(iv.steps))
    comm, compute = total(iv.comm), total(iv.compute)
    both = intersection(iv.comm, iv.compute)
    busy = iv.comm + iv.compute
    if iv.steps:
        window = max(b for _, b in iv.steps) - min(a for a, _ in iv.steps)
    else:
        window = (max(b for _, b in busy) - min(a for a, _ in busy)) if busy else 0.0
    per_step = 1e-3 / n_steps  # us over all steps -> ms per step
    return {
        "trace_kind": iv.kind, "profiled_steps": len(iv.steps),
        "step_window_ms": window * per_step,
        "comm_ms": comm * per_step, "compute_ms": compute * per_step,
        "overlapped_ms": both * per_step, "exposed_comm_ms": (comm - both) * per_step,
        "overlap_pct": 100.0 * both / comm if comm > 0 else None,
        "exposed_comm_pct_of_step": 100.0 * (comm - both) / window if window > 0 else None,
    }


def collective_timeline(trace: dict | list | str | Path, *, step_range: str = STEP_RANGE,
                        unit_prefix: str | None = None) -> dict:
    """Intervals (ms from the step start) of computation, all-gathers and reduce-scatters, and of
    the record_function ranges named ``<unit_prefix>:<i>`` (one per sharded unit's forward): ``step``
    is the first profiled step's range, the lists hold every step in the trace (notebook 08 profiles
    one)."""
    iv = comm_compute_intervals(trace, step_range=step_range)
    events = iv.events
    collectives = ([e for e in device_events(events) if is_comm_kernel(e["name"])] if iv.kind == "gpu"
                   else [e for e in events if e["name"].startswith("gloo:")])
    annotation = "gpu_user_annotation" if iv.kind == "gpu" else "user_annotation"
    units = []
    if unit_prefix:
        for e in events:
            if category(e) == annotation and e["name"].startswith(unit_prefix + ":"):
                a, b = span(e)
                units.append((int(e["name"].split(":")[1]), a, b))
    ms = lambda xs: [((a - iv.origin) / 1e3, (b - iv.origin) / 1e3) for a, b in sorted(xs)]  # noqa: E731
    return {"kind": iv.kind,
            "compute": [(a / 1e3, b / 1e3) for a, b in iv.compute],
            "gather": ms(span(e) for e in collectives if is_gather(e["name"])),
            "reduce": ms(span(e) for e in collectives if is_reduce_scatter(e["name"])),
            "units": [(i, (a - iv.origin) / 1e3, (b - iv.origin) / 1e3) for i, a, b in sorted(units, key=lambda u: u[1])],
            "step": (iv.steps[0][0] / 1e3, iv.steps[0][1] / 1e3) if iv.steps else None}
