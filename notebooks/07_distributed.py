# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Data parallelism: all-reduce cost, and naive / flat / overlapped / bucketed DDP
#
# What does an all-reduce cost as the tensor and the number of ranks grow (2025 handout,
# `distributed_communication_single_node`)? And how much of a data-parallel training step goes to
# gradient communication when it is done naively after backward, flattened into one call,
# overlapped per parameter, or overlapped in buckets, against torch's own
# `DistributedDataParallel` in the same run (`naive_ddp_benchmarking`, `ddp_overlap_individual_parameters_benchmarking`,
# `ddp_bucketed_benchmarking`)? The full profile runs NCCL on the visible GPUs (it needs two)
# with the xl model; the smoke profile runs the same code on gloo with two CPU processes and
# the debug model. Ranks are started by `systems.parallel.launch.spawn` (or `torchrun`).

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, gloo, < 90 s) or "full" (NCCL on two or more GPUs)
out_dir = "build/smoke"  # the runner injects this
ddp_world_size = 2       # ranks for the DDP benchmark (global batch 4 -> 2 per rank)
gloo_max_mb = None       # cap on gloo all-reduce sizes; None: 10 MB (smoke) / 100 MB (full)

# %%
import torch

from systems.report import notebook as nb
from systems.bench import allreduce as arb
from systems.report import distributed as report
from systems.bench.ddp import DDPBenchConfig, run_ddp_benchmark
from systems.analysis.parallel_math import ddp_bucket_overhead, optimal_bucket_bytes
from systems.measure.results import read_results

ctx = nb.setup(name="07_distributed", profile=profile, out_dir=out_dir)
n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
if ctx.full and n_gpus < 2:
    raise RuntimeError(f"the full profile runs NCCL across GPUs and needs at least 2; this machine has {n_gpus}")
ddp_backend = "nccl" if ctx.full else "gloo"

# %% [markdown]
# ## All-reduce: time and bandwidth vs size and world size
#
# fp32 tensors of 1 MB, 10 MB, 100 MB and 1 GB at 2, 4 and 6 ranks. NCCL runs one process per GPU,
# so world sizes above the GPU count are recorded as not run; gloo runs CPU processes, capped to
# what this profile's CPU budget allows. Each case: 5 warm-up calls, then timed calls between a
# barrier and a device synchronisation; every rank's times are gathered with `all_gather_object`,
# and an iteration counts as long as its slowest rank. algbw = bytes / time; busbw = algbw x 2(n-1)/n.

# %%
if ctx.full:
    plan = arb.plan_cases(backends=["nccl", "gloo"], n_gpus=n_gpus,
                          max_gloo_bytes=int((gloo_max_mb or 100) * arb.MB))
    budget = dict(budget_s=1.0, min_iters=5, max_iters=50)
else:
    plan = arb.plan_cases(backends=["gloo"], n_gpus=0, max_gloo_world_size=2,
                          max_gloo_bytes=int((gloo_max_mb or 10) * arb.MB))
    budget = dict(budget_s=0.3, min_iters=3, max_iters=10)
arb.run_benchmark(plan, ctx.result_path("allreduce"), **budget)
allreduce = read_results(ctx.result_path("allreduce"))
nb.show(report.allreduce_table(allreduce), caption=f"All-reduce of fp32 tensors ({ctx.gpu})")

# %%
fig = report.plot_allreduce(allreduce, title=f"All-reduce, fp32 ({ctx.gpu})")
nb.save_figure(fig, ctx, "allreduce")

# %%
nb.md("**Commentary.**\n\n" + report.allreduce_commentary(allreduce) + "\n\n"
      "busbw multiplies by the 2(n-1)/n of the data each rank sends and receives in a ring, so it is "
      "the number to compare across world sizes and with a link's peak; algbw is what a caller sees.")

# %% [markdown]
# ## DDP variants against torch DDP
#
# Every variant wraps the same model; our `AdamW`; global batch 4 split over the ranks. `nosync`
# skips communication entirely and is the compute-only baseline: the communication overhead of a
# variant is its step time minus the `nosync` step time of the same setting (for torch DDP too,
# whose waiting happens inside backward). `sync_wait_ms` is the time from the end of backward to
# the end of `finish_gradient_synchronization()` on the device, what is left to wait for.
# `bucketed_lp:<MiB>` is the bucketed wrapper with `reduce_dtype=torch.bfloat16`: it sends half the
# bytes of fp32 gradients (as FSDP2's `reduce_dtype` does), and each averaged gradient is rounded to
# bf16 on the way; torch DDP and the other variants all-reduce in fp32.
#
# `bucketed_tail:<MiB>/<last MiB>` caps the last bucket separately. That bucket holds the first
# parameters (the embedding), whose gradients backward produces last, so nothing is left to
# overlap its all-reduce with; its size is the communication left after backward.
#
# A *setting* is a precision, eager or with compiled blocks. The full profile runs fp32 and bf16
# eager (the handout's benchmark), then bf16 again with every Transformer block compiled
# (`bf16+compile`: `torch.compile(mode="reduce-overhead")` per block, applied from outside the
# model, so each block's forward and backward replay as CUDA graphs; same variants). The eager
# bf16 xl step is host-bound: the GPU waits on Python's kernel launches, so its step time moves
# with the host, and communication kernels that run in those idle gaps count as exposed in the
# trace although no computation waits for them. With CUDA-graphed blocks the same step is
# GPU-bound, which is where overlap can be judged.

# %%
if ctx.full:
    ddp_config = DDPBenchConfig(model="xl-2025", context_length=512, batch_size=4, lp_reduce_buckets_mb=(1000.0,),
                                tail_buckets_mb=((1000.0, 1.0),), compiled_precisions=("bf16",),
                                compile_mode="reduce-overhead")
else:
    ddp_config = DDPBenchConfig(model="debug", context_length=64, batch_size=4, bucket_sizes_mb=(0.05, 0.2, 1.0),
                                lp_reduce_buckets_mb=(1.0,), warmup=1, steps=3, profile_steps=1)
ddp_config.out_path = str(ctx.result_path("ddp"))
ddp_config.overlap_path = str(ctx.result_path("overlap"))
ddp_config.trace_dir = str(ctx.results / f"{ctx.name}_traces")
run_ddp_benchmark(ddp_config, world_size=ddp_world_size, backend=ddp_backend)
ddp = read_results(ctx.result_path("ddp"))
overlap = read_results(ctx.result_path("overlap"))
table = report.ddp_table(ddp)
nb.show(table, caption=f"{ddp_config.model}, context {ddp_config.context_length}, global batch "
                       f"{ddp_config.batch_size} on {ddp_world_size} ranks ({ddp_backend}, {ctx.gpu}); "
                       "vs_torch_ddp = step time / torch DDP's")

# %%
fig = report.plot_ddp(ddp, title=f"Time per step: computation and communication overhead ({ctx.gpu})")
nb.save_figure(fig, ctx, "ddp_variants")

# %%
nb.md("**Commentary.**\n\n" + report.ddp_commentary(ddp, overlap))

# %% [markdown]
# ## Overlap in the profiler traces
#
# Rank 0's `torch.profiler` trace of naive DDP, per-parameter overlap and the fastest of our
# variants. On GPU the lanes are kernels: NCCL kernels (communication) and all other kernels
# (computation); on CPU the gloo worker threads' all-reduce ranges and the training thread's
# operators. Exposed communication = time some communication runs while nothing else does.

# %%
nb.show(overlap[["setting", "variant", "trace_kind", "step_window_ms", "comm_ms", "compute_ms",
                 "overlapped_ms", "exposed_comm_ms", "overlap_pct", "exposed_comm_pct_of_step"]],
        caption="Per profiled step, from the traces")
fig = report.plot_overlap(overlap, title=f"One profiled step per variant ({ctx.gpu})")
nb.save_figure(fig, ctx, "overlap")

# %%
nb.md("**Against the targets** (2xH200 acceptance: best step time <= torch DDP's, exposed "
      "communication <= 3% of the step):\n\n" + report.ddp_targets(table, overlap))

# %% [markdown]
# ## The bucketed-DDP overhead model
#
# With $s$ bytes of gradients in $n_b$ equal buckets, an all-reduce of a bucket costing
# $o + s/(n_b w)$ ($o$: fixed cost per call, $w$: algorithm bandwidth), and gradients computed at
# the rate they can be sent, the time the last all-reduce runs past the end of backward is
#
# $$\text{overhead}(n_b) = \frac{s}{n_b\,w} + n_b\,o,$$
#
# minimised at $n_b^* = \sqrt{s/(w\,o)}$, i.e. a bucket size of $\sqrt{s\,w\,o}$
# (`systems.analysis.parallel_math.ddp_bucket_overhead`, `optimal_bucket_bytes`). $o$ and $w$ are fitted
# to this run's all-reduce times ($t = o + \text{size}/w$) for the DDP benchmark's backend and
# world size; the measured points are the bucketed variants above.

# %%
fit = report.fit_alpha_beta(allreduce, backend=ddp_backend, world_size=ddp_world_size)
if fit is not None:
    frame, optimum = report.bucket_model_frame(ddp, fit, overhead_fn=ddp_bucket_overhead,
                                               optimal_bytes_fn=optimal_bucket_bytes)
    nb.show(frame, caption="Bucketed DDP: measured overhead vs the model at the same bucket count")
    fig = report.plot_bucket_model(frame, fit, optimum, overhead_fn=ddp_bucket_overhead)
    nb.save_figure(fig, ctx, "bucket_model")
    best_measured = frame.loc[frame["measured_overhead_ms"].idxmin()]
    nb.md(f"Fitted from the {fit['n_sizes']} all-reduce sizes ({fit['backend']}, {fit['world_size']} ranks): "
          f"o = {fit['per_call_overhead_s'] * 1e6:.3g} us per call, w = {fit['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s "
          f"({fit['source']}). "
          f"For s = {optimum['grad_bytes'] / 2**20:.4g} MiB of gradients the model's optimum is "
          f"n_b = {optimum['optimal_n_buckets']:.3g} buckets of {optimum['optimal_bucket_bytes'] / 2**20:.3g} MiB, "
          f"with a predicted overhead of "
          f"{ddp_bucket_overhead(total_bytes=optimum['grad_bytes'], bandwidth_bytes_per_s=fit['bandwidth_bytes_per_s'], per_call_overhead_s=fit['per_call_overhead_s'], n_buckets=max(optimum['optimal_n_buckets'], 1.0)) * 1e3:.3g} ms. "
          f"Measured, the lowest overhead came with {best_measured['bucket_size_mb']:g} MiB buckets "
          f"({int(best_measured['n_buckets'])} buckets, {best_measured['setting']}): "
          f"{best_measured['measured_overhead_ms']:.3g} ms. The model ignores that communication "
          "kernels slow the computation they overlap, that backward does not produce gradients "
          "at a uniform rate, and that real buckets are not equal (a parameter larger than the cap gets "
          "a bucket of its own).")
else:
    nb.md(f"*No {ddp_backend} all-reduce at {ddp_world_size} ranks with two sizes was measured, so o and w "
          "cannot be fitted.*")
