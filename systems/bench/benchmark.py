"""End-to-end timing harness for the Transformer LM: forward, forward+backward, or a full train step.

Library:  ``run_benchmark(BenchmarkConfig(...)) -> dict`` and ``run_sweep(configs, out_path=...)``.
CLI:      ``python -m systems.bench.benchmark --model-size small --context-length 512 --mode train_step``
          (also the memory-profiling tool's vocabulary: --profile-type, --use-mixed-precision,
          --dtype, --output SNAPSHOT).

Each step is followed by ``torch.cuda.synchronize()`` and timed with ``timeit.default_timer``;
phases (forward, backward, optimizer) are synchronised and timed separately. Warm-up steps run
outside the measured region. An out-of-memory point returns a record with ``status="oom"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import timeit
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterable

import torch
from torch.profiler import record_function

from systems.config import PRESETS, ModelConfig, get_config
from systems.measure.devices import is_oom, release_memory, resolve_device, sync
from systems.measure.hardware import lookup_peak
from systems.model import TransformerLM
from systems.optim import AdamW, cross_entropy
from systems.measure.results import ResultWriter, read_records

MODES = ("forward", "forward_backward", "train_step")
PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PHASES = ("forward", "backward", "optimizer")
# profiler / NVTX range names of a step and its phases
COMPILE_SCOPES = ("model", "blocks")
STEP_RANGE = "step"
PHASE_RANGES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}


@dataclass
class BenchmarkConfig:
    model: str = "small"
    model_overrides: dict = field(default_factory=dict)  # e.g. {"d_model": 512, "n_heads": 8}
    context_length: int = 512
    batch_size: int = 4
    warmup_steps: int = 5
    measure_steps: int = 10
    mode: str = "train_step"
    precision: str = "fp32"  # fp32, or bf16 / fp16 autocast over fp32 master weights
    compile: bool = False
    # "model": torch.compile(model), one graph per mode whose compile time grows with depth;
    # "blocks": every TransformerBlock compiled (one graph serves all of them, as torchtitan
    # does), embedding, final norm and LM head left eager
    compile_scope: str = "model"
    attn_impl: str = "naive"
    device: str = "auto"
    tf32: bool = False  # allow TF32 tensor cores for fp32 matmuls
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {self.compile_scope!r}")
        for name in ("context_length", "batch_size", "measure_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        cfg = self.model_config()  # validates the size name and hyperparameters early
        if self.context_length > cfg.context_length:
            raise ValueError(f"context_length {self.context_length} exceeds the model's maximum "
                             f"{cfg.context_length} (raise it with model_overrides={{'context_length': ...}})")

    def model_config(self) -> ModelConfig:
        from systems.attention import get_backend

        get_backend(self.attn_impl)
        return get_config(self.model, attn_impl=self.attn_impl, **self.model_overrides)

    def resolved_device(self) -> torch.device:
        return resolve_device(self.device)


def compile_blocks(blocks: Iterable[torch.nn.Module], *, mode: str | None = None) -> None:
    """torch.compile each block in place. One compiled graph serves all blocks (same code, same
    shapes; parameters are graph inputs), so compile time does not grow with depth; hooks on the
    parameters (DDP's, the optimizer-in-backward's) stay outside the graphs."""
    for block in blocks:
        block.compile(mode=mode)


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


class StepRunner:
    """Builds the model and optimizer once; ``step()`` runs one timed step of the configured mode."""

    def __init__(self, cfg: BenchmarkConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.model_cfg = cfg.model_config()
        torch.manual_seed(cfg.seed)
        self.model = TransformerLM(self.model_cfg, device=device)
        self.fn = self.model
        if cfg.compile and cfg.compile_scope == "blocks":
            compile_blocks(self.model.layers)
        elif cfg.compile:
            self.fn = torch.compile(self.model)
        self.optimizer = AdamW(self.model.parameters(), lr=1e-4) if cfg.mode == "train_step" else None
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" and cfg.mode != "forward" else None
        shape = (cfg.batch_size, cfg.context_length)
        self.inputs = torch.randint(0, self.model_cfg.vocab_size, shape, device=device)
        self.targets = torch.randint(0, self.model_cfg.vocab_size, shape, device=device)

    def _autocast(self) -> ContextManager:
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.cfg.precision])

    def step(self) -> dict[str, float]:
        """One step; returns seconds per phase and 'step', each ending in a synchronize.

        Each phase is a named range (PHASE_RANGES) that closes after its synchronize, so under a
        profiler a range's CPU span is what the timer reads and every kernel launch of the phase
        falls inside it; without a profiler the ranges cost about a microsecond each.
        """
        dev, times = self.device, {}
        track_mem = dev.type == "cuda"
        t0 = timeit.default_timer()
        with record_function(STEP_RANGE):
            if self.cfg.mode == "forward":
                with record_function(PHASE_RANGES["forward"]):
                    with torch.no_grad(), self._autocast():
                        self.fn(self.inputs)
                    sync(dev)
                times["forward"] = timeit.default_timer() - t0
            else:
                with record_function(PHASE_RANGES["forward"]):
                    if self.optimizer is not None:
                        self.optimizer.zero_grad(set_to_none=True)
                    else:
                        self.model.zero_grad(set_to_none=True)
                    with self._autocast():
                        loss = cross_entropy(self.fn(self.inputs), self.targets)
                    sync(dev)
                t1 = timeit.default_timer()
                times["forward"] = t1 - t0
                if track_mem:
                    times["peak_forward"] = torch.cuda.max_memory_allocated(dev)
                with record_function(PHASE_RANGES["backward"]):
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
                    sync(dev)
                t2 = timeit.default_timer()
                times["backward"] = t2 - t1
                if track_mem:
                    times["peak_backward"] = torch.cuda.max_memory_allocated(dev)
                if self.optimizer is not None:
                    with record_function(PHASE_RANGES["optimizer"]):
                        if self.scaler:
                            self.scaler.step(self.optimizer)
                            self.scaler.update()
                        else:
                            self.optimizer.step()
                        sync(dev)
                    times["optimizer"] = timeit.default_timer() - t2
                    if track_mem:
                        times["peak_optimizer"] = torch.cuda.max_memory_allocated(dev)
        times["step"] = timeit.default_timer() - t0
        return times


def _measure(cfg: BenchmarkConfig, device: torch.device, around_measure, on_step) -> dict:
    t_setup = timeit.default_timer()
    runner = StepRunner(cfg, device)
    sync(device)
    record: dict = {"setup_s": timeit.default_timer() - t_setup, "n_params": runner.model.n_params()}
    warmup = [runner.step()["step"] for _ in range(cfg.warmup_steps)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    with (around_measure() if around_measure else contextlib.nullcontext()):
        for i in range(cfg.measure_steps):
            steps.append(runner.step())
            if on_step:
                on_step(i)
    record["warmup_times_s"] = warmup
    record["step_times_s"] = [s["step"] for s in steps]
    record["first_step_s"] = (warmup or record["step_times_s"])[0]
    record["step_mean_s"], record["step_std_s"] = _mean_std(record["step_times_s"])
    record["step_median_s"] = statistics.median(record["step_times_s"])
    for phase in PHASES:
        times = [s[phase] for s in steps if phase in s]
        record[f"{phase}_mean_s"], record[f"{phase}_std_s"] = _mean_std(times)
        # the median resists a stray slow step (a GC pause, a clock change) that moves the mean
        record[f"{phase}_median_s"] = statistics.median(times) if times else None
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        for phase in PHASES:
            # cumulative within a step: the high-water mark up to the end of each phase
            vals = [s[f"peak_{phase}"] for s in steps if f"peak_{phase}" in s]
            record[f"peak_memory_{phase}_gib"] = max(vals) / 2**30 if vals else None
    return record


def run_benchmark(cfg: BenchmarkConfig, *, around_measure: Callable[[], ContextManager] | None = None,
                  on_step: Callable[[int], None] | None = None) -> dict:
    """Time one configuration; returns a flat record (status 'ok' or 'oom').

    ``around_measure`` wraps the measured steps only (e.g. a profiler or memory-history
    recorder, so warm-up stays out); ``on_step(i)`` is called after each measured step.
    """
    device = cfg.resolved_device()
    model_cfg = cfg.model_config()
    record = {**asdict(cfg), "device": str(device), "status": "ok", "error": None,
              "d_model": model_cfg.d_model, "d_ff": model_cfg.d_ff, "n_layers": model_cfg.n_layers,
              "n_heads": model_cfg.n_heads, "vocab_size": model_cfg.vocab_size}
    record["model_overrides"] = json.dumps(cfg.model_overrides) if cfg.model_overrides else None  # flat column
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    oom_message = None
    try:
        record.update(_measure(cfg, device, around_measure, on_step))
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        oom_message = str(exc).splitlines()[0][:300]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    release_memory(device)  # outside the except block: the traceback's frames are gone
    if oom_message is not None:
        record.update(status="oom", error=oom_message)
        return record
    _add_rates(record, cfg, model_cfg, device)
    return record


def _add_rates(record: dict, cfg: BenchmarkConfig, model_cfg: ModelConfig, device: torch.device) -> None:
    fwd = model_cfg.forward_flops(cfg.batch_size, cfg.context_length)
    # backward costs two forward passes (grad wrt activations and wrt weights)
    record["flops_per_step"] = fwd if cfg.mode == "forward" else 3 * fwd
    t = record["step_mean_s"]
    record["tokens_per_s"] = cfg.batch_size * cfg.context_length / t
    record["achieved_tflops"] = record["flops_per_step"] / t / 1e12
    peak = lookup_peak(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    record["peak_name"] = peak.name if peak else None
    record["peak_tflops"] = peak.tflops(cfg.precision, tf32=cfg.tf32) if peak else None
    record["mfu"] = record["achieved_tflops"] / record["peak_tflops"] if peak else None


def _run_isolated(cfg: BenchmarkConfig, timeout_s: float) -> dict:
    """Run one point in a fresh Python process (cold CUDA context, no allocator history)."""
    cmd = [sys.executable, "-m", "systems.bench.benchmark", "--config-json", json.dumps(asdict(cfg)), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**asdict(cfg), "status": "error", "error": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {**asdict(cfg), "status": "error", "error": f"exit {proc.returncode}: {tail[:300]}"}


def run_sweep(configs: Iterable[BenchmarkConfig], *, out_path: str | Path | None = None, progress: bool = True,
              isolate: bool = False, timeout_s: float = 600, append: bool = False) -> list[dict]:
    """Run configurations in order, writing each record to ``out_path`` (.jsonl) as it completes.

    ``isolate=True`` runs every point in its own process: each then pays CUDA start-up, which is
    what a cold-start (no warm-up) measurement needs. Use it too for sweeps that expect to run
    out of memory inside ``backward()``: on an H100 such an OOM left its graph's buffers
    allocated for the rest of the process (notebook 05), which shrinks every later point.
    """
    from tqdm import tqdm

    configs = list(configs)
    writer = ResultWriter(out_path, overwrite=not append) if out_path else None
    records = []
    bar = tqdm(configs, disable=not progress, desc="benchmark")
    for cfg in bar:
        bar.set_postfix_str(f"{cfg.model} ctx={cfg.context_length} {cfg.mode} {cfg.precision}")
        record = _run_isolated(cfg, timeout_s) if isolate else run_benchmark(cfg)
        records.append(writer.write(record) if writer else record)
    return records


def load_sweep(path: str | Path) -> list[dict]:
    return read_records(path)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m systems.bench.benchmark",
                                description="Time the Transformer LM (forward / forward+backward / train step).")
    p.add_argument("--model-size", "--model", nargs="+", default=["small"],
                   help=f"one or more of {', '.join(PRESETS)}")
    p.add_argument("--context-length", nargs="+", type=int, default=[512])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--measure-steps", type=int, default=10)
    p.add_argument("--mode", choices=MODES, default=None)
    p.add_argument("--profile-type", choices=["forward", "training"], default=None,
                   help="memory-tool alias: forward = --mode forward, training = --mode train_step")
    p.add_argument("--precision", choices=PRECISIONS, default=None)
    p.add_argument("--use-mixed-precision", action="store_true", help="autocast with --dtype")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls")
    p.add_argument("--attn", "--attn-impl", dest="attn_impl", default="naive")
    p.add_argument("--device", default="auto")
    for name in ("d-model", "d-ff", "n-layers", "n-heads", "vocab-size", "max-context"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the size's hyperparameter")
    p.add_argument("--output", help="write a CUDA memory snapshot (.pickle) of the measured steps here")
    p.add_argument("--jsonl", help="append the result records to this .jsonl file")
    p.add_argument("--json", action="store_true", help="print each record as one JSON line")
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    return p


def configs_from_args(args: argparse.Namespace) -> list[BenchmarkConfig]:
    if args.config_json:
        return [BenchmarkConfig(**json.loads(args.config_json))]
    if args.mode and args.profile_type:
        raise ValueError("give either --mode or --profile-type, not both")
    mode = args.mode or {"forward": "forward", "training": "train_step", None: "train_step"}[args.profile_type]
    if args.precision and args.use_mixed_precision:
        raise ValueError("give either --precision or --use-mixed-precision/--dtype, not both")
    precision = args.precision or (args.dtype if args.use_mixed_precision else "fp32")
    names = {"d_model": args.d_model, "d_ff": args.d_ff, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "vocab_size": args.vocab_size, "context_length": args.max_context}
    overrides = {k: v for k, v in names.items() if v is not None}
    return [BenchmarkConfig(model=size, model_overrides=overrides, context_length=ctx, batch_size=args.batch_size,
                            warmup_steps=args.warmup_steps, measure_steps=args.measure_steps, mode=mode,
                            precision=precision, compile=args.compile, attn_impl=args.attn_impl,
                            device=args.device, tf32=args.tf32)
            for size in args.model_size for ctx in args.context_length]


def _summary(r: dict) -> str:
    head = f"{r['model']:>6} ctx={r['context_length']:<5} {r['mode']:<16} {r['precision']:<5}"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r.get('error')}"
    phases = "  ".join(f"{ph} {r[f'{ph}_mean_s'] * 1e3:.2f}±{r[f'{ph}_std_s'] * 1e3:.2f}"
                       for ph in PHASES if r.get(f"{ph}_mean_s") is not None)
    mfu = f"  MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
    mem = f"  peak {r['peak_memory_gib']:.2f} GiB" if r.get("peak_memory_gib") is not None else ""
    return (f"{head} step {r['step_mean_s'] * 1e3:.2f}±{r['step_std_s'] * 1e3:.2f} ms ({phases})  "
            f"{r['tokens_per_s']:,.0f} tok/s{mfu}{mem}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output and len(configs) > 1:
        print("error: --output (memory snapshot) takes a single configuration", file=sys.stderr)
        return 2
    writer = ResultWriter(args.jsonl, overwrite=False) if args.jsonl else None
    status = 0
    around = None
    if args.output:
        from systems.measure.memory import record_snapshot

        around = lambda: record_snapshot(args.output)  # noqa: E731 (a zero-argument context factory)
    for cfg in configs:
        record = run_benchmark(cfg, around_measure=around)
        if writer:
            writer.write(record)
        print(json.dumps(record, default=str) if args.json else _summary(record), flush=True)
        if record["status"] == "oom":
            status = 3  # distinguishable from bad arguments (2)
    return status


if __name__ == "__main__":
    sys.exit(main())
