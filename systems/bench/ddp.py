"""Benchmark the DDP variants against torch's DistributedDataParallel in one run.

Per precision (fp32; bf16 autocast with fp32 master weights) and variant, every rank trains the
same model on its share of the global batch with our AdamW, through the one training step
(``systems.train.TrainStep``), each variant a ``ParallelPlan`` applied to the shared model.
Variants, timed in this order:

- ``nosync``: no gradient communication at all, the computation-only baseline;
- ``naive``, ``flat``, ``overlap`` (per-parameter async), ``bucketed:<MiB>``;
- ``bucketed_tail:<MiB>/<last MiB>`` (only when asked for): bucketed, with the last bucket (the
  first parameters, reduced after backward ends) capped separately;
- ``bucketed_lp:<MiB>`` (only when asked for): bucketed, all-reducing the gradients in bf16;
- ``bucketed_update`` (the master-weights setting only): one bucket per transformer block (the
  groups of a ``GroupedOptimizer``), each block's update run as soon as its gradients are
  averaged, so the last all-reduces overlap the first blocks' updates; ``bucketed_update:<N>``
  also plans the backward's cuBLASLt matmuls for N fewer SMs (``StepSpec(sm_carveout=N)``): a
  trace showed some of the backward's matmuls taking twice as long beside NCCL's thread blocks,
  and N SMs left to NCCL were to keep them in one wave (measured: no gain, training-step notes
  entry 8);
- ``peer_update`` (the master-weights setting only): no all-reduce; as soon as the backward has
  produced a block's gradients, the copy engines copy them into the other ranks' memory, and each
  block's update sums and averages the received gradients in its own pass
  (``systems.parallel.peer.DDPPeer``): no SM moves or reduces a gradient; ``peer_update:<N>``
  spreads the copies over N side streams, which may run on several copy engines at once;
  ``peer_update:graphs`` replays each block's copies as one CUDA graph (one host call instead of
  one per gradient, for the default compile mode, whose backward waits on the host);
  ``peer_update:read`` (2 GPUs) makes no copies: each update reads the other rank's gradients over
  NVLink where autograd put them (``DDPPeer(read_peers=True)``);
- ``torch_ddp``: torch.nn.parallel.DistributedDataParallel with its defaults, its own block last
  (after the paired rounds, which take the fastest of ours once all of ours are timed).

Per step (max over ranks, median over steps): wall time, and with device events the time from the
end of backward to the end of ``finish_gradient_synchronization()`` (the wait for communication
left after backward). Communication overhead = step time - the nosync step time of the same
precision, the cost of communicating whatever is or is not overlapped; it is the one measure
that also applies to torch DDP, whose waiting happens inside backward.

``paired_rounds`` then times, in the master-weights setting and before torch DDP's own block,
rounds that alternate nosync, the fastest of our variants and, when the setting lists it, torch
DDP (ABC then CBA, each a fresh warm-up and ``steps`` steps): a machine whose speed drifts between
two variants' blocks of steps moves their difference by more than a few percent (notebook 07 once
timed nosync 3-5 ms slower than four other runs of the same code; in the default compile mode
no-sync blocks of one run spread over nearly 40%), and within a round it moves all alike. One row per
round in ``paired_path``, with the overhead over no sync and the step over torch DDP's, each
within the round. (torch DDP's hooks on the parameters are inert outside its own forward and go
with it when the round deletes it.)

Then naive, overlap and the fastest of our variants are profiled (torch.profiler, rank 0) and the
traces analysed for overlap (systems.measure.trace).

``master_weights`` adds one more setting, last (it converts the model): bf16 (with compiled
blocks when bf16 is among ``compiled_precisions``), the matmul weights held in bf16 by the model
and their fp32 masters in ``MasterWeightAdamW``, one per block (``OptimizerSpec(kind="fused",
master_weights=True, grouped=True)``), as the fast single-GPU step does. The gradients are then bf16 from the backward on: the buckets all-reduce
half the bytes of fp32 gradients with no conversion on either side, and the update reads the
averaged bf16 gradient. Its variants are ``master_variants``.

Each (precision, compiled) pair is one *setting*. ``compiled_precisions`` adds settings that run
after the eager ones with every Transformer block compiled (``torch.compile`` per block, applied
from outside the model; the DDP wrappers' hooks live on the parameters, outside the compiled
graphs). It exists because the eager bf16 xl step is host-bound: the GPU idles between kernels
while Python launches them, communication kernels fill those gaps, and the trace counts them as
exposed although computation was not waiting for them. Compiled blocks launch a few fused kernels
per block, so the step becomes GPU-bound and overlap is measured on a busy GPU.

    python -m systems.bench.ddp                  # 2 GPUs, NCCL, 2025's xl (xl-2025), rows in build/ddp
    python -m systems.bench.ddp --model debug --context-length 128 --backend gloo
    torchrun --nproc-per-node 2 -m systems.bench.ddp   # same, env:// rendezvous
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from systems.bench.budget import SKIPPED, Budget
from systems.bench.config import RunConfig, add_distributed_arguments, check_launch, run_cli
from systems.measure.devices import catch_oom, release_memory
from systems.measure.profiler import export_trace, profiler_activities
from systems.measure.results import ResultWriter
from systems.measure.timer import Marks, slowest_rank_median
from systems.measure.trace import comm_compute_intervals, overlap_stats
from systems.model import TransformerLM
from systems.parallel.compile import apply_compile
from systems.parallel.launch import DistContext, all_gather_objects, launch, resolve_backend, under_torchrun
from systems.parallel.peer import read_peers_refusal
from systems.parallel.plan import ParallelPlan, Parallelized, apply
from systems.train import OptimizerSpec, StepSpec, TrainStep, build_optimizer

PRECISIONS = ("fp32", "bf16")
VARIANT_KINDS = ("nosync", "naive", "flat", "overlap", "bucketed", "bucketed_tail", "bucketed_lp", "bucketed_update",
                 "peer_update", "torch_ddp")
# variants that update the master-weights setting's grouped optimizer themselves
GROUPED_KINDS = ("bucketed_update", "peer_update")
MASTER_SETTING = "bf16-master"
HANDOUT_BUCKETS_MB = (1.0, 10.0, 100.0, 1000.0)
NEEDS_TWO_GPUS = "not run (needs exactly 2 GPUs)"  # peer_update:read maps the one other GPU's memory


@dataclass
class DDPBenchConfig(RunConfig):
    model: str = "xl-2025"
    batch_size: int = 4  # the global batch
    warmup: int = 3
    precisions: tuple[str, ...] = PRECISIONS
    # precisions run again, after the eager settings, with every block compiled
    compiled_precisions: tuple[str, ...] = ()
    compile_mode: str | None = None  # torch.compile's mode for the compiled settings
    bucket_sizes_mb: tuple[float, ...] = HANDOUT_BUCKETS_MB
    # bucketed variants that all-reduce in bf16 ("bucketed_lp:<MiB>"): half the bytes of fp32 gradients
    lp_reduce_buckets_mb: tuple[float, ...] = ()
    # bucketed variants whose last bucket has its own, smaller cap ("bucketed_tail:<MiB>/<last MiB>")
    tail_buckets_mb: tuple[tuple[float, float], ...] = ()
    include_torch_ddp: bool = True
    # after the other settings: bf16 with bf16 weights and fp32 masters (module docstring)
    master_weights: bool = False
    master_variants: tuple[str, ...] = ("nosync", "overlap", "bucketed:100", "bucketed_update", "peer_update",
                                        "peer_update:read", "torch_ddp")
    profile: bool = True
    profile_steps: int = 2
    tf32: bool = False
    lr: float = 1e-5
    # wall-clock seconds for the timed and profiled variants; a variant that would run past it is
    # recorded as "skipped (budget)" instead (None: no limit)
    budget_s: float | None = None
    # after the master-weights setting's variants (before torch DDP's own block): rounds alternating no sync,
    # the fastest of ours and torch DDP (when listed), each a fresh warm-up and `steps` timed steps,
    # so that the overhead is taken within a round, not between two variants timed minutes apart
    # (0: none)
    paired_rounds: int = 0
    out_path: str = "build/ddp/07_distributed_ddp.jsonl"
    overlap_path: str = "build/ddp/07_distributed_overlap.jsonl"
    paired_path: str = "build/ddp/07_distributed_paired.jsonl"
    trace_dir: str = "build/ddp/07_distributed_traces"
    variants: tuple[str, ...] = field(default=())  # filled from the options above when empty

    def __post_init__(self):
        bad = [p for p in (*self.precisions, *self.compiled_precisions) if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precisions must be among {PRECISIONS}, got {bad}")
        if not (self.precisions or self.compiled_precisions):
            raise ValueError("nothing to run: name eager precisions (--precisions) or compiled ones "
                             "(--compiled-precisions), or both")
        if any(not b > 0 for b in self.bucket_sizes_mb):
            raise ValueError(f"bucket sizes must be positive MiB values, got {self.bucket_sizes_mb}")
        if self.warmup < 1:
            raise ValueError(f"need warmup >= 1, got {self.warmup}")
        if not (isinstance(self.paired_rounds, int) and self.paired_rounds >= 0):
            raise ValueError(f"paired_rounds counts rounds, got {self.paired_rounds!r}; use 0 for none")
        if self.paired_rounds and not (self.master_weights and "nosync" in self.master_variants):
            raise ValueError("paired_rounds alternate the master-weights setting's nosync with its fastest variant: "
                             "set master_weights=True and keep nosync among master_variants")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"budget_s must be positive seconds or None, got {self.budget_s!r}")
        if not self.variants:
            names = ["nosync", "naive", "flat", "overlap", *[f"bucketed:{b:g}" for b in self.bucket_sizes_mb],
                     *[f"bucketed_tail:{b:g}/{t:g}" for b, t in self.tail_buckets_mb],
                     *[f"bucketed_lp:{b:g}" for b in self.lp_reduce_buckets_mb]]
            self.variants = tuple(names + (["torch_ddp"] if self.include_torch_ddp else []))
        for what, variants in (("variants", self.variants), ("master_variants", self.master_variants)):
            unknown = [v for v in variants if v.split(":")[0] not in VARIANT_KINDS]
            if unknown:
                raise ValueError(f"unknown {what} {unknown}")
        for v in (*self.variants, *self.master_variants):  # a malformed argument fails here, before any rank starts
            variant_plan(v)
        grouped = sorted({v.split(":")[0] for v in self.variants} & set(GROUPED_KINDS))
        if grouped:
            raise ValueError(f"{', '.join(grouped)} update the blocks of the master-weights setting's grouped "
                             "optimizer: list them in master_variants (with master_weights=True)")
        if self.master_weights and "bucketed_lp" in {v.split(":")[0] for v in self.master_variants}:
            raise ValueError("bucketed_lp converts fp32 gradients to bf16; the master-weights setting's gradients "
                             "are bf16 already: use bucketed")
        if self.compile_mode is not None and not self.compiled_precisions:
            raise ValueError("compile_mode applies to the compiled settings: set compiled_precisions too")
        for variants in (self.variants, self.master_variants):
            if "torch_ddp" in variants and variants[-1] != "torch_ddp":
                raise ValueError("torch_ddp must be the last variant (the paired rounds run at its place, "
                                 "after every variant of ours is timed)")
        super().__post_init__()

    def settings(self) -> list[tuple[str, bool, bool]]:
        """(precision, compiled, master weights) in run order: eager first, since compiling cannot
        be undone cheaply, and the master-weights setting last, since it converts the model."""
        return ([(p, False, False) for p in self.precisions] + [(p, True, False) for p in self.compiled_precisions]
                + ([("bf16", "bf16" in self.compiled_precisions, True)] if self.master_weights else []))


def parse_tail_variant(arg: str) -> tuple[float, float]:
    """"1000/1" -> (1000.0, 1.0): the bucket cap and the last bucket's cap, in MiB."""
    cap, sep, last = arg.partition("/")
    if not sep:
        raise ValueError(f"bucketed_tail needs <MiB>/<last MiB>, got {arg!r}")
    return float(cap), float(last)


def variant_plan(name: str) -> ParallelPlan:
    """The data-parallel plan of a variant name ("nosync", "bucketed:100", "bucketed_tail:1000/1", ...)."""
    kind, _, arg = name.partition(":")
    if kind == "nosync":
        return ParallelPlan()
    if kind == "bucketed_tail":
        cap, last = parse_tail_variant(arg)
        return ParallelPlan(data_parallel="bucketed", bucket_size_mb=cap, last_bucket_mb=last)
    if kind == "bucketed_lp":
        return ParallelPlan(data_parallel="bucketed", bucket_size_mb=float(arg), reduce_dtype="bf16")
    if kind == "bucketed":
        return ParallelPlan(data_parallel="bucketed", bucket_size_mb=float(arg))
    if kind == "bucketed_update":
        variant_sm_carveout(name)  # a malformed <N> fails with the plan
        return ParallelPlan(data_parallel="bucketed", update_per_bucket=True)
    if kind == "peer_update":  # options joined by "+": <N> copy streams, "graphs", "thread", "deferred", "read"
        switches = {"graphs": "copy_graphs", "thread": "issue_thread", "deferred": "defer_copies",
                    "read": "read_peers"}
        options = {"copy_streams": 1}
        for option in arg.split("+") if arg else []:
            if option in switches:
                options[switches[option]] = True
            elif option.isdigit() and int(option) > 0:
                options["copy_streams"] = int(option)
            else:
                raise ValueError(f"peer_update:<options> takes options joined by '+': a positive count of copy "
                                 f"streams, 'graphs', 'thread', 'deferred' or 'read'; got {option!r} in {name!r}")
        return ParallelPlan(data_parallel="peer", **options)
    return ParallelPlan(data_parallel=kind)


def variant_sm_carveout(name: str) -> int:
    """The SMs a variant carves out of the backward's matmuls: N of "bucketed_update:<N>", else 0."""
    kind, _, arg = name.partition(":")
    if kind != "bucketed_update" or not arg:
        return 0
    if not (arg.isdigit() and int(arg) > 0):
        raise ValueError(f"bucketed_update:<N> takes a positive count of SMs carved out of the backward's "
                         f"matmuls, got {arg!r}")
    return int(arg)


def setting_name(precision: str, compiled: bool, master: bool = False) -> str:
    name = MASTER_SETTING if master else precision
    return f"{name}+compile" if compiled else name


def notebook_config(*, profile: str, handout: str) -> DDPBenchConfig:
    """Notebook 07's benchmark. Full: the handout's xl (2025: xl-2025 with the 1-1000 MB bucket
    sweep its ddp_bucketed_benchmarking asks for; 2026: the 2.7B preset, whose handout has no
    bucketed problem, so only our two fastest bucketed variants beside torch DDP), fp32 and bf16
    eager, then bf16 with compiled blocks, then the same with bf16 weights and fp32 masters (the
    fast single-GPU step's arithmetic); budgeted to fit 2 x H200 in the notebook's 9 minutes.
    Smoke: the debug model on gloo, same code paths."""
    from systems.config import preset_of

    if profile == "smoke":
        return DDPBenchConfig(model="debug", context_length=64, batch_size=4, bucket_sizes_mb=(0.05, 0.2, 1.0),
                              tail_buckets_mb=((1.0, 0.05),), lp_reduce_buckets_mb=(1.0,), warmup=1, steps=3,
                              profile_steps=1, master_weights=True,
                              master_variants=("nosync", "overlap", "bucketed:0.2", "bucketed_update", "peer_update",
                                               "peer_update:read", "torch_ddp"), paired_rounds=2)
    model = preset_of("xl", handout)
    if handout == "2025":
        return DDPBenchConfig(model=model, context_length=512, batch_size=4, lp_reduce_buckets_mb=(1000.0,),
                              tail_buckets_mb=((1000.0, 1.0),), compiled_precisions=("bf16",),
                              compile_mode="reduce-overhead", master_weights=True, warmup=3, steps=10,
                              paired_rounds=4, budget_s=380.0)
    return DDPBenchConfig(model=model, context_length=512, batch_size=4, bucket_sizes_mb=(100.0,),
                          tail_buckets_mb=((1000.0, 1.0),), compiled_precisions=("bf16",),
                          compile_mode="reduce-overhead", master_weights=True, warmup=2, steps=8, paired_rounds=4,
                          budget_s=380.0)


def _train_step(name: str, model: torch.nn.Module, opt, precision: str) -> tuple[Parallelized, TrainStep]:
    """The variant's plan applied to the shared model, and the step that runs it."""
    spec = StepSpec(precision=precision, sm_carveout=variant_sm_carveout(name))
    par = apply(model, variant_plan(name), optimizer=opt, loss=spec.loss)
    step = TrainStep(model, spec=spec, optimizer=opt, forward=par.forward, grad_sync=par.grad_sync)
    return par, step


def _close(par: Parallelized, opt) -> None:
    par.remove()
    opt.zero_grad(set_to_none=True)  # drop grads that live in bucket buffers


def _profile(step: TrainStep, tokens, targets, ctx: DistContext, steps: int, path: Path) -> None:
    from torch.profiler import profile

    ctx.barrier()
    # only rank 0 records; every rank runs the same steps so the collectives still pair up
    if ctx.is_main:
        with profile(activities=profiler_activities(ctx.device)) as prof:
            for _ in range(steps):
                step(tokens, targets)
            ctx.sync()
        export_trace(prof, path)
    else:
        for _ in range(steps):
            step(tokens, targets)
    ctx.barrier()


def _last_bucket_bytes(wrapper) -> int | None:
    """Bytes of the bucket reduced last (the first parameters': backward produces them last)."""
    buckets = getattr(wrapper, "buckets", None)
    return buckets[-1].buffer.numel() * buckets[-1].buffer.element_size() if buckets else None


def _time_variant(name: str, model, opt, precision: str, tokens, targets, ctx: DistContext,
                  cfg: DDPBenchConfig) -> dict:
    """Warm-up, then ``cfg.steps`` timed steps of one variant; per-step times of the slowest rank."""
    par = step = None
    try:
        par, step = _train_step(name, model, opt, precision)
        return _timed_steps(par, step, tokens, targets, ctx, cfg)
    finally:  # an out-of-memory step too: the next variant must find the model without this one's hooks
        if par is not None:
            _close(par, opt)
        del par, step
        release_memory(ctx.device)


def _timed_steps(par, step, tokens, targets, ctx: DistContext, cfg: DDPBenchConfig) -> dict:
    t0 = time.perf_counter()
    for i in range(cfg.warmup):
        step(tokens, targets)
        if i == 0:
            ctx.sync()  # the first step alone: it holds any compilation
            first_step_s = time.perf_counter() - t0
    ctx.barrier()
    check_s0 = getattr(par.wrapper, "check_seconds", None)
    hook_s0 = getattr(par.wrapper, "hook_seconds", None)
    exchange_s0 = getattr(par.wrapper, "exchange_seconds", None)
    issue = getattr(par.wrapper, "issue", None)
    issue_s0 = getattr(issue, "busy_seconds", None)
    samples = []
    for _ in range(cfg.steps):
        # the step by wall time, synchronised (its phases by the device's events): it includes
        # the host work no event brackets, the agreement's round trip and the hooks
        marks, wall = Marks(ctx.device), Marks(ctx.device, clock="host")
        wall.mark("start")
        step(tokens, targets, marks=marks)
        ctx.sync()
        wall.mark("end")
        synced = "grad_sync" if "grad_sync" in marks else "backward"
        samples.append({"step_ms": wall.ms("start", "end"),
                        "fwd_bwd_ms": marks.ms("start", "backward"),
                        "backward_ms": marks.ms("forward", "backward"),
                        "sync_wait_ms": marks.ms("backward", synced),
                        "optimizer_ms": marks.ms(synced, "optimizer")})
    row = summarise_steps(all_gather_objects(samples))
    if check_s0 is not None:  # the ranks' agreement on which gradients to reduce, per step
        row["grad_check_ms"] = (par.wrapper.check_seconds - check_s0) / cfg.steps * 1e3
    if hook_s0 is not None:  # host time inside the wrapper's gradient hooks, per step (rank 0's)
        row["hook_ms"] = (par.wrapper.hook_seconds - hook_s0) / cfg.steps * 1e3
    if exchange_s0 is not None:  # read_peers: where the other rank's gradients lie, per step (rank 0's)
        row["exchange_ms"] = (par.wrapper.exchange_seconds - exchange_s0) / cfg.steps * 1e3
    if issue_s0 is not None:  # the issue thread's time in the transport's calls, per step
        row["issue_thread_ms"] = (issue.busy_seconds - issue_s0) / cfg.steps * 1e3
    row.update(first_step_s=first_step_s, n_buckets=getattr(par.wrapper, "n_buckets", None),
               last_bucket_bytes=_last_bucket_bytes(par.wrapper))
    return row


def trace_path(trace_dir: str, *, setting: str, variant: str) -> Path:
    """Where rank 0's trace of one variant goes: one file directly in ``trace_dir``. Settings and
    variants hold '+', ':' and '/' ('bucketed_tail:1000/1'), which would make a subdirectory."""
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{setting}_{variant}")
    return Path(trace_dir) / f"ddp_{slug}_rank0.json.gz"


def _profile_variant(name: str, model, opt, precision: str, tokens, targets, ctx: DistContext,
                     cfg: DDPBenchConfig, path: Path) -> None:
    par, step = _train_step(name, model, opt, precision)
    for _ in range(cfg.warmup):
        step(tokens, targets)
    _profile(step, tokens, targets, ctx, cfg.profile_steps, path)
    _close(par, opt)
    del par, step
    release_memory(ctx.device)


class _StepBudget:
    """The run's ``Budget`` asked in steps of the last measured length; rank 0's answer holds for
    every rank (the ranks must take the same branches, or their collectives would pair wrongly)."""

    def __init__(self, seconds: float | None):
        self.budget = Budget(seconds=seconds)
        self.step_s = 0.0  # the last measured step, for estimates

    def allows(self, n_steps: int, extra_s: float = 0.0) -> bool:
        return bool(all_gather_objects(self.budget.allows(need_s=n_steps * self.step_s + extra_s))[0])


def _grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients a step communicates (in the trainable parameters' dtypes)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def bench_worker(ctx: DistContext, config: dict) -> dict:
    """One rank of the benchmark. Rank 0 writes the rows as they are measured and returns them."""
    cfg = DDPBenchConfig(**config)
    cfg.check_world_size(ctx.world_size)
    local_batch = cfg.batch_size // ctx.world_size
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    model_cfg = cfg.model_config()
    if ctx.is_main:  # a large model takes a while to build, more so on a CPU
        print(f"{cfg.model}: {model_cfg.n_params / 1e9:.3g}B parameters on {ctx.world_size} ranks ({ctx.backend}); "
              "building the model", flush=True)
    torch.manual_seed(cfg.seed)  # same init everywhere; the wrappers broadcast rank 0's anyway
    model = TransformerLM(model_cfg, device=ctx.device)
    opt = build_optimizer(model, OptimizerSpec(kind="ours", lr=cfg.lr))
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    data = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, cfg.context_length + 1), generator=gen)
    shard = data[ctx.rank * local_batch:(ctx.rank + 1) * local_batch].to(ctx.device)
    tokens, targets = shard[:, :-1].contiguous(), shard[:, 1:].contiguous()

    writer = ResultWriter(cfg.out_path) if ctx.is_main else None
    overlap_writer = ResultWriter(cfg.overlap_path) if ctx.is_main and cfg.profile else None
    paired_writer = ResultWriter(cfg.paired_path) if ctx.is_main and cfg.paired_rounds else None
    rows, overlap_rows, paired_rows = [], [], []
    common = {"backend": ctx.backend, "world_size": ctx.world_size, "model": cfg.model,
              "n_params": model_cfg.n_params, "grad_bytes": _grad_bytes(model),
              "n_tensors": sum(1 for p in model.parameters() if p.requires_grad), "context_length": cfg.context_length,
              "global_batch": cfg.batch_size, "local_batch": local_batch, "tf32": cfg.tf32,
              "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"}
    budget = _StepBudget(cfg.budget_s)

    compiled_yet = False
    for precision, compiled, master in cfg.settings():
        setting = setting_name(precision, compiled, master)
        about = {**common, "precision": precision, "compiled": compiled, "setting": setting,
                 "compile_mode": cfg.compile_mode if compiled else None, "master_weights": master}
        if master:
            # the old optimizer's state goes first: the masters and their moments take its place
            del opt
            release_memory(ctx.device)
            # converts the matmul weights to bf16 in place (param.data)
            opt = build_optimizer(model, OptimizerSpec(kind="fused", lr=cfg.lr, master_weights=True, grouped=True))
            if compiled_yet:
                # the compiled blocks' guards do not see a parameter's dtype change through .data:
                # their fp32 kernels would read the bf16 weights out of bounds (an illegal memory
                # access on 2 x H200 at 9a68d09). Dropping every compiled graph makes the next
                # call compile for bf16 weights.
                torch._dynamo.reset()
            about["grad_bytes"] = _grad_bytes(model)
        if compiled and not compiled_yet:
            apply_compile(model, scope="blocks", mode=cfg.compile_mode)
            compiled_yet = True
        baseline_ms = None
        timed: dict[str, float] = {}
        names = list(cfg.master_variants if master else cfg.variants)
        # the rounds need every variant of ours timed (they take the fastest) and run before torch DDP's block
        rounds_at = names.index("torch_ddp") if "torch_ddp" in names else len(names)
        for position, name in enumerate(names + [None]):
            if master and cfg.paired_rounds and position == rounds_at:
                paired_rows += _paired_rounds(timed, model, opt, precision, tokens, targets, ctx, cfg, budget,
                                              about=about, writer=paired_writer, with_torch_ddp=name is not None)
            if name is None:
                break
            plan = variant_plan(name)
            row = {**about, "variant": name, "kind": name.partition(":")[0], "bucket_size_mb": plan.bucket_size_mb,
                   "last_bucket_mb": plan.last_bucket_mb}
            if plan.read_peers and read_peers_refusal(ctx.world_size, ctx.device) is not None:
                row["status"] = NEEDS_TWO_GPUS
            elif not budget.allows(cfg.warmup + cfg.steps):
                row["status"] = SKIPPED
            else:
                # the ranks hold the same model and batch, so they run out of memory at the same step:
                # each turns it into the row's status and the sweep goes on
                with catch_oom() as oom:
                    measured = _time_variant(name, model, opt, precision, tokens, targets, ctx, cfg)
                if oom:
                    release_memory(ctx.device)
                    row.update(status="oom", error=oom.message)
            if row.get("status") is None:
                budget.step_s = measured["step_ms"] / 1e3
                if name == "nosync":
                    baseline_ms = measured["step_ms"]
                timed[name] = measured["step_ms"]
                overhead = None if baseline_ms is None else measured["step_ms"] - baseline_ms
                row.update(measured, baseline_step_ms=baseline_ms, comm_overhead_ms=overhead,
                           comm_share=None if overhead is None else overhead / measured["step_ms"],
                           tokens_per_s=cfg.batch_size * cfg.context_length / (measured["step_ms"] / 1e3),
                           status="ok")
            if ctx.is_main:
                rows.append(writer.write(row))
                hooks = f", hooks {row['hook_ms']:.2f} ms" if row.get("hook_ms") is not None else ""
                if row.get("exchange_ms") is not None:
                    hooks += f", exchange {row['exchange_ms']:.2f} ms"
                print(f"[{setting}] {name:>16}: " + (f"{row['step_ms']:8.2f} ms/step (sync wait {row['sync_wait_ms']:.2f} ms"
                                                    f"{hooks})" if row["status"] == "ok" else row["status"]), flush=True)

        if cfg.profile:
            best = _fastest_of_ours(timed)
            to_profile = [v for v in ("naive", "overlap") if v in timed]
            if best and best not in to_profile:
                to_profile.append(best)
            for name in to_profile:
                # a trace of a long step takes seconds to write and to read back
                if not budget.allows(cfg.warmup + cfg.profile_steps + 2, extra_s=5.0):
                    if ctx.is_main:
                        overlap_rows.append(overlap_writer.write({**about, "variant": name, "status": SKIPPED}))
                    continue
                path = trace_path(cfg.trace_dir, setting=setting, variant=name)
                _profile_variant(name, model, opt, precision, tokens, targets, ctx, cfg, path)
                if ctx.is_main:
                    stats = overlap_stats(comm_compute_intervals(path))
                    overlap_rows.append(overlap_writer.write({**about, "variant": name, "trace": str(path), **stats,
                                                              "step_ms": timed.get(name), "status": "ok"}))
                    print(f"[{setting}] profiled {name}: overlap {stats['overlap_pct'] or 0:.1f}% "
                          f"exposed comm {stats['exposed_comm_ms']:.2f} ms/step", flush=True)
    return {"rows": rows, "overlap": overlap_rows, "paired": paired_rows} if ctx.is_main else {}


def _fastest_of_ours(timed: dict[str, float]) -> str | None:
    """The timed variant with the shortest step, the baseline and torch DDP aside (None: none)."""
    ours = {v: t for v, t in timed.items() if v not in ("nosync", "torch_ddp")}
    return min(ours, key=ours.get) if ours else None


def _paired_rounds(timed: dict[str, float], model, opt, precision: str, tokens, targets, ctx: DistContext,
                   cfg: DDPBenchConfig, budget: _StepBudget, *, about: dict, writer, with_torch_ddp: bool) -> list[dict]:
    """``cfg.paired_rounds`` rounds of no sync, the fastest of our timed variants and, with
    ``with_torch_ddp``, torch DDP: in order on even rounds, reversed on odd ones (a drift that is
    linear in time gives each arm the same mean position over two rounds; the report takes the
    rounds' median, which that symmetry helps but does not make exact). One row per round with
    each median, the overhead over no sync and (with torch DDP) the step over torch DDP's, all
    within the round. Rows are written as each round ends; a round the budget has no room for
    (keeping room for torch DDP's own block after them) is recorded as skipped."""
    best = _fastest_of_ours(timed)
    if "nosync" not in timed or best is None:
        return []
    arms = ("nosync", best, "torch_ddp") if with_torch_ddp else ("nosync", best)
    per_variant = cfg.warmup + cfg.steps
    rows = []
    for r in range(cfg.paired_rounds):
        row = {**about, "variant": best, "round": r, "steps": cfg.steps}
        # each arm builds a fresh wrapper (a few seconds at 2.7B); torch DDP's own block follows the rounds
        if not budget.allows((len(arms) + with_torch_ddp) * per_variant, extra_s=2.5 * len(arms)):
            row["status"] = SKIPPED
        else:
            order = arms if r % 2 == 0 else arms[::-1]
            ms = {name: _time_variant(name, model, opt, precision, tokens, targets, ctx, cfg)["step_ms"]
                  for name in order}
            budget.step_s = max(ms.values()) / 1e3  # torch DDP's steps are the longest: the next estimates use them
            row.update(first=order[0], nosync_ms=ms["nosync"], variant_ms=ms[best],
                       overhead_ms=ms[best] - ms["nosync"], share=(ms[best] - ms["nosync"]) / ms[best])
            if with_torch_ddp:
                row.update(torch_ddp_ms=ms["torch_ddp"], vs_torch_ddp=ms[best] / ms["torch_ddp"])
            row["status"] = "ok"
        if ctx.is_main:
            rows.append(writer.write(row))
            said = row["status"]
            if said == "ok":
                said = f"nosync {row['nosync_ms']:.2f}, {best} {row['variant_ms']:.2f}"
                said += f", torch_ddp {row['torch_ddp_ms']:.2f} ms/step" if with_torch_ddp else " ms/step"
            print(f"[{about['setting']}] round {r}: {said}", flush=True)
    return rows


def summarise_steps(gathered: list[list[dict]]) -> dict:
    """Per step the slowest rank (the step ends for all when it does); medians over steps."""
    n = min(len(s) for s in gathered)
    out = {}
    for key in gathered[0][0]:
        out[key], p10, p90 = slowest_rank_median([[s[key] for s in rank] for rank in gathered])
        if key == "step_ms":
            out["step_ms_p10"], out["step_ms_p90"] = p10, p90
    out["steps"] = n
    return out


CHECKED_WRAPPERS = (("naive", {}), ("flat", {}), ("overlap", {}), ("bucketed", {"bucket_size_mb": 0.01}))


def _check_worker(ctx: DistContext, model_overrides: dict, steps: int, batch_size: int, seq: int) -> list[dict]:
    """Each wrapper on this rank's half of every batch, against one process training on the whole
    batch (here, in the same process: same kernels); max weight differences after ``steps``."""
    from systems.config import get_config
    from systems.optim import AdamW, cross_entropy
    from systems.parallel.ddp import make_ddp

    model_cfg = get_config("debug", **model_overrides)
    batches = [torch.randint(0, model_cfg.vocab_size, (batch_size, seq + 1),
                             generator=torch.Generator().manual_seed(100 + i)) for i in range(steps)]

    def train(ddp_name: str | None, kwargs: dict) -> dict:
        torch.manual_seed(0)
        model = TransformerLM(model_cfg)
        ddp = make_ddp(ddp_name, model, **kwargs) if ddp_name else None
        opt = AdamW(model.parameters(), lr=1e-3)
        local = batch_size // ctx.world_size if ddp else batch_size
        rows = slice(ctx.rank * local, (ctx.rank + 1) * local) if ddp else slice(None)
        for data in batches:
            opt.zero_grad(set_to_none=True)
            cross_entropy(model(data[rows, :-1]), data[rows, 1:]).backward()
            if ddp:
                ddp.finish_gradient_synchronization()
            opt.step()
        if ddp:
            ddp.remove_hooks()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    reference = train(None, {})
    out = []
    for name, kwargs in CHECKED_WRAPPERS:
        trained = train(name, kwargs)
        diffs = {n: (trained[n] - w).abs().max().item() for n, w in reference.items()}
        worst = max(diffs, key=diffs.get)
        out.append({"wrapper": name, **kwargs, "rank": ctx.rank, "steps": steps, "global_batch": batch_size,
                    "n_params": sum(w.numel() for w in reference.values()), "max_abs_diff": diffs[worst],
                    "worst_param": worst, "max_weight": max(w.abs().max().item() for w in reference.values())})
    return out


def check_against_single_process(out_path: str | Path, *, world_size: int = 2, steps: int = 3) -> list[dict]:
    """naive_ddp and its successors, as the handout checks them: a small Transformer trained with
    each wrapper on 2 gloo ranks against the same training in one process on the whole batch (our
    AdamW, random tokens). One row per wrapper and rank: the largest weight difference at the end.
    The ranks' half-batch gradients are summed in another order than the full batch's, so fp32
    results agree to rounding, not bit for bit (tests/parallel/test_ddp.py bounds it)."""
    from systems.parallel.launch import spawn

    per_rank = spawn(_check_worker, world_size, "gloo",
                     args=(dict(d_model=32, d_ff=64, n_heads=2, n_layers=2, vocab_size=97), steps, 8, 16),
                     timeout_s=120)
    writer = ResultWriter(out_path)
    return [writer.write(row) for rank_rows in per_rank for row in rank_rows]


def run_ddp_benchmark(config: DDPBenchConfig, *, world_size: int = 2, backend: str = "auto",
                      timeout_s: float = 600.0) -> dict:
    """Start ``world_size`` ranks (spawn, or this process under torchrun) and run the benchmark."""
    config.check_world_size(world_size)
    results = launch(bench_worker, world_size, backend, args=(asdict(config),), timeout_s=timeout_s)
    return results[0]


def main(argv: list[str] | None = None) -> int:
    d = DDPBenchConfig()
    parser = argparse.ArgumentParser(prog="python -m systems.bench.ddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_distributed_arguments(parser, d, precisions=PRECISIONS, tool="ddp")
    parser.add_argument("--bucket-sizes-mb", nargs="+", type=float, default=list(d.bucket_sizes_mb))
    parser.add_argument("--tail-buckets-mb", nargs="*", default=[], type=parse_tail_variant,
                        help="also run bucketed DDP with a separately capped last bucket: <MiB>/<last MiB> ...")
    parser.add_argument("--lp-reduce-buckets-mb", nargs="*", type=float, default=[],
                        help="also run bucketed DDP all-reducing in bf16 with these bucket sizes")
    parser.add_argument("--compiled-precisions", nargs="*", default=[], choices=PRECISIONS,
                        help="run these precisions again with every Transformer block compiled")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode of the compiled settings")
    parser.add_argument("--no-torch-ddp", action="store_true")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="the eager and compiled settings' variants (default: nosync, naive, flat, overlap, "
                             "a bucketed one per bucket option, torch_ddp)")
    parser.add_argument("--master-weights", action="store_true",
                        help="add the bf16 setting with bf16 weights and fp32 masters, last")
    parser.add_argument("--master-variants", nargs="+", default=list(d.master_variants),
                        help="the master-weights setting's variants")
    parser.add_argument("--paired-rounds", type=int, default=d.paired_rounds,
                        help="after the master-weights setting's variants: rounds alternating nosync, the "
                             "fastest of ours and torch DDP (when listed), each compared within its round")
    parser.add_argument("--profile-steps", type=int, default=d.profile_steps)
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in the fp32 runs")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    try:
        config = DDPBenchConfig(
            model=args.model, context_length=args.context_length, batch_size=args.batch_size,
            precisions=tuple(args.precisions), compiled_precisions=tuple(args.compiled_precisions),
            bucket_sizes_mb=tuple(args.bucket_sizes_mb),
            lp_reduce_buckets_mb=tuple(args.lp_reduce_buckets_mb),
            tail_buckets_mb=tuple(args.tail_buckets_mb),
            compile_mode=args.compile_mode,
            include_torch_ddp=not args.no_torch_ddp, master_weights=args.master_weights,
            master_variants=tuple(v for v in args.master_variants if not (args.no_torch_ddp and v == "torch_ddp")),
            variants=tuple(v for v in args.variants or () if not (args.no_torch_ddp and v == "torch_ddp")),
            warmup=args.warmup, steps=args.steps,
            profile=not args.no_profile, profile_steps=args.profile_steps, attn_impl=args.attn_impl,
            tf32=args.tf32, out_path=str(out / "07_distributed_ddp.jsonl"),
            overlap_path=str(out / "07_distributed_overlap.jsonl"), trace_dir=str(out / "07_distributed_traces"),
            paired_rounds=args.paired_rounds, paired_path=str(out / "07_distributed_paired.jsonl"))
        # the batch must split over the ranks the run will have (torchrun's, where it started us)
        config.check_world_size(check_launch(world_size=args.world_size, backend=args.backend,
                                             timeout_s=args.timeout_s))
    except ValueError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    result = run_ddp_benchmark(config, world_size=args.world_size, backend=args.backend, timeout_s=args.timeout_s)
    if result:  # rank 0 (the only rank under spawn; one of several under torchrun)
        print(f"done in {time.perf_counter() - start:.0f} s ({resolve_backend(args.backend)}"
              f"{', torchrun' if under_torchrun() else ''}); rows in {config.out_path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
