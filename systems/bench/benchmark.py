"""End-to-end timing harness for the Transformer LM: forward, forward+backward, or a full train step.

Library:  ``run_benchmark(BenchmarkConfig(...)) -> dict`` and ``run_sweep(configs, out_path=...)``.
CLI:      ``python -m systems.bench.benchmark --model-size small --context-length 512 --mode train_step``
          (also the memory-profiling tool's vocabulary: --profile-type, --use-mixed-precision,
          --dtype, --output SNAPSHOT).

The step is ``systems.train.TrainStep`` with every phase ending in ``torch.cuda.synchronize()``
and timed on the host clock (``Marks(clock="host")``, perf_counter), as the handout asks;
phases (forward, backward, optimizer) are timed separately. Warm-up steps run outside the
measured region. An out-of-memory point returns a record with ``status="oom"``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import timeit
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Sequence

import torch

from systems.analysis.sharding import per_rank_bytes
from systems.bench.budget import Budget
from systems.bench.config import DEFAULT_OUT_ROOT, RunConfig, out_file_argument
from systems.config import PRESETS, check_choice
from systems.measure.devices import catch_oom, release_memory, sync
from systems.measure.flops import model_flops
from systems.measure.hardware import lookup_peak
from systems.measure.results import ResultWriter
from systems.measure.timer import Marks, mean_std
from systems.model import TransformerLM
from systems.parallel.compile import COMPILE_SCOPES
from systems.parallel.plan import ParallelPlan, apply
from systems.train import MODES, PRECISIONS, OptimizerSpec, StepSpec, TrainStep, build_optimizer, phase_ms

PHASES = ("forward", "backward", "optimizer")
DEFAULT_JSONL = f"{DEFAULT_OUT_ROOT}/benchmark/benchmark.jsonl"  # the CLI's records, unless --jsonl names a file


@dataclass
class BenchmarkConfig(RunConfig):
    mode: str = "train_step"  # forward | forward_backward | train_step
    precision: str = "fp32"  # fp32, or bf16 / fp16 autocast over fp32 master weights
    # "model": torch.compile(model), one graph per mode whose compile time grows with depth;
    # "blocks": every TransformerBlock compiled (one graph serves all of them, as torchtitan
    # does), embedding, final norm and LM head left eager
    compile: str = "none"
    tf32: bool = False  # allow TF32 tensor cores for fp32 matmuls

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("compile", self.compile, COMPILE_SCOPES)
        super().__post_init__()

    def step_spec(self) -> StepSpec:
        # every phase ends in a synchronize, so the host timer reads finished work (the handout's method)
        return StepSpec(mode=self.mode, precision=self.precision, sync_phases=True)


class StepRunner:
    """Builds the model and optimizer once; ``step()`` runs one timed step of the configured mode."""

    def __init__(self, cfg: BenchmarkConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.model_cfg = cfg.model_config()
        torch.manual_seed(cfg.seed)
        self.model = TransformerLM(self.model_cfg, device=device)
        optimizer = build_optimizer(self.model, OptimizerSpec(lr=1e-4)) if cfg.mode == "train_step" else None
        model = apply(self.model, ParallelPlan(compile=cfg.compile))
        self.train_step = TrainStep(self.model, spec=cfg.step_spec(), optimizer=optimizer, forward=model.forward)
        shape = (cfg.batch_size, cfg.context_length)
        self.inputs = torch.randint(0, self.model_cfg.vocab_size, shape, device=device)
        self.targets = torch.randint(0, self.model_cfg.vocab_size, shape, device=device)

    def step(self) -> dict[str, float]:
        """One step; returns seconds per phase and 'step', and (CUDA) the allocator's high-water
        mark at the end of each phase ('peak_<phase>', cumulative within the step)."""
        marks = Marks(self.device, clock="host", track_memory=True)
        self.train_step(self.inputs, self.targets, marks=marks)
        times = {name: ms / 1e3 for name, ms in phase_ms(marks).items()}
        if marks.track_memory:
            running = 0
            for phase in PHASES:
                if phase in marks:
                    running = max(running, marks.peak_bytes(phase))
                    times[f"peak_{phase}"] = running
        return times


def _measure(cfg: BenchmarkConfig, device: torch.device, around_measure, on_step) -> dict:
    t_setup = timeit.default_timer()
    runner = StepRunner(cfg, device)
    sync(device)
    record: dict = {"setup_s": timeit.default_timer() - t_setup, "n_params": runner.model.n_params()}
    warmup = [runner.step()["step"] for _ in range(cfg.warmup)]
    steps = []
    with (around_measure() if around_measure else contextlib.nullcontext()):
        for i in range(cfg.steps):
            steps.append(runner.step())
            if on_step:
                on_step(i)
    record["warmup_times_s"] = warmup
    record["step_times_s"] = [s["step"] for s in steps]
    record["first_step_s"] = (warmup or record["step_times_s"])[0]
    record["step_mean_s"], record["step_std_s"] = mean_std(record["step_times_s"])
    record["step_median_s"] = statistics.median(record["step_times_s"])
    for phase in PHASES:
        times = [s[phase] for s in steps if phase in s]
        record[f"{phase}_mean_s"], record[f"{phase}_std_s"] = mean_std(times)
        # the median resists a stray slow step (a GC pause, a clock change) that moves the mean
        record[f"{phase}_median_s"] = statistics.median(times) if times else None
    if device.type == "cuda":
        for phase in PHASES:
            # cumulative within a step: the high-water mark up to the end of each phase
            vals = [s[f"peak_{phase}"] for s in steps if f"peak_{phase}" in s]
            record[f"peak_memory_{phase}_gib"] = max(vals) / 2**30 if vals else None
        record["peak_memory_gib"] = max(v for v in (record[f"peak_memory_{p}_gib"] for p in PHASES) if v is not None)
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
              "n_heads": model_cfg.n_heads, "vocab_size": model_cfg.vocab_size, "n_params": model_cfg.n_params}
    record["model_overrides"] = json.dumps(cfg.model_overrides) if cfg.model_overrides else None  # flat column
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    try:
        with catch_oom() as oom:
            record.update(_measure(cfg, device, around_measure, on_step))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    release_memory(device)  # after the with block: the exception's frames are gone
    if oom:
        record.update(status="oom", error=oom.message)
        return record
    _add_rates(record, cfg, model_cfg, device)
    return record


def _add_rates(record: dict, cfg: BenchmarkConfig, model_cfg, device: torch.device) -> None:
    pass_ = "fwd" if cfg.mode == "forward" else "fwd_bwd"
    record["flops_per_step"] = model_flops(model_cfg, batch=cfg.batch_size, seq=cfg.context_length, pass_=pass_)
    t = record["step_median_s"]  # rates from the median step, as the report's tables and ratios are
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
              isolate: bool = False, timeout_s: float = 600, append: bool = False,
              budget: Budget | None = None) -> list[dict]:
    """Run configurations in order, writing each record to ``out_path`` (.jsonl) as it completes.

    ``isolate=True`` runs every point in its own process: each then pays CUDA start-up, which is
    what a cold-start (no warm-up) measurement needs. Use it too for sweeps that expect to run
    out of memory inside ``backward()``: on an H100 such an OOM left its graph's buffers
    allocated for the rest of the process (notebook 05), which shrinks every later point.
    ``budget``: points that would start after it is spent become rows with status "skipped (budget)".
    """
    from tqdm import tqdm

    configs = list(configs)
    writer = ResultWriter(out_path, overwrite=not append) if out_path else None
    records = []
    bar = tqdm(configs, disable=not progress, desc="benchmark")
    for cfg in bar:
        bar.set_postfix_str(f"{cfg.model} ctx={cfg.context_length} {cfg.mode} {cfg.precision}")
        if budget is not None and not budget.allows():
            record = {**asdict(cfg), **budget.skipped_row()}
        else:
            record = _run_isolated(cfg, timeout_s) if isolate else run_benchmark(cfg)
        records.append(writer.write(record) if writer else record)
    return records


def warmup_sweep(records: Iterable[dict], *, warmups: Sequence[int] = (0, 1, 2), out_path: str | Path | None = None,
                 budget: Budget | None = None, progress: bool = True) -> list[dict]:
    """The warm-up question: each train-step configuration of ``records`` again with each number of
    warm-up steps, every point in a fresh process (a real cold start: CUDA context, cuBLAS handles,
    allocator). A configuration whose train step did not run in ``records`` (out of memory, say)
    gets rows that say so instead of being tried again."""
    todo, rows = [], []
    for r in records:
        if r["mode"] != "train_step":
            continue
        cfg = config_of(r)
        for w in warmups:
            point = dataclasses.replace(cfg, warmup=w)
            if r["status"] == "ok":
                todo.append(point)
            else:
                rows.append({**asdict(point), "status": f"skipped (train step {r['status']} in the timing sweep)",
                             "error": r.get("error")})
    measured = run_sweep(todo, out_path=out_path, isolate=True, budget=budget, progress=progress)
    if out_path and rows:
        ResultWriter(out_path, overwrite=False).write_many(rows)
    return measured + rows


def config_of(record: dict) -> BenchmarkConfig:
    """The configuration a record was measured with (records keep model_overrides as a JSON string)."""
    fields = {f.name for f in dataclasses.fields(BenchmarkConfig)}
    values = {k: v for k, v in record.items() if k in fields}
    overrides = values.get("model_overrides")
    values["model_overrides"] = json.loads(overrides) if isinstance(overrides, str) else dict(overrides or {})
    return BenchmarkConfig(**values)


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
    p.add_argument("--compile", nargs="?", const="model", default="none", choices=COMPILE_SCOPES,
                   help="torch.compile the whole model (--compile, or --compile model) or each block (--compile blocks)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls")
    p.add_argument("--attn", "--attn-impl", dest="attn_impl", default=None,
                   help="attention backend (default: the model's, naive)")
    p.add_argument("--device", default="auto")
    for name in ("d-model", "d-ff", "n-layers", "n-heads", "vocab-size", "max-context"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the size's hyperparameter")
    p.add_argument("--output", help="write a CUDA memory snapshot (.pickle) of the measured steps here")
    p.add_argument("--jsonl", type=out_file_argument, default=None,
                   help=f"append the result records to this .jsonl file (default {DEFAULT_JSONL})")
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
                            warmup=args.warmup_steps, steps=args.measure_steps, mode=mode,
                            precision=precision, compile=args.compile, attn_impl=args.attn_impl,
                            device=args.device, tf32=args.tf32)
            for size in args.model_size for ctx in args.context_length]


def _summary(r: dict) -> str:
    head = f"{r['model']:>6} ctx={r['context_length']:<5} {r['mode']:<16} {r['precision']:<5}"
    if r["status"] == "oom" and r["mode"] == "train_step":
        return (f"{head} OOM: {r.get('error')}\n  (its fp32 weights, gradients and AdamW state alone need about "
                f"{per_rank_bytes(r['n_params'], 1, 'ddp').step_peak / 1e9:,.0f} GB; python -m systems.bench.sizing "
                f"--model {r['model']} sizes a run that shards them)")
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r.get('error')}"
    phases = "  ".join(f"{ph} {r[f'{ph}_mean_s'] * 1e3:.2f}±{r[f'{ph}_std_s'] * 1e3:.2f}"
                       for ph in PHASES if r.get(f"{ph}_mean_s") is not None)
    mfu = f"  MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
    mem = f"  peak {r['peak_memory_gib']:.2f} GiB" if r.get("peak_memory_gib") is not None else ""
    return (f"{head} step median {r['step_median_s'] * 1e3:.2f} ms, mean {r['step_mean_s'] * 1e3:.2f}"
            f"±{r['step_std_s'] * 1e3:.2f} ({phases})  {r['tokens_per_s']:,.0f} tok/s{mfu}{mem}")


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
    if args.output and configs[0].resolved_device().type != "cuda":
        print("error: --output records a CUDA memory snapshot, and this run's device is a CPU: run it on a GPU "
              "(notebook 04's smoke profile shows what a CPU can record)", file=sys.stderr)
        return 2
    # a point run in a child process (--config-json) hands its record back on stdout and writes nothing
    jsonl = args.jsonl or (None if args.config_json else DEFAULT_JSONL)
    writer = ResultWriter(jsonl, overwrite=False) if jsonl else None
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
    if writer and not args.json:  # --json keeps stdout to the records alone
        print(f"rows appended to {jsonl}")
    return status


if __name__ == "__main__":
    sys.exit(main())
