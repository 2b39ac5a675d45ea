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
# # 10 · A fast full training step
# How fast can one full training step (batch 4 x context 512, bf16 autocast over fp32 master
# weights: forward, cross-entropy, backward, AdamW) run on one GPU for the 2.7B preset (the 2026
# handout's xl) and the 2025 handout's xl, and what does each lever buy? Hugging Face's
# `LlamaForCausalLM` (the same architecture, SDPA attention, torch's fused AdamW) is the baseline in
# the same run; our model runs eager, with its blocks compiled, with the fused kernels of
# `systems/kernels/` (an LM head + cross-entropy that never materialises the logits; an AdamW that
# updates p, m and v in one Triton pass), with all of them (`ours_fast`), then with bf16 weights
# and fp32 masters in the optimizer (`ours_master`: bit-identical to autocast on a CPU), per-block
# CUDA graphs (`ours_graphs`), Q, K, V and SwiGLU's W1, W3 each computed as one GEMM
# (`*_fusedproj`), the fp32 masters kept as the bf16 weight plus 16 low bits (`*_split`), and the
# optimizer inside the backward on a side stream (`*_overlap`; `*_sm16`: with 16 SMs left to it),
# and the whole step, updates included, captured and replayed as one CUDA graph (`ours_stepgraph_*`).
# The variants are data in `systems.bench.train_step.VARIANTS`, the lever comparisons in `LEVERS`.
# Then the 2026 handout's leaderboard: the 8B model's full step on two GPUs.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, debug model, < 60 s) or "full" (GPU, < 8 min on one H100)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's names and questions

# %%
from systems.bench import gemms
from systems.bench import leaderboard as lbd
from systems.bench import train_step as ts
from systems.measure.env import REPO_ROOT
from systems.measure.hardware import measure_matmul_tflops
from systems.measure.results import ResultWriter
from systems.report import fast_train_step as report
from systems.report import kernel_profiling
from systems.report import notebook as nb

ctx = nb.setup(name="10_fast_train_step", profile=profile, out_dir=out_dir, handout=handout)
plan = ts.FULL_PLAN if ctx.full else ts.SMOKE_PLAN

# %% [markdown]
# ## The step, per variant
# MFU is relative to the bf16 matmul rate measured at the start of this run (cuBLAS, 8192^3: the
# rate a step's matmuls could reach on this GPU), not to a datasheet number; a CPU has none.

# %%
peak_tflops = measure_matmul_tflops(n=8192) if ctx.full else None
if peak_tflops:
    nb.md(report.peak_line(peak_tflops, gpu=ctx.gpu))
trace_path = ctx.out_dir / "traces" / f"{ctx.name}_{plan.trace[0]}_{plan.trace[1]}.json"
writer = ResultWriter(ctx.result_path("steps"))
rows = []
for model, variants in plan.variants.items():
    rows += ts.run_variants(model=model, variants=variants, writer=writer,
                            peak_flops=peak_tflops * 1e12 if peak_tflops else None,
                            trace_variant=plan.trace[1] if model == plan.trace[0] else None, trace_path=trace_path,
                            **plan.step)
table = report.step_table(rows, handout=ctx.handout)
step = plan.step
nb.show(table, caption=f"Full training step, batch {step['batch_size']} x context {step['context_length']}, bf16 "
                       f"autocast, {step['steps']} timed steps after {step['warmup']} warm-up ({ctx.gpu})"
                       + (f"; MFU of the measured {peak_tflops:.0f} TFLOP/s" if peak_tflops else ""))

# %%
fig = report.plot_phases(table, title=f"Where a step's time goes, per variant ({ctx.gpu})")
nb.save_figure(fig, ctx, "phases")

# %%
nb.md(report.step_answer(table, targets=ts.OUR_TARGETS_MS, target_gpu=ts.OUR_TARGETS_GPU, gpu=ctx.gpu,
                          handout=ctx.handout,
                          peak_label=f"{peak_tflops:.0f} TFLOP/s bf16 matmul peak measured above" if peak_tflops else None))

# %% [markdown]
# ## What each lever buys
# Each line compares two variants of the same run that differ by one lever (`LEVERS`): the step
# time saved, and how each phase's median changed (negative: faster). With the optimizer inside
# the backward the update's time moves from the optimizer phase into the backward's; what it
# saves overall is the overlap. `beyond_spread` says whether neither variant's median step time
# lies inside the other's p10-p90 range (empty where a spread was not measured): where one does,
# a machine whose speed wanders between the two variants' blocks of steps can give the lever
# either sign.

# %%
levers = report.lever_table(table)
nb.show(levers, caption=f"Levers, each against the variant without it, same run ({ctx.gpu})")
nb.md(report.lever_answer(levers))

# %% [markdown]
# ## One step of the profiled variant
# `torch.profiler` over one warm step; kernels grouped into categories (`systems.measure.profiler`),
# phases shaded.

# %%
items, phases, cats = report.step_profile(trace_path)
nb.show(cats, caption=f"{plan.trace[0]} `{plan.trace[1]}`: kernel time per category in one step ({ctx.gpu})")
nb.show(phases, caption="per phase: wall time and kernel time in the step")
fig = kernel_profiling.plot_step_timeline(trace_path, title=f"{plan.trace[0]} `{plan.trace[1]}`, one step ({ctx.gpu})")
nb.save_figure(fig, ctx, "timeline")
timed = table.set_index(["model", "variant"]).loc[plan.trace, "step_ms"]
nb.md(report.profile_answer(items, phases, cats, timed_ms=timed))

# %% [markdown]
# ## The matmuls of one block, shape by shape
# Each Linear runs three GEMMs per step (forward, input gradient, weight gradient). At the full
# profile's 2,048 tokens (batch 4 x 512) some are too small to fill the GPU, so their rate, not
# the peak, is what the step's matmul time is made of. Each is timed alone here
# (`systems.bench.gemms`), with the separate projections beside the fused ones (QKV as one GEMM,
# W1/W3 as one): the fusion's gain on the GEMMs themselves, to set against what the `*_fusedproj`
# levers above measured on the whole step.

# %%
gemm_rows = gemms.run_gemms(list(plan.variants), tokens=step["batch_size"] * step["context_length"],
                            device=ctx.device, peak_tflops=peak_tflops, writer=ResultWriter(ctx.result_path("gemms")))
gemm_tab = report.gemm_table(gemm_rows)
nb.show(gemm_tab, caption=f"Each GEMM of one block timed alone, bf16 ({ctx.gpu})")
fig = report.plot_gemms(gemm_tab, title=f"GEMM rates of one block ({ctx.gpu})", peak_tflops=peak_tflops)
nb.save_figure(fig, ctx, "gemms")
matmul_ms = cats.set_index("category")["ms_per_step"].get("matmul")
nb.md(report.gemm_answer(gemm_rows, traced=(*plan.trace, matmul_ms) if matmul_ms is not None else None))

# %% [markdown]
# ## The 2026 leaderboard: the 8B step on two GPUs
# The 8B model (vocab 151,936, d 4096, d_ff 11,008, 34 layers, 32 heads), global batch 2 x context
# 32,768, bf16 autocast over fp32 weights, summed cross-entropy, AdamW (`systems.bench.leaderboard`:
# one sequence per rank, bucketed DDP, ZeRO-1 sharded fused AdamW, every block compiled and
# checkpointed but for its attention output, which the backward reuses instead of recomputing, the
# fused LM head + loss, our Triton FlashAttention-2), each step timed by CUDA events, a step lasting
# as long as its slower rank. On a node with two GPUs of enough memory this cell runs it; elsewhere
# it shows a row of `results/12_leaderboard_8b.jsonl` that measured this configuration on such GPUs
# (the last with our attention, else the last), with the commit, machine and attention it ran.

# %%
why_not = lbd.gpus_can_run() if ctx.full else "the smoke profile runs on a CPU"
if why_not is None:
    lbd.run_leaderboard(lbd.LeaderboardConfig(out_path=str(ctx.results / "12_leaderboard_8b.jsonl")), world_size=2)
lb_row, lb_file, passed_over = report.leaderboard_row([ctx.results / "12_leaderboard_8b.jsonl",
                                                       REPO_ROOT / lbd.COMMITTED_ROWS])
if passed_over:
    nb.md("Rows that are not the leaderboard's configuration, not shown: " + "; ".join(passed_over[:3]))
if lb_row is not None:
    nb.show(report.leaderboard_table(lb_row), caption=f"8B leaderboard step ({lb_file})")
    source = "in this run" if why_not is None else f"read from `{lb_file}` (not measured in this run: {why_not})"
    if ctx.handout == "2026":
        nb.answer(ctx, "leaderboard", "", report.leaderboard_answer(lb_row, source=source),
                  measured_by=None if why_not is None else lb_row.get("env"))
    else:
        nb.md(report.leaderboard_answer(lb_row, source=source))
elif ctx.handout == "2026":
    nb.not_run(ctx, "leaderboard", "", f"{why_not}, and no row of the leaderboard's configuration exists; run "
               "`python -m systems.bench.leaderboard` on a node with two such GPUs")
