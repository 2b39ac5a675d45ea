# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Optimizer-state sharding and FSDP
#
# How much memory does sharding save, and what does it cost in time? On 2 ranks with the handout's
# xl model (context 512, global batch 4) we measure DDP with and without a sharded optimizer
# (`systems.parallel.sharded_optimizer.ShardedOptimizer`), then our fully sharded wrapper
# (`systems.parallel.fsdp.FSDP`) against torch's FSDP2 (`fully_shard`) in the same run, all with one
# optimizer (torch AdamW, foreach), and read a profiler trace to see whether each layer's
# all-gather finishes before the layer needs it. The accounting (`systems.analysis.sharding`)
# says what each part should weigh; the allocator says what it did.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (2 gloo ranks on CPU, < 90 s) or "full" (NCCL on two or more GPUs)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's questions and xl model
large_model = "auto"     # a size that may not fit 2 GPUs, tried after the rest; auto: 10B for 2026 full

# %%
from systems.bench import fsdp as fsdp_bench
from systems.config import get_config, handout_sizes, size_label
from systems.measure.results import read_results
from systems.report import notebook as nb
from systems.report import sharding_fsdp as report

# the ranks own the GPUs: this process makes no CUDA context of its own
ctx = nb.setup(name="08_sharding_fsdp", profile=profile, out_dir=out_dir, handout=handout, gpus_in_ranks=True)
backend, world = ("nccl" if ctx.full else "gloo"), 2
large = (("10B" if ctx.handout == "2026" and ctx.full else None) if large_model == "auto" else large_model)
config = fsdp_bench.notebook_config(profile=ctx.profile, handout=ctx.handout)
config.opt_path, config.fsdp_path = str(ctx.result_path("optimizer")), str(ctx.result_path("fsdp"))
config.gather_path, config.trace_dir = str(ctx.result_path("gathers")), str(ctx.results / f"{ctx.name}_traces")
fsdp_bench.check_against_unsharded(ctx.result_path("check"))
fsdp_bench.run_fsdp_benchmark(config, world_size=world, backend=backend)
for large_config in fsdp_bench.large_model_configs(config, model=large) if large else []:
    fsdp_bench.attempt(large_config, world_size=world, backend=backend)
opt, fsdp = read_results(config.opt_path), read_results(config.fsdp_path)
gathers, check = read_results(config.gather_path), read_results(ctx.result_path("check"))
label = size_label(config.model, ctx.handout)
nb.md(f"Model **{label}**" + (f" (the `{config.model}` preset below)" if label != config.model else "")
      + f" ({get_config(config.model).n_params:,} parameters), context "
      f"{config.context_length}, global batch {config.batch_size} over {world} ranks (`{backend}`, {ctx.gpu}), "
      f"{config.warmup} warm-up and {config.steps} timed steps per variant; our FSDP prefetches {config.prefetch} unit."
      + ("" if report.measured(opt) else " On a CPU torch keeps no allocator statistics: memory columns are empty."))

# %% [markdown]
# ## The wrappers against unsharded training
#
# Two gloo ranks train a small Transformer 3 AdamW steps: the sharded optimizer on the same
# gradients as one process (bit equality expected: only who updates each parameter changes), FSDP
# on half batches against one process on the whole batch (equal to rounding).

# %%
nb.show(check, caption="largest weight difference from unsharded training, per rank")
c = check.iloc[0]
nb.answer(ctx, "optimizer_state_sharding", "",
          f"`ShardedOptimizer(params, optimizer_cls, **kwargs)` (`systems.parallel.sharded_optimizer`). Against "
          f"torch AdamW on {int(c['n_params']):,} parameters for {int(c['steps'])} steps on both ranks: bit-equal "
          f"{bool(check['sharded_bit_equal'].all())}, largest difference {check['sharded_max_abs_diff'].max():.2g}.")
if ctx.handout == "2026":
    nb.answer(ctx, "fsdp", "",
              f"`FSDP(module, compute_dtype=None)` (`systems.parallel.fsdp`). Against one process on the whole batch, "
              f"after {int(c['steps'])} steps, largest weight difference {check['fsdp_max_abs_diff'].max():.2g} "
              f"(weights reach {c['max_weight']:.2g}): the half batches' gradients are summed in another order.")

# %% [markdown]
# ## Optimizer-state sharding: memory and time
#
# `ddp`: DDP (per-parameter overlapped all-reduce) with torch AdamW; `ddp_sharded`: the same with
# `ShardedOptimizer(params, AdamW)`. MiB per rank (the larger of the two ranks): peaks after
# init, before the optimizer step (forward + backward), during the step, and what stays after it,
# each beside the accounting with the measured activations.

# %%
nb.show(report.memory_table(opt, model=config.model, world_size=world), caption="allocated MiB per rank: measured and expected")
nb.show(report.breakdown_table(opt, model=config.model, world_size=world), caption="what the memory is made of (MiB)")
nb.answer(ctx, "optimizer_state_sharding_accounting", "a",
          report.sharding_memory_answer(opt, model=config.model, world_size=world, handout=ctx.handout))
nb.answer(ctx, "optimizer_state_sharding_accounting", "b",
          report.sharding_time_answer(opt, model=config.model, handout=ctx.handout))
comm, mem = report.zero1_tables(get_config(config.model).n_params, world)
nb.show(comm, caption="communication per step (MiB sent per rank, ring collectives)")
nb.show(mem, caption="persistent memory per rank (MiB)")
nb.answer(ctx, "optimizer_state_sharding_accounting", "c", report.zero1_answer(get_config(config.model).n_params, world))

# %% [markdown]
# ## FSDP against torch's FSDP2
#
# Both shard every Transformer block as one unit (plus the embedding and LM head), use torch
# AdamW on the shards, and run fp32 and bf16 compute (fp32 master weights). Every handout size's
# weights, gradients, moments and step temporaries per rank, against one device's memory, say
# which sizes can train at all.

# %%
nb.show(report.fsdp_table(fsdp), caption="step time (ms, median of the slowest rank) and peak memory (MiB)")
nb.show(report.fsdp_ratios(fsdp, model=config.model), caption="ours / FSDP2 in the same run")
nb.save_figure(report.plot_fsdp(fsdp, model=config.model), ctx, "fsdp_vs_fsdp2")
device_bytes, device_name = report.device_memory()
sizes = {name: get_config(preset).n_params for name, preset in handout_sizes(ctx.handout).items()}
nb.show(report.sizes_frame(sizes, world_size=world, device_bytes=device_bytes),
        caption=f"GB per rank before activations on {world} ranks; fits: below {device_name}")
if ctx.handout == "2026":
    nb.answer(ctx, "fsdp_accounting", "a",
              report.fsdp_saving_answer(opt, fsdp, model=config.model, world_size=world, large=large,
                                        handout=ctx.handout))

# %% [markdown]
# ## Do the all-gathers finish before the layer needs them?
#
# One profiled step of our FSDP per precision (rank 0). Forward all-gathers run in issue order on
# the communication stream, so the k-th is the k-th unit's; *slack* = layer start - gather end,
# *stall* = compute-stream idle time before the layer that its gather explains.

# %%
if len(gathers):
    nb.show(report.gather_summary(gathers), caption="forward all-gathers, per precision")
    first = gathers["precision"].iloc[0]
    trace = gathers[gathers["precision"] == first]["trace"].iloc[0]
    nb.save_figure(report.plot_gathers(fsdp_bench.trace_timeline(trace), precision=first), ctx, "gather_timeline")
    nb.save_figure(report.plot_slack(gathers), ctx, "gather_slack")
if ctx.handout == "2026":
    nb.answer(ctx, "fsdp_accounting", "b", report.gather_answer(gathers, model=config.model, handout=ctx.handout))
