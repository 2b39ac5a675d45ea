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
# How much memory does sharding save, and what does it cost in time? On 2 ranks with the xl model
# (context 512, global batch 4) we measure DDP with and without a sharded optimizer
# (`systems.parallel.sharded_optimizer.ShardedOptimizer`), then our fully sharded wrapper
# (`systems.parallel.fsdp.FSDP`) against torch's FSDP2 (`fully_shard`) in the same run, and read a
# profiler trace to see whether each layer's all-gather finishes before the layer needs it.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (2 gloo ranks on CPU, < 90 s) or "full" (NCCL on two or more GPUs, < 6 min)
out_dir = "build/smoke"  # the runner injects this

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch

from systems.report import notebook as nb
from systems.analysis import sharding
from systems.bench import fsdp as fsdp_bench
from systems.report import sharding_fsdp as sharding_report
from systems.measure.results import read_results

ctx = nb.setup(name="08_sharding_fsdp", profile=profile, out_dir=out_dir)
if ctx.full:
    if torch.cuda.device_count() < 2:
        raise RuntimeError("the full profile needs at least 2 GPUs (one NCCL rank per GPU)")
    BACKEND = "nccl"
    config = fsdp_bench.FSDPBenchConfig(model="xl-2025", context_length=512, batch_size=4, warmup=2, steps=5)
else:  # the debug model on 2 CPU processes: same code paths, no allocator statistics
    BACKEND = "gloo"
    config = fsdp_bench.FSDPBenchConfig(model="debug", context_length=64, batch_size=4, warmup=1, steps=3)
config.opt_path = str(ctx.result_path("optimizer"))
config.fsdp_path = str(ctx.result_path("fsdp"))
config.gather_path = str(ctx.result_path("gathers"))
config.trace_dir = str(ctx.results / "08_sharding_fsdp_traces")
nb.md(f"Model **{config.model}**, context {config.context_length}, global batch {config.batch_size} over 2 ranks "
      f"(`{BACKEND}`), {config.warmup} warm-up and {config.steps} timed steps per variant; our FSDP prefetches "
      f"{config.prefetch} unit(s) ahead.")

# %%
import time

t0 = time.perf_counter()
fsdp_bench.run_fsdp_benchmark(config, world_size=2, backend=BACKEND)
opt_df = read_results(config.opt_path)
fsdp_df = read_results(config.fsdp_path)
gather_df = read_results(config.gather_path)
nb.md(f"Benchmark ran in {time.perf_counter() - t0:.0f} s.")
has_memory = opt_df["peak_fwd_bwd"].notna().any()
if not has_memory:
    nb.md("On the CPU torch keeps no allocator statistics: the memory columns are empty and only the "
          "computed accounting and the timings below carry numbers. The full profile fills them.")

# %% [markdown]
# ## Optimizer-state sharding: memory and time
# `ddp`: DDP (per-parameter overlapped all-reduce) with our AdamW; `ddp_sharded`: the same with
# `ShardedOptimizer(params, AdamW)`. Memory in MiB, per rank (the larger of the two ranks).

# %%
MiB = 2**20
mem_cols = ["peak_after_init", "peak_fwd_bwd", "mem_after_step", "peak_opt_step"]
table = opt_df.set_index("variant")[mem_cols + ["step_ms", "step_ms_p10", "step_ms_p90"]].copy()
table[mem_cols] = table[mem_cols] / MiB
nb.show(table, caption="peak memory (MiB) after init, during forward+backward, after and during the optimizer step")

parts = ["params", "grads", "opt_state"]
rows = []
for _, r in opt_df.iterrows():
    measured = {"params": r.get("mem_after_init"), "grads": r.get("grads_measured"),
                "opt_state": r.get("opt_state_bytes"), "activations": r.get("activations_measured")}
    for part in parts + ["activations"]:
        rows.append({"variant": r["variant"], "part": part,
                     "computed_MiB": (r.get(f"{part}_computed") / MiB) if part != "activations" else None,
                     "measured_MiB": None if measured[part] is None or pd.isna(measured[part]) else measured[part] / MiB})
breakdown = pd.DataFrame(rows)
nb.show(breakdown.pivot(index="part", columns="variant", values=["computed_MiB", "measured_MiB"]),
        caption="breakdown: computed from the parameter count vs measured (allocator deltas; state from the optimizer)")

# %%
ddp, sharded = (opt_df.set_index("variant").loc[v] for v in ("ddp", "ddp_sharded"))
n_params = int(ddp["n_params"])
state_saved = ddp["opt_state_bytes"] - sharded["opt_state_bytes"]
time_ratio = sharded["step_ms"] / ddp["step_ms"]
text = (f"**Answer (optimizer_state_sharding_accounting).** The model has {n_params / 1e9:.3g} B parameters, so "
        f"fp32 weights and gradients take {4 * n_params / MiB:,.0f} MiB each and AdamW's two moments "
        f"{8 * n_params / MiB:,.0f} MiB. Sharding the optimizer keeps {sharded['opt_state_bytes'] / MiB:,.0f} MiB of "
        f"state on the fuller rank instead of {ddp['opt_state_bytes'] / MiB:,.0f} MiB "
        f"({state_saved / MiB:,.0f} MiB saved; the split is by whole parameters, so it is close to but not "
        f"exactly half). ")
if has_memory:
    text += (f"Measured peaks: after init {ddp['peak_after_init'] / MiB:,.0f} vs {sharded['peak_after_init'] / MiB:,.0f} MiB "
             f"(identical: no state exists yet); during forward+backward {ddp['peak_fwd_bwd'] / MiB:,.0f} vs "
             f"{sharded['peak_fwd_bwd'] / MiB:,.0f} MiB and during the step {ddp['peak_opt_step'] / MiB:,.0f} vs "
             f"{sharded['peak_opt_step'] / MiB:,.0f} MiB (without vs with sharding): the saving is the state, "
             f"{(ddp['peak_fwd_bwd'] - sharded['peak_fwd_bwd']) / MiB:,.0f} MiB at the forward+backward peak. "
             f"The computed breakdown (params + grads + state + the measured activations) predicts "
             f"{ddp['predicted_peak_fwd_bwd'] / MiB:,.0f} and {sharded['predicted_peak_fwd_bwd'] / MiB:,.0f} MiB, an upper "
             f"bound because backward frees activations while it allocates gradients. ")
text += (f"Time per iteration: {ddp['step_ms']:.1f} ms without and {sharded['step_ms']:.1f} ms with sharding "
         f"(×{time_ratio:.2f}): the step updates half the parameters but then broadcasts them.")
nb.md(text)

# %% [markdown]
# ### How this differs from ZeRO stage 1
# Per-rank bytes sent per step (ring collectives) and persistent memory per rank for this model on 2 ranks.

# %%
comm = pd.DataFrame(sharding.communication_per_step(n_params, 2))
comm["GiB_per_rank"] = comm.pop("bytes_per_rank") / 2**30
mem = pd.DataFrame(sharding.memory_per_rank(n_params, 2))
mem[["params", "grads", "opt_state"]] = mem[["params", "grads", "opt_state"]] / 2**30
mem["total_GiB"] = mem[["params", "grads", "opt_state"]].sum(axis=1)
nb.show(comm, caption="communication per step (GiB sent per rank)")
nb.show(mem, caption="persistent memory per rank (GiB)")
c = comm.set_index("scheme")["GiB_per_rank"]
nb.md(f"**Answer (ZeRO-1 comparison).** Memory is the same as ZeRO-1's: both keep full fp32 weights and "
      f"gradients and 1/N of the optimizer state ({mem.loc[1, 'total_GiB']:.1f} GiB per rank here vs "
      f"{mem.loc[0, 'total_GiB']:.1f} GiB for DDP). Communication differs: we all-reduce all gradients "
      f"({c.iloc[0]:.2f} GiB per rank) and then broadcast the updated parameters "
      f"(+{c.iloc[1] - c.iloc[0]:.2f} GiB), {c.iloc[1]:.2f} GiB in total, while ZeRO-1 reduce-scatters the gradients "
      f"(each rank only needs its shard's) and all-gathers the parameters, {c.iloc[2]:.2f} GiB, the same as plain "
      f"DDP: ours sends {c.iloc[1] / c.iloc[2]:.2f}× ZeRO-1's volume. The measured cost of that extra broadcast is "
      f"in the step times above ({sharded['step_ms'] - ddp['step_ms']:+.1f} ms per step).")

# %% [markdown]
# ## FSDP against torch's FSDP2
# Both shard every Transformer block as one unit (plus the embedding and LM head), use
# `torch.optim.AdamW` on the shards, and run fp32 and bf16 compute (fp32 master weights).

# %%
f = fsdp_df.copy()
for col in ["peak_after_init", "peak_fwd_bwd", "peak_opt_step"]:
    f[col] = f[col] / MiB
nb.show(f[["precision", "variant", "status", "step_ms", "step_ms_p10", "step_ms_p90",
           "peak_after_init", "peak_fwd_bwd", "peak_opt_step"]],
        caption="step time (ms, median of the slowest rank) and peak memory (MiB)")

ratios = []
for precision, g in fsdp_df[fsdp_df["status"] == "ok"].groupby("precision", sort=False):
    by = g.set_index("variant")
    if {"fsdp", "fsdp2"} <= set(by.index):
        peak = lambda v: max(by.loc[v, "peak_fwd_bwd"] or 0, by.loc[v, "peak_opt_step"] or 0) or None  # noqa: E731
        ratios.append({"precision": precision, "step_time_ratio": by.loc["fsdp", "step_ms"] / by.loc["fsdp2", "step_ms"],
                       "peak_memory_ratio": None if peak("fsdp2") is None else peak("fsdp") / peak("fsdp2")})
ratios = pd.DataFrame(ratios)
nb.show(ratios, caption="ours / FSDP2 in the same run (acceptance: time <= 1.05, memory <= 1)")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
for ax, col, label in ((axes[0], "step_ms", "step time (ms)"), (axes[1], "peak_fwd_bwd", "peak memory (MiB)")):
    piv = f[f["status"] == "ok"].pivot(index="precision", columns="variant", values=col)
    if piv.notna().any().any():
        piv.plot.bar(ax=ax, rot=0)
    ax.set_ylabel(label)
axes[0].set_title("ours vs FSDP2: step time")
axes[1].set_title("ours vs FSDP2: peak memory" + ("" if has_memory else " (not measured on CPU)"))
fig.tight_layout()
nb.save_figure(fig, ctx, "fsdp_vs_fsdp2")

# %%
fp32 = fsdp_df[(fsdp_df["precision"] == "fp32") & (fsdp_df["status"] == "ok")].set_index("variant")
world = 2
state_bytes_full = 16 * n_params  # fp32 params + grads + AdamW moments per replica
expected_saving = state_bytes_full * (1 - 1 / world)
text = (f"**Answer (fsdp_accounting, memory).** Without sharding every rank holds 16 bytes per parameter "
        f"({state_bytes_full / MiB:,.0f} MiB); FSDP keeps 1/{world} of the weights, gradients and moments, so it "
        f"should save {expected_saving / MiB:,.0f} MiB, minus the gathered layers in flight (the current and "
        f"{config.prefetch} prefetched unit(s)) and the gradient buffers waiting for reduce-scatter. ")
if has_memory and "fsdp" in fp32.index:
    measured_saving = ddp["peak_opt_step"] - fp32.loc["fsdp", "peak_opt_step"]
    measured_saving_fb = ddp["peak_fwd_bwd"] - fp32.loc["fsdp", "peak_fwd_bwd"]
    text += (f"Measured against DDP (fp32, same batch): {measured_saving / MiB:,.0f} MiB at the optimizer-step peak "
             f"({measured_saving / expected_saving:.0%} of expected) and {measured_saving_fb / MiB:,.0f} MiB at the "
             f"forward+backward peak, where DDP has no optimizer-state difference to add but holds full gradients. ")
for _, r in ratios.iterrows():
    text += (f"In {r['precision']}, our step takes {r['step_time_ratio']:.2f}× FSDP2's"
             + (f" and peaks at {r['peak_memory_ratio']:.2f}× its memory. " if pd.notna(r["peak_memory_ratio"]) else ". "))
nb.md(text)

# %% [markdown]
# ## Do the all-gathers finish before the layer needs them?
# One profiled step of our FSDP per precision (rank 0). Forward all-gathers run in issue order on the
# communication stream, so the k-th is the k-th unit's; *slack* = layer start − gather end, *stall* =
# compute-stream idle time before the layer that its gather explains.

# %%
if len(gather_df):
    summary = gather_df.groupby("precision", sort=False).agg(
        units=("unit", "count"), in_time=("in_time", "sum"), gather_ms_median=("gather_ms", "median"),
        slack_ms_median=("slack_ms", "median"), stall_ms_total=("stall_ms", "sum"))
    nb.show(summary, caption="forward all-gathers: per precision")
    precision0 = gather_df["precision"].iloc[0]
    timeline = fsdp_bench.trace_timeline(gather_df[gather_df["precision"] == precision0]["trace"].iloc[0])
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.5))
    fwd_end = timeline["units"][-1][2] if timeline["units"] else None
    sharding_report.plot_timeline(axes[0], timeline, title=f"{precision0}: whole step (ours)")
    if timeline["units"]:
        n_show = min(5, len(timeline["units"]))
        sharding_report.plot_timeline(axes[1], timeline, title=f"{precision0}: first {n_show} units of the forward",
                                 window=(timeline["units"][0][1] - 0.2 * (timeline["units"][n_show - 1][2] - timeline["units"][0][1]),
                                         timeline["units"][n_show - 1][2]))
    fig.tight_layout()
    nb.save_figure(fig, ctx, "gather_timeline")
    fig, ax = plt.subplots(figsize=(10, 3))
    for precision, g in gather_df.groupby("precision", sort=False):
        ax.plot(g["order"], g["slack_ms"], marker="o", ms=3, label=f"{precision} slack")
        ax.plot(g["order"], g["stall_ms"], ls="--", label=f"{precision} stall")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("unit, in forward order")
    ax.set_ylabel("ms")
    ax.legend()
    ax.set_title("forward all-gathers: slack before each layer and compute stall")
    nb.save_figure(fig, ctx, "gather_slack")
    lines = []
    for precision, r in summary.iterrows():
        lines.append(f"in {precision}, {int(r['in_time'])} of {int(r['units'])} forward gathers had finished before "
                     f"the compute stream reached their layer (median gather {r['gather_ms_median']:.3f} ms, "
                     f"median slack {r['slack_ms_median']:.3f} ms), and waiting for gathers idled the compute "
                     f"stream {r['stall_ms_total']:.3f} ms in total over the forward")
    first = gather_df[gather_df["order"] == 0]
    late_first = ", ".join(f"{r['precision']} ({r['stall_ms']:.3f} ms stall)" for _, r in first.iterrows() if not r["in_time"])
    nb.md("**Answer (fsdp_accounting, overlap).** " + "; ".join(lines) + "."
          + (f" The first unit's gather is late in {late_first}: it is issued when the step starts, with no "
             "earlier layer to hide behind." if late_first else ""))
else:
    nb.md("No trace was recorded (profiling off).")
