"""Device helpers every harness shares: choosing the device, synchronising, and out-of-memory handling."""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Sequence

import torch

# short dtype names, as the notebooks, CLIs and results files write them
DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1, read by Triton
    when it is imported): kernels then take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when present), 'cpu' or 'cuda[:N]', with a clear error for anything else."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but torch.cuda.is_available() is False")
    return torch.device(name)


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on a CPU), so a host timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    # older allocator paths raise a plain RuntimeError whose message says so
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def release_memory(device: torch.device | None = None) -> None:
    """Give cached CUDA blocks back to the driver, so the next measurement (or process) starts clean.

    Call it outside an ``except`` block: until then the traceback's frames hold the tensors.
    On a CPU refcounting frees memory already, and a full ``gc.collect`` over a notebook's data
    frames would only cost time.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class DeviceMarks:
    """Named time points in one stream of work: CUDA events on a GPU, read once the device has
    been synchronised (recording them does not wait); perf_counter on a CPU, where ops run eagerly."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points[name] = ev
        else:
            self.points[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        if self.cuda:
            return self.points[a].elapsed_time(self.points[b])
        return (self.points[b] - self.points[a]) * 1e3


def median_p10_p90(values: Sequence[float]) -> tuple[float, float, float]:
    """The median and the 10th / 90th percentiles (inclusive method; one value is all three)."""
    median = statistics.median(values)
    if len(values) < 2:
        return median, median, median
    q = statistics.quantiles(values, n=10, method="inclusive")
    return median, q[0], q[-1]
