"""The memory measurements of notebook 04 (memory_profiling; 2026: gradient_checkpointing).

- ``run_peak_sweep``: forward and train step over contexts and precisions through the
  benchmark harness (``run_benchmark``), an allocator snapshot around the measured step, one row
  per point with the high-water mark up to the end of each phase.
- ``measure_block``: what one TransformerBlock saves for its backward (``saved_tensors``) and the
  memory its backward leaves, measured from allocator changes (``backward_memory``).
- ``measure_train_step``: one model's train step (``systems.train.TrainStep``) with per-phase
  peaks (``ProbeMarks``), so the forward + backward's peak (activations) and the optimizer
  step's are read apart; ``run_checkpoint_groups`` and ``run_checkpoint_strategies`` run it over
  checkpoint group sizes and over checkpointing strategies.

Every peak is a ``MemoryProbe`` reading: the CUDA allocator on a GPU, a ``LiveTensorTracker`` (or
the profiler's snapshot) on a CPU, where the smoke profile checks the code path.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from systems.bench.benchmark import PHASES, BenchmarkConfig, run_benchmark
from systems.config import check_choice, get_config, preset_of
from systems.measure.devices import catch_oom, release_memory, resolve_device, sync
from systems.measure.memory import (
    MemoryProbe,
    ProbeMarks,
    build_timeline,
    residual_stream_bytes,
    saved_tensor_report,
    snapshot_recorder,
    step_marker,
)
from systems.measure.results import ResultWriter
from systems.model import TransformerBlock, TransformerLM
from systems.parallel import checkpoint as checkpointing
from systems.train import OptimizerSpec, StepSpec, TrainStep, build_optimizer, phase_ms

GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    """A model size (the handout's name for it), the contexts and the batch a problem asks for."""

    size: str
    contexts: tuple[int, ...]
    batch_size: int = 4


# memory_profiling as each handout words it: "the 2.7B model ... context lengths of 128, 256 and
# 512" (2025); "the xl model ... context lengths of 128 and 2048" (2026); batch 4, the handouts'
# reference batch size
HANDOUT_PROFILES = {"2025": MemoryProfile("2.7B", (128, 256, 512)), "2026": MemoryProfile("xl", (128, 2048))}
# gradient_checkpointing (b), 2026 only: "the xl model config with batch size 4 and sequence length 2048"
CHECKPOINT_RUN = dict(model=preset_of("xl", "2026"), batch_size=4, context_length=2048)


def handout_profile(handout: str) -> MemoryProfile:
    check_choice("handout", handout, HANDOUT_PROFILES)
    return HANDOUT_PROFILES[handout]


# ----------------------------------------------------------------------------- peak sweep


def run_peak_sweep(*, model: str, contexts: tuple[int, ...], batch_size: int = 4, device: str = "auto",
                   precisions: tuple[str, ...] = ("fp32", "bf16"), modes: tuple[str, ...] = ("forward", "train_step"),
                   snapshot_dir: str | Path, snapshot_precisions: tuple[str, ...] = ("fp32",), warmup: int = 1,
                   steps: int = 1, out_path: str | Path | None = None, progress: bool = True) -> list[dict]:
    """Every (precision, mode, context) through ``run_benchmark``, with the allocator history of
    the measured step(s) recorded for ``snapshot_precisions`` (warm-up left out: it creates the
    AdamW state) and a marker after each step.

    Row columns: ``peak_gib`` (the step's high-water mark) and ``peak_<phase>_gib``, the
    high-water mark from the step's start to the end of each phase (so the phase where it stops
    rising set the peak). On CUDA they come from the allocator; on a CPU, which has no allocator
    counters, every point records a snapshot (the profiler's) and both come from its timeline.
    ``start_gib``: allocated when recording began (parameters; for the train step also AdamW's
    state). An out-of-memory point is a row with status "oom".
    """
    from tqdm.auto import tqdm

    dev = resolve_device(device)
    snapshot_dir = Path(snapshot_dir)
    writer = ResultWriter(out_path) if out_path else None
    rows = []
    points = [(p, m, c) for p in precisions for m in modes for c in contexts]
    for precision, mode, context in tqdm(points, desc="peak memory", disable=not progress):
        cfg = BenchmarkConfig(model=model, context_length=context, batch_size=batch_size, warmup=warmup,
                              steps=steps, mode=mode, precision=precision, device=str(dev))
        path = snapshot_dir / f"{model}_{mode}_{precision}_ctx{context}.pickle"
        path.unlink(missing_ok=True)
        record = precision in snapshot_precisions or dev.type == "cpu"
        rec = run_benchmark(cfg, around_measure=snapshot_recorder(path, dev) if record else None,
                            on_step=step_marker(dev))
        row = {"model": model, "context_length": context, "batch_size": batch_size, "mode": mode,
               "precision": precision, "status": rec["status"], "error": rec.get("error"),
               "step_ms": rec["step_median_s"] * 1e3 if rec["status"] == "ok" else None, "snapshot": None}
        if rec["status"] == "ok" and path.exists():
            row["snapshot"] = str(path)
            row.update(_timeline_columns(path))
        else:
            path.unlink(missing_ok=True)  # an out-of-memory point's partial history is not used
        if dev.type == "cuda" and rec["status"] == "ok":
            row["peak_gib"] = rec["peak_memory_gib"]
            row["peak_source"] = "allocator"
            for phase in PHASES:
                row[f"peak_{phase}_gib"] = rec.get(f"peak_memory_{phase}_gib")
        elif rec["status"] == "ok":
            row["peak_gib"] = row.get("timeline_peak_gib")
            row["peak_source"] = "profiler snapshot"
            for phase in PHASES:
                row[f"peak_{phase}_gib"] = row.get(f"timeline_{phase}_gib")
        rows.append(writer.write(row) if writer else row)
        del rec
        release_memory(dev)
    return rows


def _timeline_columns(path: Path) -> dict:
    """Peak, starting bytes and cumulative per-phase peaks of a snapshot's timeline, in GiB."""
    tl = build_timeline(path)
    out = {"timeline_peak_gib": tl.peak_bytes / GIB, "start_gib": tl.baseline_bytes / GIB}
    running, peaks = 0, tl.phase_peaks()
    for phase in PHASES:
        if phase in peaks:
            running = max(running, peaks[phase])
            out[f"timeline_{phase}_gib"] = running / GIB
    return out


# ----------------------------------------------------------------------------- one block


def measure_block(*, model: str, batch_size: int, context_length: int, device: str = "auto",
                  model_overrides: dict | None = None, top: int = 5, seed: int = 0,
                  out_path: str | Path | None = None) -> dict:
    """One TransformerBlock of ``model`` on a (batch, context, d_model) input: the bytes its forward
    saves for backward (input included, parameters not), its top ``top`` saving ops, and the
    allocator changes around a forward and backward whose leftover is the gradients."""
    dev = resolve_device(device)
    cfg = get_config(model, **(model_overrides or {}))
    torch.manual_seed(seed)
    block = TransformerBlock(cfg, device=dev)
    x = torch.randn(batch_size, context_length, cfg.d_model, device=dev)
    rep = saved_tensor_report(block, x, torch.arange(context_length, device=dev), top=top)
    back = rep.backward
    row = {"model": model, "batch_size": batch_size, "context_length": context_length, "device": str(dev),
           "d_model": cfg.d_model, "d_ff": cfg.d_ff, "n_heads": cfg.n_heads, "n_layers": cfg.n_layers,
           "saved_bytes": rep.total_bytes, "n_saved": rep.n_saved, "n_storages": rep.n_storages,
           "param_bytes_excluded": rep.param_bytes_excluded,
           "residual_bytes": residual_stream_bytes(batch_size=batch_size, context_length=context_length,
                                                   d_model=cfg.d_model),
           "attention_matrix_bytes": batch_size * cfg.n_heads * context_length**2 * 4,
           "forward_bytes": back.forward_bytes, "output_bytes": back.output_bytes,
           "backward_change_bytes": back.backward_change_bytes, "grad_bytes": back.grad_bytes,
           "expected_grad_bytes": back.expected_grad_bytes,
           "top_ops": rep.by_op.to_dict(orient="records")}
    del block, x, rep
    release_memory(dev)
    return ResultWriter(out_path).write(row) if out_path else row


# ----------------------------------------------------------------------------- train steps


def measure_train_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, optimizer=None,
                       warmup: int = 1, steps: int = 1, precision: str = "fp32", grads_to_none: bool = True) -> dict:
    """Per-phase peaks and time of forward + backward (+ the optimizer step, given one).

    ``start_bytes`` is allocated at the step's start; ``peak_<phase>_bytes`` the high-water mark
    inside each phase (not cumulative); ``activation_peak_bytes`` the forward's and backward's
    larger one, the part checkpointing changes; ``rise_bytes`` that peak above the start. On
    CUDA the bytes are the allocator's (absolute); on a CPU a tracker's, counting only what the
    measured steps create, so read ``rise_bytes`` there. Each phase ends in a synchronisation.
    ``grads_to_none=False`` keeps the gradients allocated between steps (zeroed in place), so they
    are part of the start and not of the rise.
    """
    if warmup < 1 and not grads_to_none:
        raise ValueError("grads_to_none=False needs warmup >= 1: the warm-up allocates the gradients")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = inputs.device
    spec = StepSpec(mode="train_step" if optimizer is not None else "forward_backward", precision=precision,
                    sync_phases=True, grads_to_none=grads_to_none)
    step = TrainStep(model, spec=spec, optimizer=optimizer)
    for _ in range(warmup):
        step(inputs, targets)
    sync(dev)
    names = ("forward", "backward", "optimizer") if optimizer is not None else ("forward", "backward")
    peaks = {name: 0 for name in names}
    times, start = [], None
    with MemoryProbe(dev) as probe:
        for _ in range(steps):
            marks = ProbeMarks(probe, clock="host")
            step(inputs, targets, marks=marks)
            start = marks.allocated_bytes("start") if start is None else start
            for name in names:
                peaks[name] = max(peaks[name], marks.peak_bytes(name))
            times.append(phase_ms(marks)["step"])
    activation = max(peaks["forward"], peaks["backward"])
    out = {"start_bytes": int(start), "activation_peak_bytes": int(activation), "rise_bytes": int(activation - start),
           "peak_bytes": int(max(peaks.values())), "step_ms": statistics.median(times)}
    out.update({f"peak_{name}_bytes": int(v) for name, v in peaks.items()})
    return out


def group_sizes_for(n_layers: int) -> list[int]:
    """Group sizes 1, 2, 4, ... up to the number of blocks, and the number of blocks itself."""
    sizes = [2**i for i in range(int(math.log2(n_layers)) + 1)]
    return sizes if sizes[-1] == n_layers else [*sizes, n_layers]


def run_checkpoint_groups(*, model: str, batch_size: int, context_length: int, device: str = "auto",
                          model_overrides: dict | None = None, group_sizes: list[int] | None = None,
                          warmup: int = 1, steps: int = 1, tf32: bool = True, out_path: str | Path | None = None,
                          progress: bool = True) -> list[dict]:
    """One level of checkpointing over groups of k consecutive blocks, for each k, on one model with
    its AdamW (``build_optimizer``): a row per k with the forward + backward peak and the
    optimizer step's peak apart. TF32 (``tf32``) changes time, not memory. An out-of-memory k is a
    row with status "oom"; if the model and its optimizer state alone do not fit, one such row."""
    from tqdm.auto import tqdm

    dev = resolve_device(device)
    cfg = get_config(model, **(model_overrides or {}))
    sizes = group_sizes or group_sizes_for(cfg.n_layers)
    writer = ResultWriter(out_path) if out_path else None
    common = {"model": model, "batch_size": batch_size, "context_length": context_length, "n_layers": cfg.n_layers}
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(writer.write(row) if writer else row)

    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    lm = optimizer = None
    try:
        with catch_oom() as setup_oom:
            torch.manual_seed(0)
            lm = TransformerLM(cfg, device=dev)
            optimizer = build_optimizer(lm, OptimizerSpec())
            inputs = torch.randint(0, cfg.vocab_size, (batch_size, context_length), device=dev)
            targets = torch.randint(0, cfg.vocab_size, (batch_size, context_length), device=dev)
        if setup_oom:
            emit({**common, "group_size": None, "status": "oom", "error": setup_oom.message})
            return rows
        for k in tqdm(sizes, desc="checkpoint group size", disable=not progress):
            checkpointing.apply_activation_checkpointing(lm, k)
            row = {**common, "group_size": k, "n_groups": math.ceil(cfg.n_layers / k), "status": "ok", "error": None}
            with catch_oom() as oom:
                row.update(measure_train_step(lm, inputs, targets, optimizer=optimizer, warmup=warmup, steps=steps))
            release_memory(dev)  # after the with block: the exception's frames are gone
            if oom:
                row.update(status="oom", error=oom.message)
            emit(row)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        del lm, optimizer
        release_memory(dev)
    return rows


def checkpoint_strategies(n_layers: int) -> dict[str, tuple[str, Callable[[nn.Module], object]]]:
    """The strategies gradient_checkpointing (a) compares: key -> (label, how to apply it)."""
    k = checkpointing.sqrt_group_size(n_layers)
    return {"none": ("no checkpointing", checkpointing.remove_activation_checkpointing),
            "one_level": (f"one level, groups of k = {k} ≈ √N",
                          lambda m: checkpointing.apply_activation_checkpointing(m, k)),
            "nested": ("binary nesting", lambda m: checkpointing.apply_nested_checkpointing(m, branching=2)),
            "chain": ("chain: only the input kept", checkpointing.apply_chain_checkpointing)}


def run_checkpoint_strategies(*, model: str = "debug", layers: tuple[int, ...], batch_size: int, context_length: int,
                              device: str = "auto", out_path: str | Path | None = None) -> list[dict]:
    """Forward + backward of ``model`` with each number of blocks in ``layers`` under each of
    ``checkpoint_strategies``: the activation peak above the step's start (gradients kept
    allocated between steps, so they are not part of it) and the block forwards a step takes,
    recomputation included."""
    dev = resolve_device(device)
    writer = ResultWriter(out_path) if out_path else None
    rows = []
    for n_layers in layers:
        cfg = get_config(model, n_layers=n_layers)
        torch.manual_seed(0)
        lm = TransformerLM(cfg, device=dev)
        inputs = torch.randint(0, cfg.vocab_size, (batch_size, context_length), device=dev)
        targets = torch.randint(0, cfg.vocab_size, (batch_size, context_length), device=dev)
        for name, (label, apply) in checkpoint_strategies(n_layers).items():
            checkpointing.remove_activation_checkpointing(lm)
            apply(lm)
            with checkpointing.count_block_forwards(lm) as calls:
                m = measure_train_step(lm, inputs, targets, warmup=1, steps=1, grads_to_none=False)
            forwards = sum(calls.values()) // 2  # the warm-up step ran the same blocks as the measured one
            row = {"strategy": name, "label": label, "model": model, "n_layers": n_layers, "batch_size": batch_size,
                   "context_length": context_length, "block_forwards": forwards, "forwards_per_block": forwards / n_layers,
                   "rise_bytes": m["rise_bytes"], "step_ms": m["step_ms"]}
            rows.append(writer.write(row) if writer else row)
        del lm
        release_memory(dev)
    return rows
