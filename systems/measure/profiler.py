"""Kernel tables from a torch.profiler trace (or Nsight Systems' kernel summary): which kernels
ran inside which named range, by category, per step.

    items, ranges = parse_trace(load_trace(path))   # device kernels (or CPU operators), the ranges
    items = attribute(items, ranges)                 # which step / phase / attention range each is in
    kernel_table(items, ranges=["forward"], n_steps=3)   # cuda_gpu_kern_sum-like, per range
    category_table(items, ...), range_table(items, ranges, ...)
    short_kernel_name(name), kernel_family(kernel), kernel_layout(kernel)   names a table or sentence shows

Device kernels (memcpy/memset included) are tied to their CPU-side launch through the
``correlation`` id and attributed to every range whose time interval contains the launch (the
backward's kernels are launched from autograd's thread while the main thread sits in
``backward``, so containment is by time, not thread). Without CUDA the "kernels" are the CPU
operators, each with its self time (time not spent in a child operator). The range names are the
training step's (``systems.measure.trace.STEP_RANGE`` / ``PHASE_RANGES``) and naive attention's.
"""

from __future__ import annotations

import csv
import gzip
import re
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch

# load_trace is re-exported: callers reach the one trace reader as profiler.load_trace
from systems.measure.trace import (DEVICE_CATEGORIES, LAUNCH_CATEGORIES, STEP_RANGE, category, complete_events,  # noqa: F401
                                   load_trace)
from systems.measure.trace import PHASE_RANGES as _PHASE_RANGES

PHASE_RANGES = tuple(_PHASE_RANGES.values())  # ("forward", "backward", "optimizer step")
ATTENTION_RANGES = ("attention scores", "softmax", "final matmul")  # named in systems.attention.naive
NSYS_CAPTURE_RANGE = "profiled steps"  # the NVTX range nsys --capture-range=nvtx waits for

# Kernel categories: what a kernel computes, read from its name; the first rule whose regular
# expression matches the kernel (or CPU operator) name wins, case-insensitively; unmatched names are
# "other". CUDA names are what cuBLAS/ATen/Triton call their kernels; the aten:: patterns cover the
# CPU-only profile. Where a kernel ran (forward, backward, optimizer step) is the ranges' business,
# not the category's: the optimizer's multi-tensor (_foreach) kernels are elementwise work.
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    ("matmul", r"gemm|gemv|splitKreduce|cutlass|cublas|xmma|nvjet|triton_tem|"
               r"aten::(mm|bmm|addmm|baddbmm|matmul|linear)\b|mkldnn_matmul"),
    # embedding lookups and their backward, the loss's gather and its scatter-add, the sort behind
    # index backward: data movement by index, kept out of "reduction" (a scatter-add's functor is
    # ReduceAdd) and "elementwise" (gather kernels are TensorIterator elementwise loops)
    ("other", r"gather|scatter|indexing|radix_?sort"),
    ("reduction/softmax", r"softmax|reduce_kernel|reduce|logsumexp|layer_norm|rms_norm|triton_red|triton_per|"
                          r"aten::(sum|mean|amax|max|min|norm|var|std|logsumexp|_softmax|_log_softmax|"
                          r"_softmax_backward_data)\b"),
    ("copy/memset", r"memcpy|memset|copy|CatArray|FillFunctor|"
                    r"aten::(to|_to_copy|copy_|cat|stack|clone|contiguous|fill_|zero_|zeros|zeros_like|ones|"
                    r"ones_like|empty|empty_like|empty_strided)\b"),
    ("elementwise", r"elementwise|pointwise|triton_poi|tril|multi_tensor_apply|_foreach_|adam|"
                    r"aten::(add|sub|rsub|mul|div|neg|exp|sigmoid|silu|sqrt|rsqrt|pow|masked_fill|tril|triu|where|"
                    r"lerp|addcmul|addcdiv|sin|cos|abs|clamp|reciprocal)"),
)
CATEGORIES = ("matmul", "elementwise", "reduction/softmax", "copy/memset", "other")

_COMPILED_RULES = [(cat, re.compile(pat, re.IGNORECASE)) for cat, pat in CATEGORY_RULES]


def categorize(name: str) -> str:
    """The category of one kernel / operator name by CATEGORY_RULES."""
    for cat, rx in _COMPILED_RULES:
        if rx.search(name):
            return cat
    return "other"


# an identifier in a kernel's template arguments that says what it computes: a functor
# (MulFunctor, CUDAFunctor_add), a kernel lambda's host (exp_kernel_cuda), reduction ops (MeanOps,
# sum_functor), a standard operator (std::multiplies, the op of a _foreach kernel)
_HINT = re.compile(r"\b([A-Za-z_]\w*?(?:_kernel\w*|Functor\w*|Ops|_functor))\b|\bstd::(plus|minus|multiplies|divides)\b")
# wrappers that say nothing about the operation: skip them to reach the functor inside
_GENERIC_HINT = re.compile(r"^(Binary|AUnary|BUnary|Unary)Functor$|^gpu_kernel|elementwise_kernel$|^launch_")
# a _foreach kernel's op is its third template argument (std::multiplies<float>, at::native::Sqrt<float>)
_ARG_NAME = re.compile(r"([A-Za-z_]\w*)\s*(?:<[^<>]*>)?\s*$")
_ANONYMOUS = "(anonymous namespace)::"


def _top_level_args(text: str) -> list[str]:
    """The comma-separated arguments of the template list that opens ``text`` ("<a, b<c, d>>...")."""
    args, depth, current = [], 0, []
    for ch in text:
        if ch == "<":
            depth += 1
            if depth == 1:
                continue
        elif ch == ">":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return args
        elif ch == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            continue
        if depth >= 1:
            current.append(ch)
    return args


def short_kernel_name(name: str) -> str:
    """A readable label: the kernel's base name plus the functor it instantiates, if any.

    'void at::native::vectorized_elementwise_kernel<4, ...MulFunctor<float>...>(...)' ->
    'vectorized_elementwise_kernel [MulFunctor]'; a _foreach kernel
    'void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...TensorListMetadata<2>,
    ...UnaryOpFunctor<float, 2, 1, 1>, at::native::Sqrt<float> >(...)' ->
    'multi_tensor_apply_kernel [UnaryOp Sqrt]'. Anonymous namespaces are dropped before parsing
    (they would otherwise end the name at their parenthesis). CPU operator names are returned unchanged.
    """
    text = name.strip()
    if text.startswith("aten::") or not (text.startswith("void ") or "::" in text):
        return text  # CPU operators, cuBLAS-style plain names, "Memcpy DtoD (Device -> Device)"
    text = text.removeprefix("void ").replace(_ANONYMOUS, "")
    cut = min(i for i in (text.find("<"), text.find("("), len(text)) if i >= 0)
    base = text[:cut].split("::")[-1].strip() or text[:cut].strip() or text
    args = _top_level_args(text[cut:]) if text[cut:cut + 1] == "<" else []
    if base in ("Kernel", "Kernel2") and args and re.fullmatch(r"\w+", args[0]):
        return args[0]  # cutlass::Kernel2<cutlass_80_simt_sgemm_...>: the instantiated kernel names it
    if base == "multi_tensor_apply_kernel" and len(args) >= 3:
        functor = args[1].split("<")[0].split("::")[-1].removesuffix("Functor")
        op = _ARG_NAME.search(args[2])
        return f"{base} [{functor} {op.group(1) if op else args[2]}]"
    hints = [a or b for a, b in _HINT.findall(text[cut:])]
    hints = [h for h in hints if h != base and not _GENERIC_HINT.search(h)]
    return f"{base} [{hints[0]}]" if hints else base


_LAYOUTS = {"nn", "nt", "tn", "tt"}  # cuBLAS/CUTLASS name tokens: which operands a GEMM reads transposed
_TILE = re.compile(r"\d+x\d+")


def kernel_layout(kernel: str) -> str | None:
    """A GEMM kernel's operand layout token ('tn', 'nt', 'nn', 'tt'), if its name carries one."""
    return next((t.lower() for t in kernel.split("_") if t.lower() in _LAYOUTS), None)


def kernel_family(kernel: str) -> str:
    """A GEMM kernel's name without its tile configuration: what a sentence can name, where the
    full name (tile, stages, warps, alignment) belongs in a table.
    'sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_...' -> 'sm80_xmma_gemm_…_tn',
    'cutlass_80_simt_sgemm_256x128_8x4_nn_align1' -> 'cutlass_80_simt_sgemm_…_nn'; a name with
    neither a 'gemm' part nor a tile size (CPU operators, elementwise kernels) is returned unchanged."""
    tokens = kernel.split("_")
    cut = next((i + 1 for i, t in enumerate(tokens) if "gemm" in t.lower()), None)
    if cut is None:
        cut = next((i for i, t in enumerate(tokens) if _TILE.search(t)), None)
    if not cut or cut >= len(tokens):
        return kernel
    layout = kernel_layout("_".join(tokens[cut:]))
    return "_".join(tokens[:cut]) + "_…" + (f"_{layout}" if layout else "")


# ----------------------------------------------------------------------------- trace parsing


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


def parse_trace(trace: dict | str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(items, ranges) from a torch.profiler Chrome trace.

    ranges: every record_function range (name, ts, end, tid), times in microseconds.
    items:  device kernels / memcpy / memset when the trace has any (dur = device time, t_attr = CPU
            launch time found by correlation id), else CPU operators (dur = self time, t_attr = start).
    """
    events = complete_events(trace)
    ranges = pd.DataFrame(
        [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("tid"))
         for e in events if category(e) == "user_annotation"],
        columns=["name", "ts", "end", "tid"])
    gpu = [e for e in events if category(e) in DEVICE_CATEGORIES]
    if gpu:
        launch_ts = {}
        for e in events:
            if category(e) in LAUNCH_CATEGORIES:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launch_ts[corr] = float(e["ts"])
        rows = []
        for e in gpu:
            args = e.get("args") or {}
            ts = float(e["ts"])
            cat = category(e)
            kind = "kernel" if cat == "kernel" else ("memcpy" if "memcpy" in cat else "memset")
            # a kernel with no launch event (lost by CUPTI) is placed by its own start time
            rows.append((e["name"], kind, ts, float(e["dur"]), launch_ts.get(args.get("correlation"), ts),
                         args.get("stream", e.get("tid")), True))
        items = pd.DataFrame(rows, columns=["name", "kind", "ts", "dur", "t_attr", "lane", "on_timeline"])
        items["device"] = "cuda"
    else:
        ops = pd.DataFrame([(e["name"], float(e["ts"]), float(e["dur"]), e.get("pid"), e.get("tid"))
                            for e in events if category(e) == "cpu_op"],
                           columns=["name", "ts", "dur", "pid", "tid"])
        ops = _cpu_self_times(ops)
        items = pd.DataFrame({"name": ops["name"], "kind": "cpu_op", "ts": ops["ts"], "dur": ops["self_dur"],
                              "t_attr": ops["ts"], "lane": ops["tid"], "on_timeline": ops["on_timeline"],
                              "wall_dur": ops["dur"]})
        items["device"] = "cpu"
    return items, ranges


def containing_instance(ranges: pd.DataFrame, name: str, t: np.ndarray) -> np.ndarray:
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
    instance index of each phase, the phase itself (``phase``: the innermost phase range holding the
    item, "" for none), and the category: by name (``categorize``), then overridden for the items
    inside any range named in ``range_categories`` (none by default)."""
    items = items.copy()
    t = items["t_attr"].to_numpy()
    for name in range_names:
        inst = containing_instance(ranges, name, t)
        items[name] = inst >= 0
        if name == STEP_RANGE:
            items["step_index"] = inst
        elif name in PHASE_RANGES:
            items[f"{name} index"] = inst
    if STEP_RANGE in range_names:
        items = items[items[STEP_RANGE]].copy()
    items["phase"] = ""
    for name in PHASE_RANGES:
        if name in items.columns:
            items.loc[items[name], "phase"] = name
    items["category"] = [categorize(n) for n in items["name"]]
    for rng, cat in (range_categories or {}).items():
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
        rr = rr[containing_instance(ranges, STEP_RANGE, rr["ts"].to_numpy()) >= 0] if name != STEP_RANGE else rr
        rows.append({
            "range": name,
            "instances_per_step": len(rr) / max(n_steps, 1),
            "wall_ms_per_step": (rr["end"] - rr["ts"]).sum() / 1e3 / max(n_steps, 1),
            "kernel_ms_per_step": inside["dur"].sum() / 1e3 / max(n_steps, 1),
            "kernels_per_step": len(inside) / max(n_steps, 1),
            "share_of_step_kernel_time": inside["dur"].sum() / step_kernel if step_kernel > 0 else 0.0,
        })
    return pd.DataFrame(rows)



def profiler_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def export_trace(prof, path: Path) -> None:
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


