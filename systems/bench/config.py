"""The fields every model harness shares, validated once: ``RunConfig``.

Each command-line tool's config derives from it (``BenchmarkConfig``, ``StepConfig``,
``DDPBenchConfig``, ``FSDPBenchConfig``, ``LeaderboardConfig``) and adds its own fields. Its
``__post_init__`` checks those first, then calls ``super().__post_init__()``, which checks the
shared fields and builds the model config (so a bad option is reported before a size problem).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from systems.config import ModelConfig, get_config
from systems.measure.devices import resolve_device
from systems.measure.results import check_writable

# where the commands write when the user names no path: never into the committed results/
DEFAULT_OUT_ROOT = "build"


@dataclass
class RunConfig:
    model: str = "small"
    model_overrides: dict = field(default_factory=dict)  # e.g. {"d_model": 512, "n_heads": 8}
    context_length: int = 512
    batch_size: int = 4  # sequences per step (the global batch, split over the ranks, where there are ranks)
    warmup: int = 5  # steps run before the timed ones
    steps: int = 10  # timed steps
    attn_impl: str | None = None  # a systems.attention backend; None: the model config's default
    device: str = "auto"  # auto | cpu | cuda[:N] (distributed harnesses bind one GPU per rank)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("context_length", "batch_size", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        resolve_device(self.device)  # an unknown name, or CUDA asked for on a machine without it
        cfg = self.model_config()  # an unknown size or bad hyperparameters fail here, before any work
        if self.context_length > cfg.context_length:
            raise ValueError(f"context_length {self.context_length} exceeds the model's maximum {cfg.context_length} "
                             f"({self.model}; raise it with --max-context on the command line, or "
                             "model_overrides={'context_length': ...} in Python)")

    def model_config(self) -> ModelConfig:
        overrides = dict(self.model_overrides)
        if self.attn_impl is not None:
            from systems.attention import get_backend

            get_backend(self.attn_impl)  # a readable error for an unknown backend
            overrides["attn_impl"] = self.attn_impl
        return get_config(self.model, **overrides)

    def resolved_device(self) -> torch.device:
        return resolve_device(self.device)

    def check_world_size(self, world_size: int) -> None:
        """The batch must split evenly over the ranks."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if self.batch_size % world_size:
            raise ValueError(f"batch_size {self.batch_size} (the global batch) does not split evenly over "
                             f"{world_size} ranks")


def run_cli(main: Callable[[], int]) -> int:
    """A distributed command's entry point: a failed rank ends it with its error (the rank's own
    traceback included) and exit status 1, not with the launcher's traceback around it."""
    import sys

    from systems.parallel.launch import DistributedRunError

    try:
        return main()
    except DistributedRunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def check_launch(*, world_size: int, backend: str, timeout_s: float | None = None) -> int:
    """A distributed command's launch options, checked before any process starts, so a bad one is
    a one-line error rather than the launcher's traceback. Returns the world size the run will
    have: under torchrun the launcher's (``WORLD_SIZE``; ``--world-size`` is ignored there), else
    ``world_size``."""
    from systems.parallel.launch import resolve_backend, under_torchrun, validate_world_size

    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"--timeout-s must be positive, got {timeout_s}")
    chosen = resolve_backend(backend)
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    validate_world_size(world_size, chosen)
    return world_size


def out_file_argument(text: str) -> str:
    """An argparse ``type`` for a results file: a path rows cannot be written to is a one-line
    usage error before anything runs (``measure.results.check_writable``)."""
    try:
        check_writable(Path(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def out_dir_argument(text: str) -> str:
    """An argparse ``type`` for a folder the results files go into: made now, or a one-line usage
    error where it cannot be (the check of a file inside it)."""
    out_file_argument(str(Path(text) / "results.jsonl"))
    return text


def model_argument(name: str) -> str:
    """An argparse ``type`` for a model preset: an unknown or ambiguous name is a one-line usage
    error, before anything is built or run."""
    try:
        get_config(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def shape_argument(names: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for a shape written as comma-separated positive integers, one per name
    of ``names`` ("B,H,SEQ,D"): "1,16,4096,64" -> (1, 16, 4096, 64); anything else is a usage error
    that names the expected form."""
    count = len(names.split(","))

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        if len(parts) != count or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"a shape is {count} positive integers {names}, got {text!r}")
        return tuple(int(p) for p in parts)

    return parse


def add_distributed_arguments(parser, defaults: RunConfig, *, precisions, tool: str) -> None:
    """The command-line options the multi-GPU benchmarks share (launch, model, steps, output).

    ``defaults`` is the benchmark's config instance, so each CLI default is the config's own;
    ``tool`` names the default output folder, build/<tool> (never the committed results/).
    """
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--backend", default="auto", help="nccl, gloo or auto (nccl when CUDA is present)")
    parser.add_argument("--model", type=model_argument, default=defaults.model)
    parser.add_argument("--context-length", type=int, default=defaults.context_length)
    parser.add_argument("--global-batch", dest="batch_size", type=int, default=defaults.batch_size,
                        help="sequences per step over all ranks")
    parser.add_argument("--precisions", nargs="*", default=list(defaults.precisions), choices=precisions)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--attn-impl", default=None)
    parser.add_argument("--out-dir", type=out_dir_argument, default=f"{DEFAULT_OUT_ROOT}/{tool}",
                        help=f"where the jsonl files and traces go (default {DEFAULT_OUT_ROOT}/{tool})")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")
