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
# How long do the forward pass, the backward pass and the optimizer step take for each model
# size, and how much does warm-up matter? Everything below is measured by `systems.bench.benchmark`
# in this run: `torch.cuda.synchronize()` after each phase, `timeit.default_timer`, warm-up
# steps outside the measured region.

# %% tags=["parameters"]
profile = "smoke"        # "smoke": debug model on CPU; "full": the handout sizes on a GPU
out_dir = "build/smoke"  # the runner injects this
context_length = None    # default: 512 (full), 64 (smoke)
sizes = None             # default: the handout sizes (full), ["debug"] (smoke)

# %%
from systems.report import notebook as nb
from systems.bench.benchmark import BenchmarkConfig, run_sweep
from systems.report.benchmarking import (backward_forward_answer, phase_table, plot_phases, plot_warmup,
                                      warmup_answer, warmup_table)
from systems.config import handout_sizes

ctx = nb.setup(name="01_benchmarking", profile=profile, out_dir=out_dir)
sizes = sizes or (list(handout_sizes("2025").values()) if ctx.full else ["debug"])
context_length = context_length or (512 if ctx.full else 64)
common = dict(context_length=context_length, batch_size=4, precision="fp32", device=ctx.device)

# %% [markdown]
# ## (a) The harness
#
# `systems.bench.benchmark.run_benchmark(BenchmarkConfig(...))` builds the model for a size name (or
# explicit hyperparameters), random token batches, and our AdamW; it runs `warmup_steps`
# untimed steps and then `measure_steps` timed ones of `forward`, `forward_backward` or
# `train_step`, under fp32 or bf16/fp16 autocast, optionally `torch.compile`d. Each record has
# mean and std of the step and of each phase, tokens/s, model FLOPs, MFU against the detected
# GPU's named peak, peak memory, and the environment. The same is a CLI:
# `python -m systems.bench.benchmark --model-size small --context-length 512 --mode train_step`.

# %% [markdown]
# ## (b) Forward, backward and optimizer step for every size (5 warm-up, 10 measured)

# %%
forward = run_sweep([BenchmarkConfig(model=s, mode="forward", **common) for s in sizes],
                    out_path=ctx.result_path("forward"))
train = run_sweep([BenchmarkConfig(model=s, mode="train_step", **common) for s in sizes],
                  out_path=ctx.result_path("train_step"))
nb.show(phase_table(forward + train), caption=f"fp32, batch 4, context {context_length}, on {ctx.gpu}")

# %%
fig = plot_phases(train, title=f"Train step phases, fp32, context {context_length} ({ctx.gpu})")
nb.save_figure(fig, ctx, "phases")

# %%
fwd_ok = {r["model"]: r for r in forward if r["status"] == "ok"}
lines = [f"- **{s}**: inference forward {nb.fmt_ms(fwd_ok[s]['forward_mean_s'])} "
         f"± {nb.fmt_ms(fwd_ok[s]['forward_std_s'])}" for s in sizes if s in fwd_ok]
for r in train:
    lines.append(f"- **{r['model']}** train step: " + (
        f"{nb.fmt_ms(r['step_mean_s'])} ± {nb.fmt_ms(r['step_std_s'])}" if r["status"] == "ok" else r["status"].upper()))
nb.md("**Answer (b).** " + backward_forward_answer(train) + "\n\n" + "\n".join(lines))

# %% [markdown]
# ## (c) Warm-up: 0, 1 and 2 warm-up steps
#
# Each point runs in a fresh process, so "no warm-up" really is a cold start (CUDA context,
# cuBLAS handles and the allocator are all new), as it would be in a standalone script.

# %%
warm = run_sweep([BenchmarkConfig(model=s, mode="train_step", warmup=w, **common)
                  for s in sizes for w in (0, 1, 2)], out_path=ctx.result_path("warmup"), isolate=True)
wt = warmup_table(warm)
nb.show(wt, caption="Measured-step statistics by number of warm-up steps (each run a fresh process)")

# %%
fig = plot_warmup(warm, title=f"Per-step train-step time after 0 / 1 / 2 warm-up steps ({ctx.gpu})")
nb.save_figure(fig, ctx, "warmup")

# %%
nb.md("**Answer (c).** " + warmup_answer(wt, device=ctx.device))
