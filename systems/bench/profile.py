"""Where the time goes: the harness's modes under torch.profiler (or Nsight Systems), as tidy tables.

    profile_config(cfg, ...) -> ProfileResult   one configuration, warm-up left out
    result.kernels(ranges=["forward"])            a cuda_gpu_kern_sum-like table for some ranges
    result.categories(...), result.range_totals()
    handout_plan(handout, full=...) -> ProfilePlan   what the handout's nsys_profile question profiles
    profile_sweep(plan, ...)                      every point of a plan, one summary row each
    run_nsys(cfg, out_dir)                        the same kernel table from ``nsys stats`` when nsys exists
CLI (the process nsys launches): ``python -m systems.bench.profile nsys-target --config-json '{...}'``.

A profiled step is the harness's step (``systems.bench.benchmark.StepRunner``, i.e.
``systems.train.TrainStep`` with synchronised phases), whose ranges (``step`` > ``forward`` /
``backward`` / ``optimizer step``) the tables cut by; inside attention the model already names
``attention scores`` / ``softmax`` / ``final matmul``. The profiler runs with a schedule (one
profiler warm-up step, then the recorded steps) after the harness's warm-up steps, exports a
Chrome trace, and everything is computed from that file (``systems.measure.profiler``).

The profiler's own cost is measured on the same model and loop: ``cfg.steps`` steps timed
without the profiler, then the profiled ones, same timer. Those unprofiled steps are the
harness's measurement (its loop, its synchronise-then-perf_counter timer) of the same model, so
they are also the number a profile's forward time is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from systems.bench.benchmark import BenchmarkConfig, StepRunner
from systems.bench.budget import Budget
from systems.config import get_config, handout_sizes
from systems.measure import flops
from systems.measure.devices import catch_oom, release_memory
from systems.measure.profiler import (ATTENTION_RANGES, NSYS_CAPTURE_RANGE, PHASE_RANGES, attribute, category_table,
                                      containing_instance, export_trace, kernel_table, nsys_available,
                                      parse_nsys_kern_sum, parse_trace, profiler_activities, range_table)
from systems.measure.timer import mean_std
from systems.measure.trace import STEP_RANGE


@dataclass
class ProfileResult:
    """One profiled configuration: attributed items, the ranges, timings, and the trace file."""

    config: BenchmarkConfig
    device: str
    n_steps: int
    items: pd.DataFrame
    ranges: pd.DataFrame
    timings: dict = field(default_factory=dict)  # wall seconds per phase under the profiler (means)
    trace_path: Path | None = None

    def kernels(self, ranges: Sequence[str] | str | None = None, top: int | None = None) -> pd.DataFrame:
        return kernel_table(self.items, ranges=ranges, n_steps=self.n_steps, top=top)

    def categories(self, ranges: Sequence[str] | str | None = None) -> pd.DataFrame:
        return category_table(self.items, ranges=ranges, n_steps=self.n_steps)

    def range_totals(self) -> pd.DataFrame:
        return range_table(self.items, self.ranges, n_steps=self.n_steps)

    def phase_spans_ms(self, phase: str = "forward") -> list[float]:
        """Per instance of `phase`: from the range's start to the later of its end and its last
        kernel's end (the synchronise inside the range makes these equal on a GPU)."""
        rr = self.ranges[self.ranges["name"] == phase].sort_values("ts").reset_index(drop=True)
        col = f"{phase} index"
        spans = []
        for i, r in rr.iterrows():
            end = r["end"]
            if col in self.items.columns:
                mine = self.items[self.items[col] == i]
                if len(mine):
                    end = max(end, float((mine["ts"] + mine.get("wall_dur", mine["dur"])).max()))
            if containing_instance(self.ranges, STEP_RANGE, np.array([r["ts"]]))[0] >= 0:
                spans.append((end - r["ts"]) / 1e3)
        return spans


def profile_config(cfg: BenchmarkConfig, *, profile_steps: int = 3, trace_path: str | Path | None = None,
                   record_shapes: bool = False) -> ProfileResult:
    """Warm up (cfg.warmup), time cfg.steps phased steps without the profiler, then
    profile `profile_steps` more on the same model.

    The unprofiled and profiled steps run the same loop with the same timer, so the ratio of their
    means is the profiler's overhead. The profiler's schedule runs one extra step first with
    tracing on but discarded (CUPTI's start-up cost lands there, not in the steps reported). The
    trace goes to `trace_path` (.json or .json.gz), or a temporary file removed after parsing.
    """
    if profile_steps < 1:
        raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
    device = cfg.resolved_device()
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    tmp = None
    try:
        runner = StepRunner(cfg, device)
        for _ in range(cfg.warmup):
            runner.step()
        plain = [runner.step() for _ in range(cfg.steps)]
        if trace_path is None:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "trace.json"
        else:
            path = Path(trace_path)
        profiled = []
        sched = torch.profiler.schedule(wait=0, warmup=1, active=profile_steps, repeat=1)
        with torch.profiler.profile(activities=profiler_activities(device), schedule=sched,
                                    record_shapes=record_shapes,
                                    on_trace_ready=lambda p: export_trace(p, path)) as prof:
            for _ in range(profile_steps + 1):
                profiled.append(runner.step())
                prof.step()
        del runner
        items, ranges = parse_trace(path)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        if tmp is not None:
            tmp.cleanup()
        release_memory(device)
    profiled = profiled[1:]  # the profiler's warm-up step is not in the trace either
    timings = {}
    for ph in ("forward", "backward", "optimizer", "step"):
        if ph in plain[0]:
            for label, steps in (("plain", plain), ("profiled", profiled)):
                timings[f"{label}_{ph}_s"], timings[f"{label}_{ph}_std_s"] = mean_std([t[ph] for t in steps])
    n_steps = int((ranges["name"] == STEP_RANGE).sum())
    items = attribute(items, ranges)
    return ProfileResult(cfg, str(device), n_steps, items, ranges, timings, None if tmp else path)


def attention_flops(cfg: BenchmarkConfig) -> dict:
    """FLOPs of one forward pass inside naive attention, all layers: the two matmuls over the full
    score matrix (naive attention computes every pair and masks afterwards) and the softmax."""
    m = cfg.model_config()
    shape = dict(batch=cfg.batch_size, heads=m.n_heads, n_q=cfg.context_length, n_k=cfg.context_length)
    matmul = flops.attention_flops(**shape, d=m.d_head, causal=True, executed=True) // 2 * m.n_layers  # one of QK^T, PV
    return {"scores_matmul_flops": matmul, "final_matmul_flops": matmul,
            "softmax_flops": flops.softmax_flops(**shape) * m.n_layers}


# bytes a score element takes where the softmax reads it and writes its probability, by the
# sweep's precision; fp32 only: under autocast the softmax's input passes through a cast first,
# whose traffic a count of the softmax's own would leave out
SCORE_ELEMENT_BYTES = {"fp32": 4}


def softmax_bytes(cfg: BenchmarkConfig) -> int | None:
    """The least memory traffic of one forward pass's softmaxes, all layers: one read of the
    B·H·T² scores and one write of the probabilities. None where ``SCORE_ELEMENT_BYTES`` has no
    entry for the precision."""
    size = SCORE_ELEMENT_BYTES.get(cfg.precision)
    if size is None:
        return None
    m = cfg.model_config()
    return 2 * size * cfg.batch_size * m.n_heads * cfg.context_length ** 2 * m.n_layers


def summarize(res: ProfileResult, harness: dict | None = None, *, label: str | None = None) -> dict:
    """One flat row of the numbers the kernel-profiling questions use.

    ``harness``: the forward time to compare the profile with (``harness_forward_s`` and its
    ``harness_forward_std_s``); by default the profile's own unprofiled steps, which are the
    harness's loop and timer (``StepRunner``: a synchronise after each phase, perf_counter) on the
    same model in the same process.
    """
    cfg = res.config
    if harness is None:
        harness = {"harness_forward_s": res.timings.get("plain_forward_s"),
                   "harness_forward_std_s": res.timings.get("plain_forward_std_s")}
    model = cfg.model_config()
    # the model's shape the report counts weight matmuls by (layers, and the projection layout that
    # decides which Linears a layer has), recorded from the model measured so that nothing
    # downstream rebuilds it from the preset and its overrides
    row = {"label": label or cfg.model, "model": cfg.model, "model_overrides": dict(cfg.model_overrides),
           "n_layers": model.n_layers, "fused_projections": model.fused_projections,
           "context_length": cfg.context_length,
           "batch_size": cfg.batch_size, "mode": cfg.mode, "precision": cfg.precision, "tf32": cfg.tf32,
           "device": res.device,
           "status": "ok", "n_steps": res.n_steps, **harness}
    row.update(res.timings)
    spans = res.phase_spans_ms("forward")
    row["profiled_forward_span_s"] = statistics.fmean(spans) / 1e3 if spans else None
    row["forward_kernel_s"] = res.items.loc[res.items["forward"], "dur"].sum() / 1e6 / max(res.n_steps, 1)
    row["step_kernel_s"] = res.items["dur"].sum() / 1e6 / max(res.n_steps, 1)
    plain, prof = res.timings.get("plain_forward_s"), res.timings.get("profiled_forward_s")
    row["profiler_overhead"] = prof / plain - 1 if plain else None
    if harness.get("harness_forward_s") and spans:
        h = harness["harness_forward_s"]
        # whether that agrees is the report's call, at a tolerance fixed beforehand
        # (systems.report.kernel_profiling.AGREE_TOLERANCE)
        row["span_vs_harness"] = row["profiled_forward_span_s"] / h - 1
    fwd = res.kernels(ranges="forward")
    if len(fwd):
        top = fwd.iloc[0]
        row.update(top_forward_kernel=top["kernel"], top_forward_name=top["name"],
                   top_forward_category=top["category"], top_forward_share=top["share"],
                   top_forward_per_pass=top["instances_per_step"])
    if cfg.mode != "forward" and "backward" in res.items.columns:
        fb = res.kernels(ranges=["forward", "backward"])
        if len(fb):
            top = fb.iloc[0]
            row.update(top_fwd_bwd_kernel=top["kernel"], top_fwd_bwd_name=top["name"],
                       top_fwd_bwd_category=top["category"], top_fwd_bwd_share=top["share"])
    if cfg.mode == "train_step" and "optimizer step" in res.items.columns:
        # what the optimizer's kernels compute (their category by name); the range says they are its
        opt = res.items[res.items["optimizer step"]]
        by_category = opt.groupby("category")["dur"].sum()
        row["optimizer_elementwise_share"] = (by_category.get("elementwise", 0.0) / by_category.sum()
                                              if len(opt) else None)
        row["optimizer_kernels_per_step"] = len(opt) / max(res.n_steps, 1)
    step_kernel = res.items["dur"].sum()
    for phase in PHASE_RANGES:
        if phase in res.items.columns:
            # the phase's share of the step's kernel time (the ranges partition a synchronised step)
            row[f"phase_share_{phase.replace(' ', '_')}"] = (res.items.loc[res.items[phase], "dur"].sum() / step_kernel
                                                            if step_kernel > 0 else None)
    for c in res.categories().itertuples():
        row[f"share_{c.category}"] = c.share
    for c in res.categories(ranges="forward").itertuples():
        row[f"fwd_share_{c.category}"] = c.share
    if "backward" in res.items.columns and res.items["backward"].any():
        # the backward phase's own kernels by category, measured (a forward-only profile has none)
        for c in res.categories(ranges="backward").itertuples():
            row[f"bwd_share_{c.category}"] = c.share
    # attention (forward ranges): all kernels in each range, and the matmul kernels alone
    for rng in ATTENTION_RANGES:
        key = rng.replace(" ", "_")
        inside = res.items[res.items[rng] & res.items["forward"]] if rng in res.items.columns else res.items.iloc[:0]
        row[f"{key}_s"] = inside["dur"].sum() / 1e6 / max(res.n_steps, 1)
        row[f"{key}_matmul_s"] = inside.loc[inside["category"] == "matmul", "dur"].sum() / 1e6 / max(res.n_steps, 1)
    fl = attention_flops(cfg)
    row.update(fl)
    row["softmax_bytes"] = softmax_bytes(cfg)
    mm_time = row["attention_scores_matmul_s"] + row["final_matmul_matmul_s"]
    row["softmax_to_matmul_time"] = row["softmax_s"] / mm_time if mm_time > 0 else None
    row["softmax_to_matmul_flops"] = fl["softmax_flops"] / (fl["scores_matmul_flops"] + fl["final_matmul_flops"])
    return row


@dataclass(frozen=True)
class ProfilePlan:
    """What a kernel-profiling sweep runs: sizes x contexts x modes, smallest first.

    ``longest``: the contexts are a ladder to climb; each size stops at the first context where its
    train step runs out of memory (that point is kept as an "oom" row), so the last context that
    ran is the longest that fits. Otherwise every context is tried, and a (size, mode) that ran out
    of memory skips the longer contexts.
    """

    sizes: dict[str, tuple[str, dict]]  # label -> (preset, model overrides)
    contexts: tuple[int, ...]
    longest: bool = False
    modes: tuple[str, ...] = ("train_step", "forward")  # the train step first: it needs the most memory
    batch_size: int = 4
    # harness steps before anything is timed: on an H100 two left the small sizes' first timed steps
    # tens of percent slow, three did not
    warmup: int = 3
    steps: int = 5  # timed steps without the profiler (the harness's number, and the overhead's baseline)
    profile_steps: int = 2  # recorded steps (after one discarded profiler warm-up step)
    precision: str = "fp32"
    device: str = "auto"

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("sizes must name at least one model size")
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must be distinct and ascending, got {self.contexts}")
        for mode in self.modes:
            if mode not in ("forward", "forward_backward", "train_step"):
                raise ValueError(f"modes must be forward, forward_backward or train_step, got {mode!r}")
        if self.profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {self.profile_steps}")
        for label, c in ((label, c) for label in self.sizes for c in self.contexts):
            self.config(label, c, self.modes[0])  # a bad size or context fails here, before any work

    def config(self, label: str, context_length: int, mode: str) -> BenchmarkConfig:
        preset, overrides = self.sizes[label]
        overrides = dict(overrides)
        # the model's RoPE table must cover the context: raise its maximum where the ladder goes past it
        if context_length > get_config(preset, **overrides).context_length:
            overrides["context_length"] = context_length
        return BenchmarkConfig(model=preset, model_overrides=overrides, context_length=context_length,
                               batch_size=self.batch_size, warmup=self.warmup, steps=self.steps, mode=mode,
                               precision=self.precision, device=self.device)

    def points(self) -> list[tuple[str, int, str]]:
        return [(label, c, mode) for label in self.sizes for c in self.contexts for mode in self.modes]

    def trace_point(self) -> tuple[str, int, str]:
        """The point whose trace a sweep keeps by default: the first train step."""
        return next((p for p in self.points() if p[2] == "train_step"), self.points()[0])

    def largest(self, results: dict, mode: str) -> tuple[str, int, str] | None:
        """The biggest (size, then context) point profiled in ``mode`` among ``results``' keys."""
        keys = [k for k in results if k[2] == mode]
        return max(keys, key=lambda k: (list(self.sizes).index(k[0]), k[1])) if keys else None


def trace_file(trace_dir: str | Path, point: tuple[str, int, str]) -> Path:
    """Where a sweep keeps the trace of ``point`` = (label, context_length, mode)."""
    label, context, mode = point
    return Path(trace_dir) / f"{label}_{context}_{mode}.json.gz"


# notebook 02's sizes for the 2026 handout, which asks for two of its choice: the smallest, and one
# large enough that matmuls dominate, with three power-of-two contexts above 128 that fit
DEFAULT_2026_SIZES = ("small", "large")
SMOKE_SIZES = {"debug": ("debug", {}), "debug-wide": ("debug", {"d_model": 128, "d_ff": 384})}


def handout_plan(handout: str, *, full: bool, sizes: Sequence[str] | None = None, device: str = "auto") -> ProfilePlan:
    """What the handout's nsys_profile question asks for. 2025: every size of its Table 1 at contexts
    128, 256, 512 and 1024. 2026: two sizes, each climbing power-of-two contexts from 256 until its
    train step no longer fits. Smoke (CPU): two debug-sized models, contexts 32-128, fewer steps."""
    table = handout_sizes(handout)
    if not full:
        return ProfilePlan(sizes=SMOKE_SIZES, contexts=(32, 64, 128), longest=handout == "2026", batch_size=2,
                           warmup=1, steps=2, profile_steps=1, device=device)
    names = list(sizes) if sizes else (list(table) if handout == "2025" else list(DEFAULT_2026_SIZES))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown size(s) {unknown} for the {handout} handout; choose from {', '.join(table)}")
    chosen = {n: (table[n], {}) for n in names}
    if handout == "2025":
        return ProfilePlan(sizes=chosen, contexts=(128, 256, 512, 1024), device=device)
    return ProfilePlan(sizes=chosen, contexts=tuple(2 ** k for k in range(8, 15)), longest=True, device=device)


def profile_sweep(plan: ProfilePlan, *, writer=None, budget: Budget | None = None,
                  keep_trace: tuple[str, int, str] | None = None, trace_dir: str | Path | None = None,
                  progress: bool = True) -> tuple[pd.DataFrame, dict]:
    """Profile the plan's points in order; returns (summary rows, {(label, ctx, mode): ProfileResult}).

    Each row is written to `writer` (a ResultWriter) as it is produced. An out-of-memory point
    becomes a row with status "oom" and the sweep goes on (see ProfilePlan for what it skips after
    one); a point the budget leaves out is a row with status "skipped (budget)". The trace of
    `keep_trace` = (label, context_length, mode), by default the first train step, is kept as
    trace_dir/<label>_<ctx>_<mode>.json.gz.
    """
    from tqdm import tqdm

    keep_trace = keep_trace or plan.trace_point()
    rows, results = [], {}
    oom_at: dict[tuple[str, str], int] = {}  # (label, mode) -> the context that ran out of memory
    stopped: set[str] = set()  # sizes whose climb is over (longest)
    for label, c, mode in tqdm(plan.points(), disable=not progress, desc="profile"):
        if label in stopped:
            continue
        cfg = plan.config(label, c, mode)
        row = {"label": label, "model": cfg.model, "context_length": c, "mode": mode, "precision": cfg.precision,
               "batch_size": cfg.batch_size}
        if (label, mode) in oom_at:
            row.update(status=f"skipped (out of memory at context {oom_at[label, mode]})", error=None)
        elif budget is not None and not budget.allows():
            row.update(budget.skipped_row())
        else:
            trace_path = None
            if trace_dir is not None and (label, c, mode) == tuple(keep_trace):
                trace_path = trace_file(trace_dir, keep_trace)
            with catch_oom() as oom:
                res = profile_config(cfg, profile_steps=plan.profile_steps, trace_path=trace_path)
                row = summarize(res, label=label)
                results[(label, c, mode)] = res
            release_memory(cfg.resolved_device())  # after the with block: the exception's frames are gone
            if oom:
                row.update(status="oom", error=oom.message)
                oom_at[label, mode] = c
                if plan.longest:
                    stopped.add(label)
        rows.append(writer.write(row) if writer is not None else row)
    df = pd.DataFrame(rows)
    if "env" in df.columns:
        df = df.drop(columns="env")
    return df, results


# ----------------------------------------------------------------------------- Nsight Systems


def nsys_command(cfg: BenchmarkConfig, report: str | Path, *, steps: int = 3) -> list[str]:
    """The nsys profile command line: capture only the NVTX range around the measured steps."""
    return ["nsys", "profile", "--trace=cuda,nvtx", "--capture-range=nvtx",
            f"--nvtx-capture={NSYS_CAPTURE_RANGE}", "--capture-range-end=stop", "--force-overwrite=true",
            "--output", str(report), sys.executable, "-m", "systems.bench.profile", "nsys-target",
            "--config-json", json.dumps(asdict(cfg)), "--steps", str(steps)]


def run_nsys(cfg: BenchmarkConfig, out_dir: str | Path, *, steps: int = 3, timeout_s: float = 600) -> pd.DataFrame:
    """Profile `cfg` under nsys and return its cuda_gpu_kern_sum as a kernel table."""
    if not nsys_available():
        raise RuntimeError("nsys is not on PATH")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / f"{cfg.model}_{cfg.context_length}_{cfg.mode}"
    # torch pushes NVTX ranges as unregistered strings; nsys only matches registered ones unless told
    env = {**os.environ, "NSYS_NVTX_PROFILER_REGISTER_ONLY": "0"}
    proc = subprocess.run(nsys_command(cfg, report, steps=steps), env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"nsys profile failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    rep = next((p for p in (report.with_suffix(".nsys-rep"), report.with_suffix(".qdrep")) if p.exists()), None)
    if rep is None:
        raise RuntimeError(f"nsys wrote no report at {report}.nsys-rep; output: {proc.stdout.strip()[-500:]}")
    last = None
    for name in ("cuda_gpu_kern_sum", "gpukernsum"):  # the report was renamed in nsys 2022
        stats = subprocess.run(["nsys", "stats", "--report", name, "--format", "csv", "--output", "-",
                                "--force-export=true", str(rep)], capture_output=True, text=True, timeout=timeout_s)
        try:
            return parse_nsys_kern_sum(stats.stdout, n_steps=steps)
        except ValueError as exc:
            last = f"{exc}; stderr: {stats.stderr.strip()[-300:]}"
    raise RuntimeError(f"could not read nsys stats: {last}")


def _nsys_target(cfg: BenchmarkConfig, steps: int) -> None:
    """What runs under nsys: warm-up, then `steps` phased steps inside the capture range with
    record_function ranges emitted as NVTX."""
    device = cfg.resolved_device()
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    runner = StepRunner(cfg, device)
    for _ in range(cfg.warmup):
        runner.step()
    with torch.autograd.profiler.emit_nvtx(record_shapes=False):
        torch.cuda.nvtx.range_push(NSYS_CAPTURE_RANGE)
        for _ in range(steps):
            runner.step()
        torch.cuda.synchronize(device)
        torch.cuda.nvtx.range_pop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m systems.bench.profile")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("nsys-target", help="the process nsys profiles (see run_nsys)")
    t.add_argument("--config-json", required=True)
    t.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.command == "nsys-target":
        _nsys_target(BenchmarkConfig(**json.loads(args.config_json)), args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
