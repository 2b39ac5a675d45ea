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
# # 02 · Kernel profiling: where the time goes (nsys_profile)
# Which kernels do a forward pass and a full training step spend their time in? Each point runs
# the harness's step (warm-up, then timed steps without the profiler, then profiled steps) with
# named ranges for the phases and for the parts of attention; kernels are tied to ranges through
# the trace's launch correlation ids and summed like Nsight's kernel summary. 2025 handout: every
# size at contexts 128-1024; 2026: two sizes, each up to the longest power-of-two context whose
# train step fits. Points that run out of memory are rows with status `oom`.

# %% tags=["parameters"]
profile = "smoke"        # "smoke": debug models on the CPU; "full": the handout's sizes on a GPU
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's question and size table
sizes = None             # 2026: the two sizes to profile (default small and large); 2025: all sizes
budget_s = 330           # full profile: points that would start later are "skipped (budget)"

# %%
import torch

from systems.bench import profile as bench_profile
from systems.bench.budget import Budget
from systems.measure import profiler as profiling
from systems.measure.results import ResultWriter
from systems.report import kernel_profiling as kp
from systems.report import notebook as nb

ctx = nb.setup(name="02_kernel_profiling", profile=profile, out_dir=out_dir, handout=handout)
if not ctx.full:
    # the smoke model's operators are tiny: on a shared 2-core CPU, OpenMP threads spin-waiting on
    # each other cost more than the arithmetic (a sweep ran ~6x slower with 2 threads than with 1)
    torch.set_num_threads(1)
plan = bench_profile.handout_plan(ctx.handout, full=ctx.full, sizes=sizes, device=ctx.device)
summary, results = bench_profile.profile_sweep(
    plan, writer=ResultWriter(ctx.result_path("summary")), budget=Budget(budget_s if ctx.full else None),
    trace_dir=ctx.out_dir / "traces")
nb.md(kp.tool_note(nsys=profiling.nsys_available(), device=ctx.device))
nb.md(kp.coverage_text(summary, longest=plan.longest))
nb.show(kp.coverage_table(summary), caption="status of every point (ok, oom, or why it was skipped)")
# the detailed tables show the biggest size and context that ran
big, big_train = plan.largest(results, "forward"), plan.largest(results, "train_step")

# %% [markdown]
# ## (a) Forward time under the profiler against the harness
# `harness`: the unprofiled steps (the benchmarking harness's loop and timer, same model and
# process). `profiled`: the same loop under the profiler, so `profiled / harness − 1` is the
# profiler's overhead. `profiled span`: from the trace, the `forward` range's start to the end of
# its last kernel.

# %%
fwd_table = kp.forward_table(summary)
nb.show(fwd_table, caption="forward pass: harness vs profiler (ms per pass)")
nb.answer(ctx, "nsys_profile", "a", kp.answer_a(fwd_table, device=ctx.device))

# %% [markdown]
# ## (b) The top kernel of the forward pass

# %%
if big is not None:
    nb.show(results[big].kernels(ranges="forward", top=10).drop(columns="name"),
            caption=f"forward kernels, {big[0]} @ {big[1]} tokens (per step = per forward pass)")
top = kp.top_kernel_table(summary)
nb.show(top.drop(columns=["top_forward_name", "top_fwd_bwd_name"]),
        caption="top kernel by cumulative time: forward only, and forward+backward in a train step")
nb.answer(ctx, "nsys_profile", "b", kp.answer_b(top))

# %% [markdown]
# ## (c) What besides matrix multiplies takes forward time

# %%
fwd_shares = kp.forward_category_shares(summary)
if big is None:
    nb.not_run(ctx, "nsys_profile", "c", "no forward-only configuration fit in memory or the budget")
else:
    nb.show(kp.non_matmul_table(results[big]),
            caption=f"non-matmul forward kernels, {big[0]} @ {big[1]} tokens (share of all forward kernel time)")
    nb.show(fwd_shares, caption="forward: share of kernel time by category")
    nb.answer(ctx, "nsys_profile", "c", kp.answer_c(results[big], f"{big[0]} at {big[1]} tokens", fwd_shares))

# %% [markdown]
# ## (d) Matmul share: inference against a full training step
# Categories say what a kernel computes (from its name); the phase columns say where it ran (the
# `forward` / `backward` / `optimizer step` ranges), so the optimizer's kernels are counted as the
# elementwise work they are and still show up as the optimizer phase.

# %%
shares = kp.category_shares(summary)
nb.show(shares, caption="share of kernel time by category (what kernels compute) and by phase (where they ran)")
nb.save_figure(kp.plot_category_shares(shares, title=f"kernel time by category ({ctx.gpu}, fp32)"), ctx, "categories")
if big_train is not None:
    nb.show(results[big_train].range_totals(), caption=f"train step ranges, {big_train[0]} @ {big_train[1]} tokens")
    nb.show(results[big_train].kernels(ranges="optimizer step", top=8).drop(columns="name"),
            caption="optimizer-step kernels (our AdamW), by what they compute")
nb.answer(ctx, "nsys_profile", "d", kp.answer_d(shares, summary, device=ctx.device))

# %% [markdown]
# ## (e) Softmax against the two attention matmuls
# FLOPs are analytic: each of QKᵀ and PV costs 2·B·H·T²·d_head per layer (naive attention computes
# every pair, then masks); the softmax `flops.SOFTMAX_FLOPS_PER_ELEMENT` FLOPs per score element.
# Runtime: the kernels in the forward pass's `softmax` range against the matmul kernels in its
# `attention scores` and `final matmul` ranges. Rates: the softmax's least traffic (one read of the
# scores, one write of the probabilities) and its FLOPs over its time, against the GPU's named peaks.

# %%
soft = kp.softmax_table(summary, gpu=ctx.gpu)
nb.show(soft, caption="forward: softmax vs the attention matmuls (all layers, per pass)")
nb.answer(ctx, "nsys_profile", "e", kp.answer_e(soft))

# %% [markdown]
# ## One train step over time
# From the exported Chrome trace of the first train step profiled (open it in Perfetto for detail).

# %%
label, context, _ = plan.trace_point()
trace = bench_profile.trace_file(ctx.out_dir / "traces", plan.trace_point())
if trace.exists():
    fig = kp.plot_step_timeline(trace, title=f"one train step, {label} @ {context} tokens: kernels by category")
    nb.save_figure(fig, ctx, "train_step_timeline")

# %% [markdown]
# ## Nsight Systems
# Where `nsys` is on PATH, one train step also runs under `nsys profile --capture-range=nvtx` and
# `nsys stats --report cuda_gpu_kern_sum` is parsed into the same table.

# %%
if ctx.full and profiling.nsys_available() and big_train is not None:
    nsys_table = bench_profile.run_nsys(results[big_train].config, ctx.out_dir / "traces" / "nsys",
                                        steps=plan.profile_steps)
    nb.show(nsys_table.head(10).drop(columns="name"), caption=f"nsys cuda_gpu_kern_sum, {big_train[0]} train step")
