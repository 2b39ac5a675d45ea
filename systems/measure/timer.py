"""The one timer: named time points in a stream of work (``Marks``), the timing of a callable
(``time_fn``), the host's pace at issuing small ops (``launch_pace``), and the statistics every
table reports (median with 10th / 90th percentiles)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from systems.config import check_choice

CLOCKS = ("auto", "device", "host")


def median_p10_p90(values: Sequence[float]) -> tuple[float, float, float]:
    """The median and the 10th / 90th percentiles (inclusive method; one value is all three)."""
    if not values:
        raise ValueError("median_p10_p90 needs at least one value")
    median = statistics.median(values)
    if len(values) < 2:
        return median, median, median
    q = statistics.quantiles(values, n=10, method="inclusive")
    return median, q[0], q[-1]


def slowest_rank_median(per_rank: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """``median_p10_p90`` over steps of the slowest rank's time in each step: a step ends for every
    rank only when the last one is done. ``per_rank[r][i]``: rank r's time of step i; steps past
    the fewest any rank ran are left out."""
    if not per_rank:
        raise ValueError("slowest_rank_median needs the times of at least one rank")
    n = min(len(times) for times in per_rank)
    return median_p10_p90([max(times[i] for times in per_rank) for i in range(n)])


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value; None, None for none)."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


class Marks:
    """Named time points in one stream of work.

    ``clock="device"`` records CUDA events: recording does not wait, and ``ms`` is read once the
    device has been synchronised. ``clock="host"`` reads ``time.perf_counter``: the caller
    synchronises before each mark (what the handout's benchmarking script asks for). ``"auto"``
    is device on a GPU and host on a CPU, where operators run eagerly.

    ``track_memory`` (CUDA): each mark also keeps the bytes allocated at that point and the
    allocator's high-water mark since the previous mark, then resets that high-water mark
    (``torch.cuda.reset_peak_memory_stats``), so consecutive marks give per-phase peaks. The
    allocator counts on the host as work is queued, so neither reading needs a synchronisation.
    """

    def __init__(self, device: torch.device, *, clock: str = "auto", track_memory: bool = False):
        check_choice("clock", clock, CLOCKS)
        cuda = torch.device(device).type == "cuda"
        if clock == "device" and not cuda:
            raise ValueError("clock='device' needs a CUDA device; use 'host' or 'auto' on a CPU")
        self.device = torch.device(device)
        self.events = cuda and clock != "host"
        self.track_memory = track_memory and cuda
        self.points: dict[str, object] = {}
        self.peaks: dict[str, int] = {}
        self.allocated: dict[str, int] = {}

    def mark(self, name: str) -> None:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()
        if self.track_memory:
            self.allocated[name] = torch.cuda.memory_allocated(self.device)
            self.peaks[name] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def __contains__(self, name: str) -> bool:
        return name in self.points

    def ms(self, start: str, end: str) -> float:
        """Milliseconds from mark ``start`` to mark ``end``."""
        return self.ms_since(self, start, end)

    def ms_since(self, earlier: "Marks", start: str, end: str) -> float:
        """Milliseconds from ``earlier``'s mark ``start`` to this one's mark ``end`` (the span of
        several steps, each with its own marks, on one clock; ``ms`` is the case earlier = self)."""
        for marks, name in ((earlier, start), (self, end)):
            if name not in marks.points:
                raise KeyError(f"no mark named {name!r}; marks: {list(marks.points)}")
        if self.events != earlier.events:
            raise ValueError("ms_since needs both marks on the same clock (device events or host time)")
        if self.events:
            return earlier.points[start].elapsed_time(self.points[end])
        return (self.points[end] - earlier.points[start]) * 1e3

    def peak_bytes(self, name: str) -> int | None:
        """The allocator's high-water mark between the previous mark and ``name`` (None without tracking)."""
        return self.peaks.get(name)

    def allocated_bytes(self, name: str) -> int | None:
        """Bytes allocated when ``name`` was marked (None without tracking)."""
        return self.allocated.get(name)


def time_fn(fn: Callable[[], object], *, device: torch.device | str, warmup_ms: float = 25.0,
            rep_ms: float = 100.0, grad_to_none: Sequence[torch.Tensor] | None = None,
            min_reps: int = 3) -> dict[str, float]:
    """Milliseconds per call of ``fn``: ``{"median_ms", "p10_ms", "p90_ms"}``.

    On a GPU ``triton.testing.do_bench`` (CUDA events, the L2 flushed before each call,
    ``grad_to_none``'s gradients reset between calls); ``warmup_ms`` and ``rep_ms`` are its
    budgets, so a call longer than them still runs about eight times. On a CPU, calls after a
    warm-up of at least one call, timed with perf_counter until ``rep_ms`` and ``min_reps`` are
    both met.
    """
    if torch.device(device).type == "cuda":
        import triton.testing

        median, p10, p90 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                                   quantiles=[0.5, 0.1, 0.9])
        return {"median_ms": median, "p10_ms": p10, "p90_ms": p90}

    def reset() -> None:
        for t in grad_to_none or ():
            t.grad = None

    start = time.perf_counter()
    while True:
        reset()
        fn()
        if (time.perf_counter() - start) * 1e3 >= warmup_ms:
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start) * 1e3 < rep_ms:
        reset()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    median, p10, p90 = median_p10_p90(times)
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90}


def launch_pace(device: torch.device | str, *, ops: int = 1000, repeats: int = 7,
                in_child: bool = False) -> dict[str, float]:
    """Microseconds per op when ``ops`` in-place adds on a one-element tensor are issued back to
    back, each batch synchronised: ``{"median_us", "p10_us", "p90_us"}`` over ``repeats`` batches
    after one of warm-up. Whichever is slower sets it, the host issuing the ops (PyTorch's
    dispatch, the launch) or the device running them one after another; on a GPU the host, as a
    rule. A call that issues n launches cannot take less than about n times it, and it differs
    between hosts with the same GPU, so it bounds a sweep's shortest points differently on each.

    ``in_child``: measure in a freshly spawned process, so that the caller makes no CUDA context
    (a process that then starts one rank per GPU must hold none: it would take memory on GPU 0,
    and in exclusive-process compute mode keep rank 0 off it). Costs the child's start, seconds."""
    if ops < 1 or repeats < 1:
        raise ValueError(f"launch_pace needs ops >= 1 and repeats >= 1, got ops={ops}, repeats={repeats}")
    if in_child:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(launch_pace, (str(device),), {"ops": ops, "repeats": repeats})
    dev = torch.device(device)
    x = torch.zeros(1, device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def batch() -> None:
        for _ in range(ops):
            x.add_(1.0)

    batch()
    sync()
    per_op = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch()
        sync()
        per_op.append((time.perf_counter() - start) / ops * 1e6)
    median, p10, p90 = median_p10_p90(per_op)
    return {"median_us": median, "p10_us": p10, "p90_us": p90}
