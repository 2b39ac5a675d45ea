"""Memory and time of optimizer-state sharding and of FSDP, against torch's FSDP2, in one run.

Two parts, every variant on the same model, data and global batch (split over the ranks):

1. optimizer_state_sharding_accounting (fp32): ``ddp`` (DDPIndividualParameters + our AdamW)
   against ``ddp_sharded`` (the same with ShardedOptimizer(AdamW)). Per variant: peak memory
   after model init, during forward+backward (before the optimizer step) and during the step;
   a breakdown measured from the allocator (parameters, gradients, optimizer state,
   activations) next to the one computed from the parameter count; time per iteration.
2. fsdp_accounting, per precision (fp32; bf16 compute): ``fsdp2`` (torch's ``fully_shard`` per
   Transformer block and on the root) and our ``fsdp`` (systems.parallel.fsdp.FSDP), both
   with torch.optim.AdamW (foreach). Peak memory and step time, and their ratios in the same
   run; then one profiled step of ours whose trace tells, layer by layer, whether each forward
   all-gather finished before its layer started.

Memory comes from ``torch.cuda.max_memory_allocated`` (GPU only; CPU rows carry None). Times are
per step, the slowest rank's, median over steps.

    python -m systems.bench.fsdp                       # 2 GPUs, NCCL, xl, < 6 min on 2xH200
    python -m systems.bench.fsdp --model debug --backend gloo --context-length 64
    torchrun --nproc-per-node 2 -m systems.bench.fsdp  # same, env:// rendezvous
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from systems.config import get_config
from systems.model import TransformerLM
from systems.optim import AdamW, cross_entropy
from systems.measure.devices import median_p10_p90, release_memory
from systems.measure.results import ResultWriter
from systems.parallel.ddp import DDPIndividualParameters
from systems.parallel.fsdp import FSDP
from systems.parallel.launch import (DistContext, add_benchmark_arguments, all_gather_objects, launch, resolve_backend,
                     under_torchrun)
from systems.measure.trace import gpu_annotation_spans
from systems.parallel.sharded_optimizer import ShardedOptimizer

PRECISIONS = ("fp32", "bf16")
FSDP_VARIANTS = ("fsdp2", "fsdp")
UNIT_MARK = "fsdp_unit"  # record_function ranges the benchmark puts around each unit's forward
MiB = 1024 * 1024


@dataclass
class FSDPBenchConfig:
    model: str = "xl"
    context_length: int = 512
    global_batch: int = 4
    precisions: tuple[str, ...] = PRECISIONS
    fsdp_variants: tuple[str, ...] = FSDP_VARIANTS
    prefetch: int = 1
    warmup: int = 2
    steps: int = 5
    profile: bool = True
    attn_impl: str | None = None
    lr: float = 1e-5
    seed: int = 0
    opt_path: str = "results/08_sharding_fsdp_optimizer.jsonl"
    fsdp_path: str = "results/08_sharding_fsdp_fsdp.jsonl"
    gather_path: str = "results/08_sharding_fsdp_gathers.jsonl"
    trace_dir: str = "results/08_sharding_fsdp_traces"

    def __post_init__(self):
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions must be among {PRECISIONS}, got {bad}")
        bad = [v for v in self.fsdp_variants if v not in FSDP_VARIANTS]
        if bad:
            raise ValueError(f"fsdp variants must be among {FSDP_VARIANTS}, got {bad}")
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"need warmup >= 1 (it creates the optimizer state) and steps >= 1, "
                             f"got {self.warmup} and {self.steps}")


# ---- memory helpers ----------------------------------------------------------------------------

class _Mem:
    """Allocator readings on CUDA; None on CPU, where torch keeps no allocator statistics."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def _mib(x):
    return None if x is None else x / MiB


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, ShardedOptimizer):
        return opt.state_bytes()
    # FSDP2's moments are DTensors, whose numel() is the global size: count the local shard
    local = [t.to_local() if hasattr(t, "to_local") else t
             for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in local)


# ---- one variant -------------------------------------------------------------------------------

@dataclass
class _Setup:
    forward: nn.Module
    opt: torch.optim.Optimizer
    finish: object  # callable run after backward
    n_params: int
    wrapper: object = None


def _build(variant: str, model_cfg, ctx: DistContext, cfg: FSDPBenchConfig, precision: str) -> _Setup:
    torch.manual_seed(cfg.seed)
    model = TransformerLM(model_cfg, device=ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = precision == "bf16"
    if variant in ("ddp", "ddp_sharded"):
        ddp = DDPIndividualParameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (ShardedOptimizer(params, AdamW, lr=cfg.lr) if variant == "ddp_sharded" else AdamW(params, lr=cfg.lr))
        return _Setup(ddp, opt, ddp.finish_gradient_synchronization, n_params, ddp)
    if variant == "fsdp":
        fsdp = FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None, prefetch=cfg.prefetch)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=cfg.lr, foreach=True)
        return _Setup(fsdp, opt, fsdp.finish_gradient_synchronization, n_params, fsdp)
    if variant == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)
        return _Setup(model, opt, lambda: None, n_params, None)
    raise ValueError(f"unknown variant {variant!r}")


def _local_param_bytes(s: _Setup) -> int:
    """Parameter bytes this rank holds (FSDP2's DTensors: their local shard)."""
    total = 0
    for p in (s.wrapper or s.forward).parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _step(s: _Setup, tokens, targets) -> None:
    s.opt.zero_grad(set_to_none=True)
    loss = cross_entropy(s.forward(tokens), targets)
    loss.backward()
    s.finish()
    s.opt.step()


def _memory_step(s: _Setup, tokens, targets, mem: _Mem) -> dict:
    """One step with allocator readings between the phases."""
    s.opt.zero_grad(set_to_none=True)
    m0 = mem.now()
    mem.reset_peak()
    loss = cross_entropy(s.forward(tokens), targets)
    m1 = mem.now()
    loss.backward()
    s.finish()
    del loss
    m2 = mem.now()
    peak_fwd_bwd = mem.peak()
    mem.reset_peak()
    s.opt.step()
    m3 = mem.now()
    peak_step = mem.peak()
    out = {"mem_before_fwd": m0, "mem_after_fwd": m1, "mem_after_bwd": m2, "mem_after_step": m3,
           "peak_fwd_bwd": peak_fwd_bwd, "peak_opt_step": peak_step}
    if m0 is not None:
        out.update(activations_measured=m1 - m0, grads_measured=m2 - m0)
    return out


def _timed(s: _Setup, tokens, targets, ctx: DistContext, steps: int) -> list[float]:
    ctx.barrier()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(s, tokens, targets)
        ctx.sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def _summarise(gathered: list[list[float]]) -> dict:
    per_step = [max(rank[i] for rank in gathered) for i in range(min(len(r) for r in gathered))]
    median, p10, p90 = median_p10_p90(per_step)
    return {"step_ms": median, "step_ms_p10": p10, "step_ms_p90": p90, "steps": len(per_step)}


def run_variant(variant: str, precision: str, model_cfg, ctx: DistContext, cfg: FSDPBenchConfig,
                tokens, targets) -> dict:
    mem = _Mem(ctx.device)
    release_memory(ctx.device)
    mem.reset_peak()
    base = mem.now()
    row: dict = {"variant": variant, "precision": precision}
    try:
        s = _build(variant, model_cfg, ctx, cfg, precision)
        row["mem_after_init"] = None if base is None else mem.now() - base
        row["peak_after_init"] = None if base is None else mem.peak() - base
        autocast = torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16,
                                  enabled=precision == "bf16" and variant.startswith("ddp"))
        with autocast:
            for _ in range(cfg.warmup):
                _step(s, tokens, targets)
            row.update({k: (v - base if (v is not None and base is not None and not k.endswith("measured")) else v)
                        for k, v in _memory_step(s, tokens, targets, mem).items()})
            row["opt_state_bytes"] = optimizer_state_bytes(s.opt)
            row["param_bytes_local"] = _local_param_bytes(s)
            samples = _timed(s, tokens, targets, ctx, cfg.steps)
        row["n_params"] = s.n_params
        row.update(_summarise(all_gather_objects(samples)))
        row["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0])
    finally:
        s = None
        release_memory(ctx.device)
    # the ranks' memory differs slightly (ownership): report the largest
    mems = all_gather_objects({k: v for k, v in row.items() if k.startswith(("mem_", "peak_"))})
    for key in mems[0]:
        vals = [m[key] for m in mems if m.get(key) is not None]
        row[key] = max(vals) if vals else None
    return row


# ---- the profiled step: did each forward all-gather finish before its layer? ------------------

def _annotate_units(fsdp: FSDP):
    """record_function ranges around each unit's forward (opened after FSDP's own pre-hook, so
    after the gather wait: the range's first kernel is the layer's first compute kernel)."""
    from torch.profiler import record_function

    handles, open_ranges = [], {}
    for i, unit in enumerate(fsdp.shard_layout()):
        root = fsdp.module.get_submodule(unit["unit"]) if unit["unit"] else fsdp.module

        def pre(module, args, i=i):
            rf = record_function(f"{UNIT_MARK}:{i}")
            rf.__enter__()
            open_ranges[i] = rf

        def post(module, args, output, i=i):
            rf = open_ranges.pop(i, None)
            if rf is not None:
                rf.__exit__(None, None, None)
        handles += [root.register_forward_pre_hook(pre), root.register_forward_hook(post)]
    return handles


def profile_fsdp_step(ctx: DistContext, s: _Setup, tokens, targets, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    handles = _annotate_units(s.wrapper)
    ctx.barrier()
    try:
        if ctx.is_main:
            with profile(activities=activities) as prof:
                with record_function("train_step"):
                    _step(s, tokens, targets)
                ctx.sync()
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        else:
            _step(s, tokens, targets)
    finally:
        for h in handles:
            h.remove()
    ctx.barrier()


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _is_gather(name: str) -> bool:
    n = name.lower()
    return "allgather" in n or "all_gather" in n


def _is_reduce(name: str) -> bool:
    n = name.lower()
    return "reducescatter" in n or "reduce_scatter" in n or n.startswith("gloo:all_reduce")


def trace_timeline(path: str | Path) -> dict:
    """Intervals (ms from the step start) of compute, all-gathers, reduce-scatters, unit ranges.

    GPU: kernels ("nccl" in the name = communication) and the units' GPU annotation ranges. CPU
    (gloo): gloo ranges on its worker threads and aten operators elsewhere.
    """
    events = _events(Path(path))
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    if kernels:
        kind = "gpu"
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [span(e) for e in kernels if "nccl" not in e["name"].lower()]
        annot = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    else:
        kind = "cpu"
        comm = [e for e in events if e["name"].startswith("gloo:")]
        threads = {e.get("tid") for e in comm}
        compute = [span(e) for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
                   and e.get("tid") not in threads]
        annot = [e for e in events if e.get("cat") == "user_annotation"]
    units = sorted((int(e["name"].split(":")[1]), *span(e)) for e in annot if e["name"].startswith(UNIT_MARK + ":"))
    # on GPU the step's range has one annotation per stream (compute and NCCL, whose forward
    # all-gathers it launches): merged into one span, or "step" could be the NCCL stream's alone
    steps = (gpu_annotation_spans(events, "train_step") if kind == "gpu" else
             [span(e) for e in annot if e["name"] == "train_step"]) or \
        [span(e) for e in events if e.get("cat") == "user_annotation" and e["name"] == "train_step"]
    origin = min([s for s, _ in steps] or [s for s, _ in compute] or [0.0])
    ms = lambda iv: [((a - origin) / 1e3, (b - origin) / 1e3) for a, b in iv]  # noqa: E731
    units_by_start = sorted(units, key=lambda u: u[1])
    return {"kind": kind,
            "compute": ms(sorted(compute)),
            "gather": ms(sorted(span(e) for e in comm if _is_gather(e["name"]))),
            "reduce": ms(sorted(span(e) for e in comm if _is_reduce(e["name"]))),
            "units": [(i, (a - origin) / 1e3, (b - origin) / 1e3) for i, a, b in units_by_start],
            "step": ms(steps[:1])[0] if steps else None}


def gather_timing(timeline: dict) -> list[dict]:
    """Per forward unit: when its all-gather ended against when the layer's compute started.

    Forward all-gathers are issued in forward order and the communication stream runs them in
    issue order, so the k-th all-gather that starts before the first reduce-scatter belongs to
    the k-th unit. slack = layer start - gather end (>= 0: the gather was done in time; the
    layer can never start before its gather ends, so ~0 means the compute stream waited); stall =
    how long the compute sat idle before the layer waiting for it."""
    first_reduce = timeline["reduce"][0][0] if timeline["reduce"] else float("inf")
    fwd_gathers = [g for g in timeline["gather"] if g[0] < first_reduce]
    compute = timeline["compute"]
    rows = []
    for k, (unit, start, end) in enumerate(timeline["units"]):
        if k >= len(fwd_gathers):
            break
        g_start, g_end = fwd_gathers[k]
        before = [b for a, b in compute if b <= start + 1e-6]
        prev_end = max(before) if before else start
        stall = max(0.0, min(g_end, start) - prev_end) if g_end > prev_end else 0.0
        rows.append({"unit": unit, "order": k, "gather_start_ms": g_start, "gather_end_ms": g_end,
                     "gather_ms": g_end - g_start, "layer_start_ms": start, "layer_end_ms": end,
                     "slack_ms": start - g_end, "stall_ms": stall,
                     "in_time": g_end <= prev_end + 1e-3})
    return rows


def plot_timeline(ax, timeline: dict, *, title: str = "", window: tuple[float, float] | None = None) -> None:
    """Three lanes (compute, all-gather, reduce-scatter) with the units' forward ranges shaded."""
    lo, hi = window or (timeline["step"] or (0.0, max(b for _, b in timeline["compute"])))
    clip = lambda xs: [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in xs if b > lo and a < hi]  # noqa: E731
    ax.broken_barh(clip(timeline["compute"]), (20, 8), facecolors="tab:blue")
    ax.broken_barh(clip(timeline["gather"]), (10, 8), facecolors="tab:orange")
    ax.broken_barh(clip(timeline["reduce"]), (0, 8), facecolors="tab:green")
    for k, (_, a, b) in enumerate(timeline["units"]):
        if b > lo and a < hi:
            ax.axvspan(max(a, lo), min(b, hi), color="0.85" if k % 2 else "0.93", zorder=0)
    comm = "NCCL" if timeline["kind"] == "gpu" else "gloo"
    ax.set_yticks([4, 14, 24], [f"{comm} reduce-scatter", f"{comm} all-gather", "compute"])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time in step (ms); shaded: one unit's forward each")
    if title:
        ax.set_title(title)


# ---- accounting --------------------------------------------------------------------------------

def computed_breakdown(n_params: int, world_size: int, *, sharded_optimizer: bool,
                       bytes_per_param: int = 4, adam_states: int = 2) -> dict:
    """Bytes per rank from the parameter count: fp32 params and grads, AdamW's two moments."""
    state = adam_states * bytes_per_param * n_params
    return {"params_computed": bytes_per_param * n_params, "grads_computed": bytes_per_param * n_params,
            "opt_state_computed": state / world_size if sharded_optimizer else state}


def communication_per_step(n_params: int, world_size: int, bytes_per_param: int = 4) -> list[dict]:
    """Bytes each rank sends per step (ring algorithms; (N-1)/N of the data per pass).

    - DDP: all-reduce of the gradients = reduce-scatter + all-gather = 2 (N-1)/N * G;
    - ours (DDP + ShardedOptimizer): that all-reduce, then each owner broadcasts its updated
      parameters: every rank receives the (N-1)/N it does not own, so + (N-1)/N * P;
    - ZeRO stage 1: reduce-scatter the gradients (each rank only needs its shard's), update the
      shard, all-gather the parameters: (N-1)/N * G + (N-1)/N * P, the same as DDP.
    - FSDP (ZeRO-3): all-gather in forward, again in backward, reduce-scatter: 3 (N-1)/N * P.
    """
    f = (world_size - 1) / world_size
    g = p = n_params * bytes_per_param
    return [
        {"scheme": "DDP (all-reduce)", "bytes_per_rank": 2 * f * g},
        {"scheme": "ShardedOptimizer (all-reduce + broadcast)", "bytes_per_rank": 2 * f * g + f * p},
        {"scheme": "ZeRO-1 (reduce-scatter + all-gather)", "bytes_per_rank": f * g + f * p},
        {"scheme": "FSDP / ZeRO-3 (2 all-gathers + reduce-scatter)", "bytes_per_rank": 3 * f * p},
    ]


def memory_per_rank(n_params: int, world_size: int, bytes_per_param: int = 4) -> list[dict]:
    """Persistent bytes per rank (no activations): fp32 params, grads, AdamW moments."""
    P = n_params * bytes_per_param
    N = world_size
    return [
        {"scheme": "DDP", "params": P, "grads": P, "opt_state": 2 * P},
        {"scheme": "ShardedOptimizer", "params": P, "grads": P, "opt_state": 2 * P / N},
        {"scheme": "ZeRO-1 (grads freed after reduce-scatter)", "params": P, "grads": P, "opt_state": 2 * P / N},
        {"scheme": "FSDP / ZeRO-3", "params": P / N, "grads": P / N, "opt_state": 2 * P / N},
    ]


# ---- the worker --------------------------------------------------------------------------------

def bench_worker(ctx: DistContext, config: dict) -> dict:
    cfg = FSDPBenchConfig(**config)
    if cfg.global_batch % ctx.world_size:
        raise ValueError(f"global batch {cfg.global_batch} does not split over {ctx.world_size} ranks")
    local = cfg.global_batch // ctx.world_size
    overrides = {"attn_impl": cfg.attn_impl} if cfg.attn_impl else {}
    model_cfg = get_config(cfg.model, **overrides)
    if cfg.context_length > model_cfg.context_length:
        raise ValueError(f"context {cfg.context_length} exceeds the {cfg.model} model's {model_cfg.context_length}")
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in both implementations
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = torch.randint(0, model_cfg.vocab_size, (cfg.global_batch, cfg.context_length + 1), generator=gen)
    shard = data[ctx.rank * local:(ctx.rank + 1) * local].to(ctx.device)
    tokens, targets = shard[:, :-1].contiguous(), shard[:, 1:].contiguous()
    common = {"backend": ctx.backend, "world_size": ctx.world_size, "model": cfg.model,
              "context_length": cfg.context_length, "global_batch": cfg.global_batch, "local_batch": local,
              "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"}
    main = ctx.is_main
    writers = {k: ResultWriter(p) for k, p in (("opt", cfg.opt_path), ("fsdp", cfg.fsdp_path),
                                                ("gather", cfg.gather_path))} if main else {}
    out = {"opt": [], "fsdp": [], "gather": []}

    def emit(kind, row):
        if main:
            out[kind].append(writers[kind].write({**common, **row}))

    # part 1: optimizer state sharding (fp32)
    for variant in ("ddp", "ddp_sharded"):
        row = run_variant(variant, "fp32", model_cfg, ctx, cfg, tokens, targets)
        if row["status"] == "ok":
            comp = computed_breakdown(row["n_params"], ctx.world_size, sharded_optimizer=variant == "ddp_sharded")
            row.update(comp)
            row["predicted_peak_fwd_bwd"] = (comp["params_computed"] + comp["opt_state_computed"]
                                             + (row.get("activations_measured") or 0)
                                             + comp["grads_computed"]) if row.get("peak_fwd_bwd") else None
        emit("opt", row)
        if main:
            print(f"[opt] {variant:>12}: {row.get('step_ms', float('nan')):8.1f} ms/step, peak "
                  f"{_mib(row.get('peak_fwd_bwd')) or float('nan'):,.0f} MiB ({row['status']})", flush=True)

    # part 2: FSDP against FSDP2
    for precision in cfg.precisions:
        for variant in cfg.fsdp_variants:
            try:
                row = run_variant(variant, precision, model_cfg, ctx, cfg, tokens, targets)
            except Exception as exc:  # FSDP2 may be missing or refuse a backend: record, go on
                if variant != "fsdp2":
                    raise
                row = {"variant": variant, "precision": precision, "status": "error",
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
            row["prefetch"] = cfg.prefetch if variant == "fsdp" else None
            emit("fsdp", row)
            if main:
                print(f"[{precision}] {variant:>6}: {row.get('step_ms', float('nan')):8.1f} ms/step, peak "
                      f"{_mib(row.get('peak_fwd_bwd')) or float('nan'):,.0f} MiB ({row['status']})", flush=True)
        if cfg.profile and "fsdp" in cfg.fsdp_variants:
            s = _build("fsdp", model_cfg, ctx, cfg, precision)
            for _ in range(cfg.warmup):
                _step(s, tokens, targets)
            path = Path(cfg.trace_dir) / f"fsdp_{precision}_rank0.json"
            profile_fsdp_step(ctx, s, tokens, targets, path)
            s = None
            release_memory(ctx.device)
            if main:
                timeline = trace_timeline(path)
                for r in gather_timing(timeline):
                    emit("gather", {"precision": precision, "trace": str(path), **r})
                rows = [r for r in out["gather"] if r["precision"] == precision]
                late = sum(not r["in_time"] for r in rows)
                print(f"[{precision}] profiled fsdp: {len(rows) - late}/{len(rows)} forward gathers in time",
                      flush=True)
    return out if main else {}


def run_fsdp_benchmark(config: FSDPBenchConfig, *, world_size: int = 2, backend: str = "auto",
                       timeout_s: float = 600.0) -> dict:
    return launch(bench_worker, world_size, backend, args=(asdict(config),), timeout_s=timeout_s)[0]


def main(argv: list[str] | None = None) -> int:
    d = FSDPBenchConfig()
    parser = argparse.ArgumentParser(prog="python -m systems.bench.fsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_benchmark_arguments(parser, d, precisions=PRECISIONS)
    parser.add_argument("--fsdp-variants", nargs="+", default=list(d.fsdp_variants), choices=FSDP_VARIANTS)
    parser.add_argument("--prefetch", type=int, default=d.prefetch, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    config = FSDPBenchConfig(
        model=args.model, context_length=args.context_length, global_batch=args.global_batch,
        precisions=tuple(args.precisions), fsdp_variants=tuple(args.fsdp_variants), prefetch=args.prefetch,
        warmup=args.warmup, steps=args.steps, profile=not args.no_profile, attn_impl=args.attn_impl,
        opt_path=str(out / "08_sharding_fsdp_optimizer.jsonl"), fsdp_path=str(out / "08_sharding_fsdp_fsdp.jsonl"),
        gather_path=str(out / "08_sharding_fsdp_gathers.jsonl"), trace_dir=str(out / "08_sharding_fsdp_traces"))
    start = time.perf_counter()
    if under_torchrun():
        print(f"torchrun rank: backend {resolve_backend(args.backend)}", flush=True)
    run_fsdp_benchmark(config, world_size=args.world_size, backend=args.backend, timeout_s=args.timeout_s)
    print(f"done in {time.perf_counter() - start:.0f} s; rows in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
