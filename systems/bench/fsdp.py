"""Memory and time of optimizer-state sharding and of FSDP, against torch's FSDP2, in one run.

Two parts, every variant on the same model, data and global batch (split over the ranks):

1. optimizer_state_sharding_accounting (fp32): ``ddp`` (DDPIndividualParameters + torch AdamW)
   against ``ddp_sharded`` (the same with ShardedOptimizer(AdamW)). Per variant: peak memory
   after model init, during forward+backward (before the optimizer step) and during the step;
   a breakdown measured from the allocator (parameters, gradients, optimizer state, the
   optimizer step's temporaries, activations), which ``systems.analysis.sharding`` computes from
   the parameter count; time per iteration.
2. fsdp_accounting, per precision (fp32; bf16 compute): ``fsdp2`` (torch's ``fully_shard`` per
   Transformer block and on the root) and our ``fsdp`` (systems.parallel.fsdp.FSDP). Peak memory
   and step time, and their ratios in the same run; then one profiled step of ours whose trace
   tells, layer by layer, whether each forward all-gather finished before its layer started.

Every variant is a ``ParallelPlan`` applied to a fresh model, trained by the one training step
(``systems.train.TrainStep``) with one optimizer, torch's AdamW (foreach), wrapped in
``ShardedOptimizer`` for ``ddp_sharded``: so the memory each variant saves is the sharding's,
not a difference between optimizers' temporaries.

Memory comes from the allocator, read at the step's phase marks (``Marks(track_memory=True)``:
bytes allocated and the high-water mark per phase; GPU only, CPU rows carry None). Times are per
step, the slowest rank's, median over steps.

    python -m systems.bench.fsdp                       # 2 GPUs, NCCL, 2025's xl (rows in build/fsdp)
    python -m systems.bench.fsdp --model debug --backend gloo --context-length 64
    torchrun --nproc-per-node 2 -m systems.bench.fsdp  # same, env:// rendezvous
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from systems.bench.config import RunConfig, add_distributed_arguments, check_launch, run_cli
from systems.measure.devices import catch_oom, release_memory
from systems.measure.profiler import export_trace, profiler_activities
from systems.measure.results import ResultWriter
from systems.measure.timer import Marks, slowest_rank_median
from systems.measure.trace import STEP_RANGE, collective_timeline
from systems.model import TransformerLM
from systems.parallel.fsdp import FSDP
from systems.parallel.launch import (DistContext, DistributedRunError, all_gather_objects, launch, resolve_backend,
                                    spawn, under_torchrun)
from systems.parallel.plan import ParallelPlan, Parallelized, apply
from systems.parallel.sharded_optimizer import ShardedOptimizer
from systems.train import OptimizerSpec, StepSpec, TrainStep, build_optimizer

PRECISIONS = ("fp32", "bf16")
OPT_VARIANTS = ("ddp", "ddp_sharded")
FSDP_VARIANTS = ("fsdp2", "fsdp")
UNIT_MARK = "fsdp_unit"  # record_function ranges the benchmark puts around each unit's forward
MiB = 1024 * 1024


@dataclass
class FSDPBenchConfig(RunConfig):
    model: str = "xl-2025"
    batch_size: int = 4  # the global batch
    warmup: int = 2  # >= 1: the first step creates the optimizer state
    steps: int = 5
    precisions: tuple[str, ...] = PRECISIONS
    opt_variants: tuple[str, ...] = OPT_VARIANTS  # part 1, in fp32
    fsdp_variants: tuple[str, ...] = FSDP_VARIANTS
    prefetch: int = 1
    profile: bool = True
    lr: float = 1e-5
    append: bool = False  # add rows below those already in the files (another model's run)
    opt_path: str = "build/fsdp/08_sharding_fsdp_optimizer.jsonl"
    fsdp_path: str = "build/fsdp/08_sharding_fsdp_fsdp.jsonl"
    gather_path: str = "build/fsdp/08_sharding_fsdp_gathers.jsonl"
    trace_dir: str = "build/fsdp/08_sharding_fsdp_traces"

    def __post_init__(self):
        if not self.precisions:
            raise ValueError(f"nothing to run: name at least one precision (--precisions {' '.join(PRECISIONS)})")
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions must be among {PRECISIONS}, got {bad}")
        bad = [v for v in self.fsdp_variants if v not in FSDP_VARIANTS]
        if bad:
            raise ValueError(f"fsdp variants must be among {FSDP_VARIANTS}, got {bad}")
        bad = [v for v in self.opt_variants if v not in OPT_VARIANTS]
        if bad:
            raise ValueError(f"optimizer-sharding variants must be among {OPT_VARIANTS}, got {bad}")
        if self.warmup < 1:
            raise ValueError(f"need warmup >= 1 (it creates the optimizer state), got {self.warmup}")
        super().__post_init__()


def variant_plan(variant: str, precision: str, *, prefetch: int) -> ParallelPlan:
    """ddp / ddp_sharded: our overlapped per-parameter DDP (autocast does the bf16); fsdp / fsdp2:
    sharded, computing in bf16 themselves when the precision is bf16."""
    if variant in ("ddp", "ddp_sharded"):
        return ParallelPlan(data_parallel="overlap")
    dtype = "bf16" if precision == "bf16" else None
    if variant == "fsdp":
        return ParallelPlan(data_parallel="fsdp", param_dtype=dtype, prefetch=prefetch)
    if variant == "fsdp2":
        return ParallelPlan(data_parallel="fsdp2", param_dtype=dtype)
    raise ValueError(f"unknown variant {variant!r}; choose one of ddp, ddp_sharded, {', '.join(FSDP_VARIANTS)}")


def _mib(x):
    return None if x is None else x / MiB


def _peak_text(row: dict) -> str:
    """The progress line's peak: the step's highest, forward + backward or optimizer step, and
    which it was; unknown on a CPU (no allocator statistics)."""
    peaks = {phase: row[key] for phase, key in (("forward + backward", "peak_fwd_bwd"), ("optimizer step", "peak_opt_step"))
             if row.get(key) is not None}
    if not peaks:
        return "peak n/a"
    phase = max(peaks, key=peaks.get)
    return f"peak {_mib(peaks[phase]):,.0f} MiB (in the {phase})"


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
    par: Parallelized
    opt: torch.optim.Optimizer
    step: TrainStep
    n_params: int


def _build(variant: str, model_cfg, ctx: DistContext, cfg: FSDPBenchConfig, precision: str) -> _Setup:
    torch.manual_seed(cfg.seed)
    model = TransformerLM(model_cfg, device=ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    # the DDP variants compute in bf16 by autocast; FSDP and FSDP2 cast their gathered weights themselves
    spec = StepSpec(precision=precision if variant.startswith("ddp") else "fp32")
    par = apply(model, variant_plan(variant, precision, prefetch=cfg.prefetch), loss=spec.loss)
    opt = build_optimizer(par.params_owner, OptimizerSpec(kind="torch", lr=cfg.lr, sharded=variant == "ddp_sharded"))
    step = TrainStep(model, spec=spec, optimizer=opt, forward=par.forward, grad_sync=par.grad_sync)
    return _Setup(par, opt, step, n_params)


def _local_param_bytes(s: _Setup) -> int:
    """Parameter bytes this rank holds (FSDP2's DTensors: their local shard)."""
    total = 0
    for p in s.par.params_owner.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _memory_step(s: _Setup, tokens, targets, device: torch.device) -> dict:
    """One step with the allocator read at its phase marks (None on a CPU)."""
    s.opt.zero_grad(set_to_none=True)  # before "start": the step's own zero_grad then frees nothing
    marks = Marks(device, track_memory=True)
    s.step(tokens, targets, marks=marks)
    if not marks.track_memory:
        return {k: None for k in ("mem_before_fwd", "mem_after_fwd", "mem_after_bwd", "mem_after_step",
                                  "peak_fwd_bwd", "peak_opt_step", "activations_measured", "grads_measured",
                                  "opt_temporaries_measured")}
    synced = "grad_sync" if "grad_sync" in marks else "backward"
    m0, m1 = marks.allocated_bytes("start"), marks.allocated_bytes("forward")
    m2 = marks.allocated_bytes(synced)
    return {"mem_before_fwd": m0, "mem_after_fwd": m1, "mem_after_bwd": m2,
            "mem_after_step": marks.allocated_bytes("optimizer"),
            "peak_fwd_bwd": max(marks.peak_bytes(n) for n in ("forward", "backward", synced)),
            "peak_opt_step": marks.peak_bytes("optimizer"),
            "activations_measured": m1 - m0, "grads_measured": m2 - m0,
            # what the step allocates beyond what it starts with: the update's temporaries
            "opt_temporaries_measured": marks.peak_bytes("optimizer") - m2}


def _timed(s: _Setup, tokens, targets, ctx: DistContext, steps: int) -> list[float]:
    ctx.barrier()
    samples = []
    for _ in range(steps):
        # wall time, synchronised: a step ends when this rank's device work has
        wall = Marks(ctx.device, clock="host")
        wall.mark("start")
        s.step(tokens, targets)
        ctx.sync()
        wall.mark("end")
        samples.append(wall.ms("start", "end"))
    return samples


def _summarise(gathered: list[list[float]]) -> dict:
    median, p10, p90 = slowest_rank_median(gathered)
    return {"step_ms": median, "step_ms_p10": p10, "step_ms_p90": p90, "steps": min(len(r) for r in gathered)}


def run_variant(variant: str, precision: str, model_cfg, ctx: DistContext, cfg: FSDPBenchConfig,
                tokens, targets) -> dict:
    release_memory(ctx.device)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device) if cuda else None
    row: dict = {"variant": variant, "precision": precision}
    s = None
    with catch_oom() as oom:
        s = _build(variant, model_cfg, ctx, cfg, precision)
        row["mem_after_init"] = torch.cuda.memory_allocated(ctx.device) - base if cuda else None
        row["peak_after_init"] = torch.cuda.max_memory_allocated(ctx.device) - base if cuda else None
        for _ in range(cfg.warmup):
            s.step(tokens, targets)
        row.update({k: (v - base if (v is not None and base is not None and not k.endswith("measured")) else v)
                    for k, v in _memory_step(s, tokens, targets, ctx.device).items()})
        row["opt_state_bytes"] = optimizer_state_bytes(s.opt)
        row["param_bytes_local"] = _local_param_bytes(s)
        if isinstance(s.par.wrapper, FSDP):  # the largest gathered unit, in the dtype it is gathered in
            size = torch.finfo(s.par.wrapper.compute_dtype or torch.float32).bits // 8
            row["gathered_unit_bytes"] = max(u["padded"] for u in s.par.wrapper.shard_layout()) * size
        samples = _timed(s, tokens, targets, ctx, cfg.steps)
        row["n_params"] = s.n_params
    if oom:
        row.update(status="oom", error=oom.message)
    else:
        row.update(_summarise(all_gather_objects(samples)))
        row["status"] = "ok"
    if s is not None:
        s.par.remove()
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
    from torch.profiler import profile

    handles = _annotate_units(s.par.wrapper)
    ctx.barrier()
    try:
        if ctx.is_main:
            with profile(activities=profiler_activities(ctx.device)) as prof:
                s.step(tokens, targets)
                ctx.sync()
            export_trace(prof, path)
        else:
            s.step(tokens, targets)
    finally:
        for h in handles:
            h.remove()
    ctx.barrier()


def trace_timeline(path: str | Path) -> dict:
    """Intervals (ms from the step start) of compute, all-gathers, reduce-scatters and unit ranges."""
    return collective_timeline(path, step_range=STEP_RANGE, unit_prefix=UNIT_MARK)


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


# ---- the worker --------------------------------------------------------------------------------

def bench_worker(ctx: DistContext, config: dict) -> dict:
    cfg = FSDPBenchConfig(**config)
    cfg.check_world_size(ctx.world_size)
    local = cfg.batch_size // ctx.world_size
    model_cfg = cfg.model_config()
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in both implementations
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.context_length + 1), generator=gen)
    shard = data[ctx.rank * local:(ctx.rank + 1) * local].to(ctx.device)
    tokens, targets = shard[:, :-1].contiguous(), shard[:, 1:].contiguous()
    common = {"backend": ctx.backend, "world_size": ctx.world_size, "model": cfg.model, "n_params": model_cfg.n_params,
              "context_length": cfg.context_length, "global_batch": cfg.batch_size, "local_batch": local,
              "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"}
    main = ctx.is_main
    if main:  # a large model takes a while to build, more so on a CPU
        print(f"{cfg.model}: {model_cfg.n_params / 1e9:.3g}B parameters on {ctx.world_size} ranks ({ctx.backend})",
              flush=True)
    writers = {k: ResultWriter(p, overwrite=not cfg.append) for k, p in (
        ("opt", cfg.opt_path), ("fsdp", cfg.fsdp_path), ("gather", cfg.gather_path))} if main else {}
    out = {"opt": [], "fsdp": [], "gather": []}

    def emit(kind, row):
        if main:
            out[kind].append(writers[kind].write({**common, **row}))

    # part 1: optimizer state sharding (fp32)
    for variant in cfg.opt_variants:
        row = run_variant(variant, "fp32", model_cfg, ctx, cfg, tokens, targets)
        emit("opt", row)
        if main:
            print(f"[opt] {variant:>12}: {row.get('step_ms', float('nan')):8.1f} ms/step, "
                  f"{_peak_text(row)} ({row['status']})", flush=True)

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
                print(f"[{precision}] {variant:>6}: {row.get('step_ms', float('nan')):8.1f} ms/step, "
                      f"{_peak_text(row)} ({row['status']})", flush=True)
        if cfg.profile and "fsdp" in cfg.fsdp_variants:
            s = _build("fsdp", model_cfg, ctx, cfg, precision)
            for _ in range(cfg.warmup):
                s.step(tokens, targets)
            path = Path(cfg.trace_dir) / f"fsdp_{precision}_rank0.json"
            profile_fsdp_step(ctx, s, tokens, targets, path)
            s.par.remove()
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
    config.check_world_size(world_size)
    return launch(bench_worker, world_size, backend, args=(asdict(config),), timeout_s=timeout_s)[0]


def notebook_config(*, profile: str, handout: str) -> FSDPBenchConfig:
    """Notebook 08's benchmark: the handout's xl (2025: xl-2025; 2026: the 2.7B preset) on 2
    ranks, context 512, global batch 4; the debug model on gloo for the smoke profile."""
    from systems.config import preset_of

    if profile == "smoke":
        return FSDPBenchConfig(model="debug", context_length=64, batch_size=4, warmup=1, steps=3)
    # ten timed steps, for a steadier median: five bf16 steps spread over a quarter of their
    # median on one 2x H200 lease (docs/training_step_notes.md, entry 31)
    return FSDPBenchConfig(model=preset_of("xl", handout), context_length=512, batch_size=4, warmup=2, steps=10)


def large_model_configs(config: FSDPBenchConfig, *, model: str) -> list[FSDPBenchConfig]:
    """The same benchmark for a model that may not fit, as two runs of one variant each: our FSDP
    computing in bf16 first (the one expected to fit), then optimizer-state sharding in fp32; one
    warm-up and three timed steps, no profile, rows appended to ``config``'s files (their
    ``model`` column tells them apart). Separate runs, so that one that hangs on an out-of-memory
    striking the ranks at different points cannot take the other's rows with it."""
    if model == config.model:
        raise ValueError(f"the large model must differ from the benchmark's own ({config.model!r}): rows are told apart by it")
    common = dict(model=model, precisions=("bf16",), warmup=1, steps=3, profile=False, append=True)
    return [replace(config, opt_variants=(), fsdp_variants=("fsdp",), **common),
            replace(config, opt_variants=("ddp_sharded",), fsdp_variants=(), **common)]


def attempt(config: FSDPBenchConfig, *, world_size: int = 2, backend: str = "auto", deadline_s: float = 150.0) -> dict:
    """``run_fsdp_benchmark`` that turns a failed or overlong run into a row ("error", with the
    first line of the error) in ``config.fsdp_path`` instead of an exception: for a model whose
    out-of-memory might not strike every rank at the same point (then a collective hangs until
    the deadline)."""
    try:
        return launch(bench_worker, world_size, backend, args=(asdict(config),), timeout_s=deadline_s,
                      deadline_s=deadline_s)[0]
    except DistributedRunError as exc:
        row = {"model": config.model, "variant": ",".join((*config.opt_variants, *config.fsdp_variants)),
               "status": "error", "error": str(exc).splitlines()[0][:300]}
        ResultWriter(config.fsdp_path, overwrite=False).write(row)
        return {"fsdp": [row]}


def _check_worker(ctx: DistContext, steps: int) -> dict:
    """ShardedOptimizer(AdamW) against AdamW on the same gradients (every rank computes the full
    batch's), and FSDP on half batches against one process on the whole batch; max differences."""
    from systems.config import get_config
    from systems.optim import cross_entropy

    cfg = get_config("debug", d_model=32, d_ff=64, n_heads=2, n_layers=2, vocab_size=97)
    batches = [torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(100 + i))
               for i in range(steps)]

    def train(kind: str) -> dict:
        torch.manual_seed(0)
        model = TransformerLM(cfg)
        owner = FSDP(model) if kind == "fsdp" else model
        params = list(owner.parameters())
        opt = (ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3) if kind == "sharded"
               else torch.optim.AdamW(params, lr=1e-3))
        rows = slice(ctx.rank * 4, (ctx.rank + 1) * 4) if kind == "fsdp" else slice(None)
        for data in batches:
            opt.zero_grad(set_to_none=True)
            cross_entropy(owner(data[rows, :-1]), data[rows, 1:]).backward()
            if kind == "fsdp":
                owner.finish_gradient_synchronization()
            opt.step()
        if kind == "fsdp":
            full = owner.gather_full_params()
            owner.remove_hooks()
            return full
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    reference = train("single")
    out = {"rank": ctx.rank, "steps": steps, "n_params": sum(w.numel() for w in reference.values()),
           "max_weight": max(w.abs().max().item() for w in reference.values())}
    for kind in ("sharded", "fsdp"):
        trained = train(kind)
        out[f"{kind}_max_abs_diff"] = max((trained[n] - w).abs().max().item() for n, w in reference.items())
        out[f"{kind}_bit_equal"] = all(torch.equal(trained[n], w) for n, w in reference.items())
    return out


def check_against_unsharded(out_path: str | Path, *, world_size: int = 2, steps: int = 3) -> list[dict]:
    """optimizer_state_sharding and fsdp as the handout checks them, on 2 gloo ranks: one row per
    rank with the largest weight difference from unsharded training after ``steps`` AdamW steps.
    ShardedOptimizer only moves who updates each parameter, so it must be bit-equal; FSDP sums
    the half batches' gradients in another order, so it agrees to rounding."""
    rows = spawn(_check_worker, world_size, "gloo", args=(steps,), timeout_s=120)
    writer = ResultWriter(out_path)
    return [writer.write(r) for r in rows]


def main(argv: list[str] | None = None) -> int:
    d = FSDPBenchConfig()
    parser = argparse.ArgumentParser(prog="python -m systems.bench.fsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_distributed_arguments(parser, d, precisions=PRECISIONS, tool="fsdp")
    parser.add_argument("--fsdp-variants", nargs="+", default=list(d.fsdp_variants), choices=FSDP_VARIANTS)
    parser.add_argument("--prefetch", type=int, default=d.prefetch, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    try:
        config = FSDPBenchConfig(
            model=args.model, context_length=args.context_length, batch_size=args.batch_size,
            precisions=tuple(args.precisions), fsdp_variants=tuple(args.fsdp_variants), prefetch=args.prefetch,
            warmup=args.warmup, steps=args.steps, profile=not args.no_profile, attn_impl=args.attn_impl,
            opt_path=str(out / "08_sharding_fsdp_optimizer.jsonl"), fsdp_path=str(out / "08_sharding_fsdp_fsdp.jsonl"),
            gather_path=str(out / "08_sharding_fsdp_gathers.jsonl"), trace_dir=str(out / "08_sharding_fsdp_traces"))
        # the batch must split over the ranks the run will have (torchrun's, where it started us)
        config.check_world_size(check_launch(world_size=args.world_size, backend=args.backend,
                                             timeout_s=args.timeout_s))
    except ValueError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    if under_torchrun():
        print(f"torchrun rank: backend {resolve_backend(args.backend)}", flush=True)
    run_fsdp_benchmark(config, world_size=args.world_size, backend=args.backend, timeout_s=args.timeout_s)
    print(f"done in {time.perf_counter() - start:.0f} s; rows in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
