"""Peak memory and time of the training step on a given model (possibly checkpointed).

``measure_train_step(model, inputs, targets, ...)`` runs ``systems.train.TrainStep`` and reads
the allocator on CUDA, or ``LiveTensorTracker`` on a CPU. The checkpointing sweeps of notebook 04
call it once per strategy on the same model.
"""

from __future__ import annotations

import statistics
import timeit

import torch
import torch.nn as nn

from systems.measure.devices import sync
from systems.measure.memory import LiveTensorTracker
from systems.train import StepSpec, TrainStep


def measure_train_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, optimizer=None,
                       warmup: int = 1, steps: int = 1, precision: str = "fp32") -> dict:
    """Peak memory and time of forward + backward (+ optimizer step, given one) on ``model``.

    CUDA: ``max_memory_allocated`` over the measured steps, and the rise above what was
    allocated before them. CPU: ``LiveTensorTracker``, i.e. only the rise (tensors created by
    the measured steps); ``peak_bytes`` is then that rise too.
    """
    dev = inputs.device
    spec = StepSpec(mode="train_step" if optimizer is not None else "forward_backward", precision=precision)
    step = TrainStep(model, spec=spec, optimizer=optimizer)

    def timed() -> float:
        t0 = timeit.default_timer()
        step(inputs, targets)
        sync(dev)
        return timeit.default_timer() - t0

    for _ in range(warmup):
        step(inputs, targets)
    times = []
    if dev.type == "cuda":
        sync(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        times = [timed() for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        with LiveTensorTracker() as tracker:
            times = [timed() for _ in range(steps)]
        before, peak = 0, tracker.peak_bytes
    return {"peak_bytes": int(peak), "peak_gib": peak / 2**30, "rise_bytes": int(peak - before),
            "rise_mib": (peak - before) / 2**20, "step_s": statistics.median(times), "step_times_s": times}
