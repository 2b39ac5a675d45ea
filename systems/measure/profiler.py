"""Where the time goes: the harness's modes under torch.profiler (or Nsight Systems), as tidy tables.

Library:
    ``profile_config(cfg, ...) -> ProfileResult``   one configuration, warm-up left out
    ``result.kernels(ranges=["forward"])``            a cuda_gpu_kern_sum-like table for some ranges
    ``result.categories(...)``, ``result.range_totals()``, ``plot_step_timeline(result)``
    ``run_nsys(cfg, out_dir)``                        the same kernel table from ``nsys stats`` when nsys exists
CLI (the process nsys launches): ``python -m systems.measure.profiler nsys-target --config-json '{...}'``.

How a profile is taken. The model and optimizer come from the harness's own runner
(``systems.bench.benchmark.StepRunner``); a step here is the harness's step with named ranges around its
phases (``step`` > ``forward`` / ``backward`` / ``optimizer step``), added from outside the model,
with the same synchronise-and-time rule. Inside attention the model already names ``attention
scores`` / ``softmax`` / ``final matmul``. The profiler runs with a schedule (one profiler warm-up
step, then the recorded steps) after the harness's warm-up steps, exports a Chrome trace, and
everything below is computed from that trace file: device kernels (memcpy/memset included) are
tied to the CPU-side launch through their ``correlation`` id and attributed to every range whose
time interval contains the launch (the backward's kernels are launched from autograd's thread
while the main thread sits in ``backward``, so containment is by time, not thread). Without CUDA
the "kernels" are the CPU operators, each with its self time (time not spent in a child operator).

The profiler's own cost is measured on the same model and loop: ``cfg.measure_steps`` steps
timed without the profiler, then the profiled ones, same timer. The harness's number to compare
with comes from ``run_benchmark(cfg)`` itself.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from systems.bench.benchmark import PHASE_RANGES as HARNESS_PHASE_RANGES
from systems.bench.benchmark import STEP_RANGE, BenchmarkConfig, StepRunner, run_benchmark
from systems.measure.devices import release_memory

PHASE_RANGES = tuple(HARNESS_PHASE_RANGES.values())  # ("forward", "backward", "optimizer step")
ATTENTION_RANGES = ("attention scores", "softmax", "final matmul")  # named in systems.attention.naive
NSYS_CAPTURE_RANGE = "profiled steps"  # the NVTX range nsys --capture-range=nvtx waits for

# Kernel categories: the first rule whose regular expression matches the kernel (or CPU operator)
# name wins, case-insensitively; unmatched names are "other". CUDA names are what cuBLAS/ATen/
# Triton call their kernels; the aten:: patterns cover the CPU-only profile.
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"adam|_foreach_|multi_tensor_apply"),
    ("matmul", r"gemm|gemv|splitKreduce|cutlass|cublas|xmma|nvjet|triton_tem|"
               r"aten::(mm|bmm|addmm|baddbmm|matmul|linear)\b|mkldnn_matmul"),
    ("reduction/softmax", r"softmax|reduce_kernel|reduce|logsumexp|layer_norm|rms_norm|triton_red|triton_per|"
                          r"aten::(sum|mean|amax|max|min|norm|var|std|logsumexp|_softmax|_log_softmax|"
                          r"_softmax_backward_data)\b"),
    ("copy/memset", r"memcpy|memset|copy|CatArray|FillFunctor|"
                    r"aten::(to|_to_copy|copy_|cat|stack|clone|contiguous|fill_|zero_|zeros|zeros_like|ones|"
                    r"ones_like|empty|empty_like|empty_strided)\b"),
    ("elementwise", r"elementwise|pointwise|triton_poi|tril|"
                    r"aten::(add|sub|rsub|mul|div|neg|exp|sigmoid|silu|sqrt|rsqrt|pow|masked_fill|tril|triu|where|"
                    r"lerp|addcmul|addcdiv|sin|cos|abs|clamp|reciprocal)"),
)
# Ranges whose every kernel takes one category whatever its name: our AdamW is a loop of
# elementwise torch ops, so only its range tells its kernels from the model's.
RANGE_CATEGORIES: dict[str, str] = {"optimizer step": "optimizer"}
CATEGORIES = ("matmul", "elementwise", "reduction/softmax", "copy/memset", "optimizer", "other")

# FLOPs per score element of a row softmax: max, subtract, exp, sum, divide (one each).
SOFTMAX_FLOPS_PER_ELEMENT = 5

_COMPILED_RULES = [(cat, re.compile(pat, re.IGNORECASE)) for cat, pat in CATEGORY_RULES]
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime", "driver"}


def categorize(name: str) -> str:
    """The category of one kernel / operator name by CATEGORY_RULES (no range rule)."""
    for cat, rx in _COMPILED_RULES:
        if rx.search(name):
            return cat
    return "other"


_HINT = re.compile(r"([A-Za-z_]\w*(?:_kernel\w*|Functor|Ops|_functor))\b")
# wrappers that say nothing about the operation: skip them to reach the functor inside
_GENERIC_HINT = re.compile(r"^(Binary|AUnary|BUnary|Unary)Functor$|^gpu_kernel|elementwise_kernel$|^launch_")


def short_kernel_name(name: str) -> str:
    """A readable label: the kernel's base name plus the functor it instantiates, if any.

    'void at::native::vectorized_elementwise_kernel<4, ...MulFunctor<float>...>(...)' ->
    'vectorized_elementwise_kernel [MulFunctor]'. CPU operator names are returned unchanged.
    """
    text = name.strip()
    if text.startswith("aten::") or not (text.startswith("void ") or "::" in text):
        return text  # CPU operators, cuBLAS-style plain names, "Memcpy DtoD (Device -> Device)"
    if text.startswith("void "):
        text = text[5:]
    cut = min(i for i in (text.find("<"), text.find("("), len(text)) if i >= 0)
    base = text[:cut].split("::")[-1].strip() or text[:cut]
    hints = [h for h in _HINT.findall(text[cut:]) if h != base and not _GENERIC_HINT.search(h)]
    return f"{base} [{hints[0]}]" if hints else base


# ----------------------------------------------------------------------------- trace parsing


def load_trace(path: str | Path) -> dict:
    """A Chrome trace (.json or .json.gz) as exported by torch.profiler."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _cpu_self_times(ops: pd.DataFrame) -> pd.DataFrame:
    """Self time and timeline flag of CPU operators, nesting by time containment per thread."""
    ops = ops.sort_values(["pid", "tid", "ts", "dur"], ascending=[True, True, True, False]).reset_index(drop=True)
    child_time = np.zeros(len(ops))
    has_child = np.zeros(len(ops), dtype=bool)
    ts, end = ops["ts"].to_numpy(), (ops["ts"] + ops["dur"]).to_numpy()
    key = list(zip(ops["pid"], ops["tid"]))
    stack: list[int] = []
    for i in range(len(ops)):
        if stack and key[stack[-1]] != key[i]:
            stack = []
        while stack and end[stack[-1]] <= ts[i] + 1e-6:  # 1e-6 us: trace timestamps are rounded
            stack.pop()
        if stack:
            child_time[stack[-1]] += end[i] - ts[i]
            has_child[stack[-1]] = True
        stack.append(i)
    ops["self_dur"] = np.maximum(ops["dur"].to_numpy() - child_time, 0.0)
    # drawn on a timeline: operators doing most of their own work (aten::mm has tiny view
    # children, so "leaf only" would hide every matmul)
    ops["on_timeline"] = ~has_child | (ops["self_dur"] >= 0.5 * ops["dur"])
    return ops


def parse_trace(trace: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(items, ranges) from a torch.profiler Chrome trace.

    ranges: every record_function range (name, ts, end, tid), times in microseconds.
    items:  device kernels / memcpy / memset when the trace has any (dur = device time, t_attr = CPU
            launch time found by correlation id), else CPU operators (dur = self time, t_attr = start).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    ranges = pd.DataFrame(
        [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid"))
         for e in events if str(e.get("cat", "")).lower() == "user_annotation"],
        columns=["name", "ts", "end", "tid"])
    gpu = [e for e in events if str(e.get("cat", "")).lower() in _GPU_CATS]
    if gpu:
        launch_ts = {}
        for e in events:
            if str(e.get("cat", "")).lower() in _LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launch_ts[corr] = float(e["ts"])
        rows = []
        for e in gpu:
            args = e.get("args") or {}
            ts = float(e["ts"])
            cat = str(e.get("cat", "")).lower()
            kind = "kernel" if cat == "kernel" else ("memcpy" if "memcpy" in cat else "memset")
            # a kernel with no launch event (lost by CUPTI) is placed by its own start time
            rows.append((e["name"], kind, ts, float(e["dur"]), launch_ts.get(args.get("correlation"), ts),
                         args.get("stream", e.get("tid")), True))
        items = pd.DataFrame(rows, columns=["name", "kind", "ts", "dur", "t_attr", "lane", "on_timeline"])
        items["device"] = "cuda"
    else:
        ops = pd.DataFrame([(e["name"], float(e["ts"]), float(e["dur"]), e.get("pid"), e.get("tid"))
                            for e in events if str(e.get("cat", "")).lower() == "cpu_op"],
                           columns=["name", "ts", "dur", "pid", "tid"])
        ops = _cpu_self_times(ops)
        items = pd.DataFrame({"name": ops["name"], "kind": "cpu_op", "ts": ops["ts"], "dur": ops["self_dur"],
                              "t_attr": ops["ts"], "lane": ops["tid"], "on_timeline": ops["on_timeline"],
                              "wall_dur": ops["dur"]})
        items["device"] = "cpu"
    return items, ranges


def _containing_instance(ranges: pd.DataFrame, name: str, t: np.ndarray) -> np.ndarray:
    """For each time in t, the index (in start order) of the `name` range containing it, else -1."""
    sel = ranges[ranges["name"] == name].sort_values("ts")
    if sel.empty:
        return np.full(len(t), -1)
    starts, ends = sel["ts"].to_numpy(), sel["end"].to_numpy()
    idx = np.searchsorted(starts, t, side="right") - 1
    ok = (idx >= 0) & (t <= ends[np.clip(idx, 0, None)])
    return np.where(ok, idx, -1)


def attribute(items: pd.DataFrame, ranges: pd.DataFrame, *,
              range_names: Sequence[str] = (STEP_RANGE, *PHASE_RANGES, *ATTENTION_RANGES),
              range_categories: dict[str, str] | None = None) -> pd.DataFrame:
    """Items inside a `step` range, with a boolean column per range name, the step index, the
    instance index of each phase and the category (name rules, then range rules)."""
    items = items.copy()
    t = items["t_attr"].to_numpy()
    for name in range_names:
        inst = _containing_instance(ranges, name, t)
        items[name] = inst >= 0
        if name == STEP_RANGE:
            items["step_index"] = inst
        elif name in PHASE_RANGES:
            items[f"{name} index"] = inst
    if STEP_RANGE in range_names:
        items = items[items[STEP_RANGE]].copy()
    items["category"] = [categorize(n) for n in items["name"]]
    for rng, cat in (RANGE_CATEGORIES if range_categories is None else range_categories).items():
        if rng in items.columns:
            items.loc[items[rng], "category"] = cat
    items["kernel"] = [short_kernel_name(n) for n in items["name"]]
    return items.reset_index(drop=True)


# ----------------------------------------------------------------------------- tables


def _select(items: pd.DataFrame, ranges: Sequence[str] | str | None) -> pd.DataFrame:
    if ranges is None:
        return items
    ranges = [ranges] if isinstance(ranges, str) else list(ranges)
    missing = [r for r in ranges if r not in items.columns]
    if missing:
        known = [c for c in items.columns if c in (STEP_RANGE, *PHASE_RANGES, *ATTENTION_RANGES)]
        raise ValueError(f"unknown range(s) {missing}; the items carry {known}")
    return items[items[ranges].any(axis=1)]


def kernel_table(items: pd.DataFrame, *, ranges: Sequence[str] | str | None = None, n_steps: int = 1,
                 top: int | None = None) -> pd.DataFrame:
    """Nsight's cuda_gpu_kern_sum for the items inside any of `ranges` (all items if None):
    one row per (kernel name, category), total time, share, instances, mean, sorted by total."""
    sel = _select(items, ranges)
    cols = ["kernel", "category", "total_ms", "share", "instances", "instances_per_step", "mean_us", "name"]
    if sel.empty:
        return pd.DataFrame(columns=cols)
    g = (sel.groupby(["name", "category"], sort=False)["dur"].agg(["sum", "size", "mean"]).reset_index())
    total = g["sum"].sum()
    out = pd.DataFrame({
        "kernel": [short_kernel_name(n) for n in g["name"]],
        "category": g["category"],
        "total_ms": g["sum"] / 1e3,
        "share": g["sum"] / total if total > 0 else 0.0,
        "instances": g["size"].astype(int),
        "instances_per_step": g["size"] / max(n_steps, 1),
        "mean_us": g["mean"],
        "name": g["name"],
    }).sort_values("total_ms", ascending=False, ignore_index=True)
    return out.head(top) if top else out


def category_table(items: pd.DataFrame, *, ranges: Sequence[str] | str | None = None,
                   n_steps: int = 1) -> pd.DataFrame:
    """Time per kernel category (per step), its share, and kernel launches per step."""
    sel = _select(items, ranges)
    g = sel.groupby("category")["dur"].agg(["sum", "size"]).reindex(CATEGORIES, fill_value=0)
    total = g["sum"].sum()
    return pd.DataFrame({
        "category": g.index,
        "ms_per_step": g["sum"].to_numpy() / 1e3 / max(n_steps, 1),
        "share": g["sum"].to_numpy() / total if total > 0 else 0.0,
        "kernels_per_step": g["size"].to_numpy() / max(n_steps, 1),
    }).reset_index(drop=True)


def range_table(items: pd.DataFrame, ranges: pd.DataFrame, *, n_steps: int = 1,
                names: Sequence[str] = (STEP_RANGE, *PHASE_RANGES, *ATTENTION_RANGES)) -> pd.DataFrame:
    """Per range: instances per step, wall time per step (the range's CPU duration), kernel time per
    step, kernels per step, and the range's share of the step's kernel time."""
    step_kernel = items["dur"].sum()
    rows = []
    for name in names:
        if name not in items.columns:
            continue
        inside = items[items[name]]
        rr = ranges[ranges["name"] == name]
        # only instances that lie inside a profiled step (the profiler's warm-up step is not exported,
        # but be explicit)
        rr = rr[_containing_instance(ranges, STEP_RANGE, rr["ts"].to_numpy()) >= 0] if name != STEP_RANGE else rr
        rows.append({
            "range": name,
            "instances_per_step": len(rr) / max(n_steps, 1),
            "wall_ms_per_step": (rr["end"] - rr["ts"]).sum() / 1e3 / max(n_steps, 1),
            "kernel_ms_per_step": inside["dur"].sum() / 1e3 / max(n_steps, 1),
            "kernels_per_step": len(inside) / max(n_steps, 1),
            "share_of_step_kernel_time": inside["dur"].sum() / step_kernel if step_kernel > 0 else 0.0,
        })
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- profiling a configuration


def profiler_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _export_trace(prof, path: Path) -> None:
    """Chrome trace; .gz compressed here (older torch exports only plain JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as fin, gzip.open(path, "wb") as fout:
                shutil.copyfileobj(fin, fout)
    else:
        prof.export_chrome_trace(str(path))


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
            if _containing_instance(self.ranges, STEP_RANGE, np.array([r["ts"]]))[0] >= 0:
                spans.append((end - r["ts"]) / 1e3)
        return spans


def profile_config(cfg: BenchmarkConfig, *, profile_steps: int = 3, trace_path: str | Path | None = None,
                   record_shapes: bool = False) -> ProfileResult:
    """Warm up (cfg.warmup_steps), time cfg.measure_steps phased steps without the profiler, then
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
        for _ in range(cfg.warmup_steps):
            runner.step()
        plain = [runner.step() for _ in range(cfg.measure_steps)]
        if trace_path is None:
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "trace.json"
        else:
            path = Path(trace_path)
        profiled = []
        sched = torch.profiler.schedule(wait=0, warmup=1, active=profile_steps, repeat=1)
        with torch.profiler.profile(activities=profiler_activities(device), schedule=sched,
                                    record_shapes=record_shapes,
                                    on_trace_ready=lambda p: _export_trace(p, path)) as prof:
            for _ in range(profile_steps + 1):
                profiled.append(runner.step())
                prof.step()
        del runner
        items, ranges = parse_trace(load_trace(path))
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
                xs = [t[ph] for t in steps]
                timings[f"{label}_{ph}_s"] = statistics.fmean(xs)
                timings[f"{label}_{ph}_std_s"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
    n_steps = int((ranges["name"] == STEP_RANGE).sum())
    items = attribute(items, ranges)
    return ProfileResult(cfg, str(device), n_steps, items, ranges, timings, None if tmp else path)


def harness_timings(cfg: BenchmarkConfig) -> dict:
    """The harness's own phase means and spreads (run_benchmark, no profiler)."""
    rec = run_benchmark(cfg)
    out = {"harness_status": rec["status"]}
    for ph in ("forward", "backward", "optimizer", "step"):
        out[f"harness_{ph}_s"] = rec.get(f"{ph}_mean_s")
        out[f"harness_{ph}_std_s"] = rec.get(f"{ph}_std_s")
    return out


def attention_flops(cfg: BenchmarkConfig) -> dict:
    """Analytic FLOPs of one forward pass inside naive attention, all layers (2 per multiply-add)."""
    m = cfg.model_config()
    b, t = cfg.batch_size, cfg.context_length
    matmul = 2 * b * m.n_heads * t * t * m.d_head * m.n_layers  # one of QK^T or PV
    return {"scores_matmul_flops": matmul, "final_matmul_flops": matmul,
            "softmax_flops": SOFTMAX_FLOPS_PER_ELEMENT * b * m.n_heads * t * t * m.n_layers}


def summarize(res: ProfileResult, harness: dict | None = None, *, label: str | None = None) -> dict:
    """One flat row of the numbers the kernel-profiling questions use."""
    cfg = res.config
    row = {"label": label or cfg.model, "model": cfg.model, "context_length": cfg.context_length,
           "batch_size": cfg.batch_size, "mode": cfg.mode, "precision": cfg.precision, "device": res.device,
           "status": "ok", "n_steps": res.n_steps, **(harness or {})}
    row.update(res.timings)
    spans = res.phase_spans_ms("forward")
    row["profiled_forward_span_s"] = statistics.fmean(spans) / 1e3 if spans else None
    row["forward_kernel_s"] = res.items.loc[res.items["forward"], "dur"].sum() / 1e6 / max(res.n_steps, 1)
    row["step_kernel_s"] = res.items["dur"].sum() / 1e6 / max(res.n_steps, 1)
    plain, prof = res.timings.get("plain_forward_s"), res.timings.get("profiled_forward_s")
    row["profiler_overhead"] = prof / plain - 1 if plain else None
    if harness and harness.get("harness_forward_s") and spans:
        h = harness["harness_forward_s"]
        row["span_vs_harness"] = row["profiled_forward_span_s"] / h - 1
        # agreement: the profiled span lies within the profiler's measured slow-down of the same
        # loop, plus two standard deviations of the noise in that comparison: the harness's
        # step-to-step spread and the spreads of the unprofiled and profiled steps the overhead
        # was measured from (added in quadrature: independent runs)
        spread = math.sqrt(sum((res.timings.get(k) or harness.get(k) or 0.0) ** 2 for k in (
            "harness_forward_std_s", "plain_forward_std_s", "profiled_forward_std_s")))
        tol = abs(prof - plain) + 2 * spread
        row["agrees_within_overhead"] = bool(abs(row["profiled_forward_span_s"] - h) <= tol)
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
        # what the optimizer's kernels are by name alone (the range rule calls them all "optimizer")
        opt = res.items[res.items["optimizer step"]]
        by_name = opt.groupby(opt["name"].map(categorize))["dur"].sum()
        row["optimizer_elementwise_share"] = by_name.get("elementwise", 0.0) / by_name.sum() if len(opt) else None
        row["optimizer_kernels_per_step"] = len(opt) / max(res.n_steps, 1)
    for c in res.categories().itertuples():
        row[f"share_{c.category}"] = c.share
    for c in res.categories(ranges="forward").itertuples():
        row[f"fwd_share_{c.category}"] = c.share
    # attention (forward ranges): all kernels in each range, and the matmul kernels alone
    for rng in ATTENTION_RANGES:
        key = rng.replace(" ", "_")
        inside = res.items[res.items[rng] & res.items["forward"]] if rng in res.items.columns else res.items.iloc[:0]
        row[f"{key}_s"] = inside["dur"].sum() / 1e6 / max(res.n_steps, 1)
        row[f"{key}_matmul_s"] = inside.loc[inside["category"] == "matmul", "dur"].sum() / 1e6 / max(res.n_steps, 1)
    fl = attention_flops(cfg)
    row.update(fl)
    mm_time = row["attention_scores_matmul_s"] + row["final_matmul_matmul_s"]
    row["softmax_to_matmul_time"] = row["softmax_s"] / mm_time if mm_time > 0 else None
    row["softmax_to_matmul_flops"] = fl["softmax_flops"] / (fl["scores_matmul_flops"] + fl["final_matmul_flops"])
    return row


def profile_sweep(configs: Iterable[tuple[str, BenchmarkConfig]], *, profile_steps: int = 3, writer=None,
                  keep_trace: tuple[str, int, str] | None = None, trace_dir: str | Path | None = None,
                  progress: bool = True) -> tuple[pd.DataFrame, dict]:
    """Profile (label, config) pairs in order; returns (summary rows, {(label, ctx, mode): ProfileResult}).

    Each row is written to `writer` (a ResultWriter) as it is produced; an out-of-memory point
    becomes a row with status "oom" and the sweep goes on. The trace of the point `keep_trace`
    = (label, context_length, mode) is kept as trace_dir/<label>_<ctx>_<mode>.json.gz.
    """
    from tqdm.auto import tqdm

    configs = list(configs)
    rows, results = [], {}
    for label, cfg in tqdm(configs, disable=not progress, desc="profile"):
        key = (label, cfg.context_length, cfg.mode)
        device = cfg.resolved_device()
        trace_path = None
        if keep_trace is not None and key == tuple(keep_trace) and trace_dir is not None:
            trace_path = Path(trace_dir) / f"{label}_{cfg.context_length}_{cfg.mode}.json.gz"
        try:
            harness = harness_timings(cfg)
            release_memory(device)
            if harness["harness_status"] != "ok":
                raise torch.OutOfMemoryError("out of memory in the harness run")
            res = profile_config(cfg, profile_steps=profile_steps, trace_path=trace_path)
            row = summarize(res, harness, label=label)
            results[key] = res
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc).lower():
                raise
            row = {"label": label, "model": cfg.model, "context_length": cfg.context_length, "mode": cfg.mode,
                   "status": "oom", "error": str(exc).splitlines()[0][:300]}
        release_memory(device)
        rows.append(writer.write(row) if writer is not None else row)
    df = pd.DataFrame(rows)
    if "env" in df.columns:
        df = df.drop(columns="env")
    return df, results


# ----------------------------------------------------------------------------- timeline figure


def plot_step_timeline(source: ProfileResult | str | Path, *, step: int = -1, ax=None, title: str | None = None):
    """Kernel categories over time in one step, drawn from the Chrome trace (or a ProfileResult's
    items, themselves parsed from it); phases shaded. Returns the figure."""
    import matplotlib.pyplot as plt

    if isinstance(source, ProfileResult):
        items, ranges = source.items, source.ranges
    else:
        items, ranges = parse_trace(load_trace(source))
        items = attribute(items, ranges)
    n = int(items["step_index"].max()) + 1 if len(items) else 0
    if n == 0:
        raise ValueError("the trace has no kernels inside a 'step' range")
    k = step % n
    steps = ranges[ranges["name"] == STEP_RANGE].sort_values("ts").reset_index(drop=True)
    t0, t1 = steps.loc[k, "ts"], steps.loc[k, "end"]
    mine = items[(items["step_index"] == k) & items["on_timeline"]]
    dur = mine["wall_dur"] if "wall_dur" in mine.columns else mine["dur"]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.2))
    else:
        fig = ax.figure
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for y, cat in enumerate(CATEGORIES):
        sel = mine["category"] == cat
        bars = list(zip((mine.loc[sel, "ts"] - t0) / 1e3, dur[sel] / 1e3))
        if bars:
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors[cat], linewidth=0)
    for i, phase in enumerate(PHASE_RANGES):
        pr = ranges[(ranges["name"] == phase) & (ranges["ts"] >= t0) & (ranges["end"] <= t1 + 1e-3)]
        for r in pr.itertuples():
            ax.axvspan((r.ts - t0) / 1e3, (r.end - t0) / 1e3, color=f"C{i + 6}", alpha=0.12, lw=0,
                       label=phase)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_yticks(range(len(CATEGORIES)), CATEGORIES)
    # GPU work launched inside the step can finish after the CPU range closes (asynchronous
    # launches): keep it in view
    end = max(t1, float((mine["ts"] + dur).max())) if len(mine) else t1
    ax.set_xlim(0, (end - t0) / 1e3)
    ax.set_xlabel("time since step start (ms)")
    what = "GPU kernels" if (mine["device"] == "cuda").any() else "CPU operators"
    ax.set_title(title or f"one step: {what} by category")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- Nsight Systems


def nsys_available() -> bool:
    return shutil.which("nsys") is not None


_NSYS_COLUMNS = {
    "share": ("Time (%)", "Time(%)"),
    "total": ("Total Time (ns)", "Total Time"),
    "instances": ("Instances", "Count"),
    "mean": ("Avg (ns)", "Average (ns)", "Average", "Avg"),
    "name": ("Name",),
}


def parse_nsys_kern_sum(text: str, *, n_steps: int = 1) -> pd.DataFrame:
    """`nsys stats --report cuda_gpu_kern_sum --format csv` output -> the kernel_table schema.

    Skips whatever nsys prints before the header (a line beginning `Time (%)`, or `Time(%)` in
    older releases, whose mean column is `Average`), reads CSV (kernel names with commas come
    quoted) up to the first blank line. Times are nanoseconds in every release.
    """
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if ln.strip().lstrip('"').startswith(("Time (%)", "Time(%)"))), None)
    if start is None:
        raise ValueError("no kernel-summary header (a line starting 'Time (%)' or 'Time(%)') in the nsys output")
    body = []
    for ln in lines[start:]:
        if not ln.strip():
            break
        body.append(ln)
    records = list(csv.reader(body))
    header = [h.strip() for h in records[0]]
    col = {}
    for key, names in _NSYS_COLUMNS.items():
        hit = next((header.index(n) for n in names if n in header), None)
        if hit is None:
            raise ValueError(f"nsys kernel summary lacks a {key!r} column (looked for {names}); header: {header}")
        col[key] = hit

    def num(s: str) -> float:
        return float(s.replace(",", "").strip() or "nan")

    rows = []
    for rec in records[1:]:
        if len(rec) < len(header):
            continue
        name = rec[col["name"]]
        rows.append({"kernel": short_kernel_name(name), "category": categorize(name),
                     "total_ms": num(rec[col["total"]]) / 1e6, "share": num(rec[col["share"]]) / 100,
                     "instances": int(num(rec[col["instances"]])),
                     "instances_per_step": num(rec[col["instances"]]) / max(n_steps, 1),
                     "mean_us": num(rec[col["mean"]]) / 1e3, "name": name})
    cols = ["kernel", "category", "total_ms", "share", "instances", "instances_per_step", "mean_us", "name"]
    return pd.DataFrame(rows, columns=cols).sort_values("total_ms", ascending=False, ignore_index=True)


def nsys_command(cfg: BenchmarkConfig, report: str | Path, *, steps: int = 3) -> list[str]:
    """The nsys profile command line: capture only the NVTX range around the measured steps."""
    return ["nsys", "profile", "--trace=cuda,nvtx", "--capture-range=nvtx",
            f"--nvtx-capture={NSYS_CAPTURE_RANGE}", "--capture-range-end=stop", "--force-overwrite=true",
            "--output", str(report), sys.executable, "-m", "systems.measure.profiler", "nsys-target",
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
    for _ in range(cfg.warmup_steps):
        runner.step()
    with torch.autograd.profiler.emit_nvtx(record_shapes=False):
        torch.cuda.nvtx.range_push(NSYS_CAPTURE_RANGE)
        for _ in range(steps):
            runner.step()
        torch.cuda.synchronize(device)
        torch.cuda.nvtx.range_pop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m systems.measure.profiler")
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
