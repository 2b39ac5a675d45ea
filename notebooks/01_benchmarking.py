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
# # 01 · End-to-end benchmarking (benchmarking_script)
#
# How long do the forward pass, the backward pass and the optimizer step take for each size of
# the selected handout's Table 1, and how much does warm-up matter? Everything below is measured
# by `systems.bench.benchmark` in this run: `torch.cuda.synchronize()` after each phase,
# `timeit.default_timer`, warm-up steps outside the measured region, fp32 (TF32 off).

# %% tags=["parameters"]
profile = "smoke"        # "smoke": debug model on CPU; "full": the handout sizes on a GPU
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": whose Table 1 of sizes
context_length = None    # default: 512 (full), 64 (smoke)
timing_budget_s = 150    # full profile: (b) points that would start later are "skipped (budget)"
warmup_budget_s = 270    # full profile: the same for (c)'s fresh processes

# %%
from systems.bench.benchmark import BenchmarkConfig, run_sweep, warmup_sweep
from systems.bench.budget import Budget
from systems.config import handout_sizes
from systems.report import benchmarking as report
from systems.report import notebook as nb

ctx = nb.setup(name="01_benchmarking", profile=profile, out_dir=out_dir, handout=handout)
sizes = handout_sizes(ctx.handout) if ctx.full else {"debug": "debug"}  # the handout's names -> presets
context_length = context_length or (512 if ctx.full else 64)
common = dict(context_length=context_length, batch_size=4, precision="fp32", device=ctx.device)

# %% [markdown]
# ## (a) The harness

# %%
nb.answer(ctx, "benchmarking_script", "a", report.harness_answer(ctx.handout))

# %% [markdown]
# ## (b) Forward, backward and optimizer step for every size (5 warm-up, 10 measured)
# Inference (`forward`: no autograd graph) and the full train step, whose phases are timed
# separately; sizes run smallest first, and one that does not fit is a row with status `oom`.

# %%
timing_budget = Budget(timing_budget_s if ctx.full else None)
configs = [BenchmarkConfig(model=p, mode=m, **common) for m in ("forward", "train_step") for p in sizes.values()]
records = run_sweep(configs, out_path=ctx.result_path("timings"), budget=timing_budget)
forward = [r for r in records if r["mode"] == "forward"]
train = [r for r in records if r["mode"] == "train_step"]
nb.show(report.phase_table(records, handout=ctx.handout),
        caption=f"fp32, batch 4, context {context_length}, on {ctx.gpu}; {report.peak_note(records)}")

# %%
fig = report.plot_phases(train, title=f"Train step phases, fp32, context {context_length} ({ctx.gpu})",
                         handout=ctx.handout)
nb.save_figure(fig, ctx, "phases")

# %%
nb.answer(ctx, "benchmarking_script", "b", report.answer_b(forward, train, handout=ctx.handout))

# %% [markdown]
# ## (c) Warm-up: 0, 1 and 2 warm-up steps
#
# Each point runs in a fresh process, so "no warm-up" really is a cold start (CUDA context,
# cuBLAS handles and the allocator are all new), as it would be in a standalone script: the train
# step of every size that ran in (b), 10 measured steps each.

# %%
warm = warmup_sweep(train, warmups=(0, 1, 2), out_path=ctx.result_path("warmup"),
                    budget=Budget(warmup_budget_s if ctx.full else None))
table = report.warmup_table(warm, handout=ctx.handout)
nb.show(table, caption="Measured-step statistics by number of warm-up steps (each run a fresh process)")

# %%
fig = report.plot_warmup(warm, title=f"Per-step train-step time after 0 / 1 / 2 warm-up steps ({ctx.gpu})",
                         handout=ctx.handout)
nb.save_figure(fig, ctx, "warmup")

# %%
nb.answer(ctx, "benchmarking_script", "c", report.warmup_answer(table, device=ctx.device))
