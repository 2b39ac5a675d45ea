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
# # 04 · Memory: snapshots, timelines, saved tensors and checkpointing
# Where does a training step's memory go? For the handout's model and contexts (2026: xl at 128 and
# 2048; 2025: 2.7B at 128, 256 and 512; batch 4) we record allocator snapshots of the measured step,
# draw them offline as "Active memory timelines", tabulate forward and training-step peaks in fp32
# and bf16 autocast, read the forward's snapshot, and measure what one block saves for backward and
# what its backward leaves. 2026 adds gradient checkpointing: the memory-optimal nesting, and the
# best one-level group size for xl at batch 4 × context 2048.

# %% tags=["parameters"]
profile = "smoke"        # "smoke": debug model on the CPU (< 90 s); "full": one GPU (~2 min on an H100)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2026" (xl, contexts 128 and 2048) or "2025" (2.7B, contexts 128, 256, 512)

# %%
import matplotlib.pyplot as plt

from systems.bench import memory as bench
from systems.config import get_config, preset_of
from systems.report import memory as report
from systems.report import notebook as nb

ctx = nb.setup(name="04_memory", profile=profile, out_dir=out_dir, handout=handout)
asked = bench.handout_profile(ctx.handout)
if ctx.full:
    MODEL, CONTEXTS, BATCH, DEVICE = preset_of(asked.size, ctx.handout), asked.contexts, asked.batch_size, "cuda"
    CKPT = bench.CHECKPOINT_RUN
    STRATEGIES = dict(layers=(8, 16, 32), batch_size=8, context_length=256)
else:  # the debug model on the CPU: the same code paths, peaks from the profiler and a tensor tracker
    MODEL, CONTEXTS, BATCH, DEVICE = "debug", (32, 128), 2, "cpu"
    CKPT = dict(model="debug", model_overrides={"n_layers": 4}, batch_size=2, context_length=32)
    STRATEGIES = dict(layers=(2, 4), batch_size=1, context_length=32)
cfg = get_config(MODEL)
label = report.model_label(MODEL, ctx.handout, stands_for=asked.size)
source = "CUDA caching allocator" if ctx.full else "CPU profiler snapshots: no allocator rounding or caching"
nb.md(f"Model **{label}** (d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_layers} layers, {cfg.n_heads} heads), "
      f"batch {BATCH}, contexts {list(CONTEXTS)}, on {ctx.gpu}; peaks from the {source}.")

# %% [markdown]
# ## Peak memory sweep: forward and training step, fp32 and bf16 autocast
# Through the benchmark harness: one warm-up step (it creates the AdamW state), then the measured
# step with the allocator history recorded and a step marker after it; out of memory is a row.

# %%
rows = bench.run_peak_sweep(model=MODEL, contexts=CONTEXTS, batch_size=BATCH, device=DEVICE,
                            snapshot_dir=ctx.out_dir / "snapshots", snapshot_precisions=("fp32", "bf16"),
                            out_path=ctx.result_path("peaks"))

# %% [markdown]
# ## (a) Active memory timelines: forward only, and a full training step
# Drawn offline from the snapshots, the memory_viz page beside each. Phases come from each
# allocation's stack: the model's `forward`, autograd's `backward` (its thread's allocations have
# no Python frames and take the phase before them), the optimizer's `step`.

# %%
timelines = report.draw_timelines(rows, figures=ctx.figures, stem=ctx.name, label=label)
nb.md(report.timeline_links(timelines, figures=ctx.figures, stem=ctx.name, out_dir=ctx.out_dir))
nb.answer(ctx, "memory_profiling", "a", report.timeline_answer(timelines, cfg=cfg))

# %% [markdown]
# ## (b) Peak memory per context length (fp32)

# %%
nb.show(report.peak_table(rows, "fp32"), caption=f"{label}, batch {BATCH}, fp32: peak memory")
nb.answer(ctx, "memory_profiling", "b", report.peak_answer(rows, label=label, source=source))

# %% [markdown]
# ## (c) The same under bf16 autocast
# "peak in": the phase where the step's high-water mark stopped rising.

# %%
nb.show(report.precision_table(rows), caption=f"{label}, batch {BATCH}: fp32 against bf16 autocast")
nb.answer(ctx, "memory_profiling", "c", report.precision_answer(rows, cfg=cfg, label=label))

# %% [markdown]
# ## (d) One residual-stream activation, derived and found in the forward's snapshot

# %%
forward = report.snapshot_row(rows, "forward")
nb.answer(ctx, "memory_profiling", "d", report.residual_answer(cfg=cfg, batch_size=BATCH, contexts=CONTEXTS,
                                                              snapshot_row_=forward, label=label))

# %% [markdown]
# ## (e) The largest allocations of the forward pass, and the code that makes them

# %%
if forward is None:
    nb.not_run(ctx, "memory_profiling", "e", "no forward pass ran with a snapshot")
else:
    largest = report.largest_table(forward, cfg=cfg)
    nb.show(largest.drop(columns=["size_bytes"]), caption=f"forward, context {forward['context_length']}: largest")
    nb.answer(ctx, "memory_profiling", "e", report.largest_answer(largest, forward))

# %% [markdown]
# ## (f) What one block saves for backward, and the gradients its backward leaves (2026)
# Saved tensors via `saved_tensors_hooks` (each storage once, charged to the op that keeps it);
# gradients from the allocator: what a forward and backward of the block leaves allocated.

# %%
if report.asked(ctx.handout, "memory_profiling", "f"):
    block = bench.measure_block(model=MODEL, batch_size=BATCH, context_length=max(CONTEXTS), device=DEVICE,
                                out_path=ctx.result_path("block"))
    nb.show(report.block_ops_table(block), caption=f"one block, batch {BATCH} × context {max(CONTEXTS)}: top five ops")
    nb.answer(ctx, "memory_profiling", "f", report.block_answer(block, label=label))

# %% [markdown]
# ## Gradient checkpointing (a): the memory-optimal nesting (2026)
# The debug model with N blocks under four strategies, forward + backward with the gradients kept
# allocated between steps, so the peak above the step's start is activations.

# %%
if report.asked(ctx.handout, "gradient_checkpointing"):
    strategies = bench.run_checkpoint_strategies(device=DEVICE, out_path=ctx.result_path("checkpoint_strategies"),
                                                 **STRATEGIES)
    nb.show(report.strategies_table(strategies), caption="checkpointing strategies on the debug model")
    fig = report.strategies_figure(strategies, title=f"debug model, batch {STRATEGIES['batch_size']} × "
                                   f"context {STRATEGIES['context_length']}")
    nb.save_figure(fig, ctx, "checkpoint_strategies")
    plt.show()
    nb.answer(ctx, "gradient_checkpointing", "a", report.plan_answer(strategies))

# %% [markdown]
# ## Gradient checkpointing (b): one level, every group size (2026)
# xl at batch 4 × context 2048 (smoke: debug), non-reentrant `torch.utils.checkpoint` over groups of
# k blocks, AdamW step; forward + backward and optimizer peaks apart. TF32 changes time, not memory.

# %%
if report.asked(ctx.handout, "gradient_checkpointing"):
    ck_block = bench.measure_block(device=DEVICE, out_path=ctx.result_path("checkpoint_block"), **CKPT)
    groups = bench.run_checkpoint_groups(device=DEVICE, out_path=ctx.result_path("checkpoint_groups"), **CKPT)
    nb.show(report.groups_table(groups, block=ck_block), caption=f"{label}, batch {CKPT['batch_size']} × context "
            f"{CKPT['context_length']}: one level of checkpointing")
    if any(r["status"] == "ok" for r in groups):
        nb.save_figure(report.groups_figure(groups, title=f"{label}, batch {CKPT['batch_size']} × context "
                                            f"{CKPT['context_length']}"), ctx, "checkpoint_groups")
        plt.show()
    nb.answer(ctx, "gradient_checkpointing", "b", report.groups_answer(groups, block=ck_block, label=label))
