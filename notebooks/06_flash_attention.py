# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · FlashAttention-2
# Does a tiled attention that never materialises the n x n score matrix match the direct formula,
# and how fast are our Triton FlashAttention-2 kernels (forward, backward, end to end) next to
# naive PyTorch attention and torch SDPA's flash and cuDNN backends, across the handout's sequence
# lengths, head dims and precisions? Everything is measured in this run by `systems.bench.flash`
# and rendered by `systems.report.flash_attention`. The smoke profile checks the same code on a CPU
# (the Triton kernels through Triton's interpreter) and times the PyTorch version against naive attention.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, < 60 s) or "full" (GPU, < 9 min on one H100 or H200)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's questions are answered
budget_s = 500.0         # full profile: wall-clock seconds for compiling, the checks and the sweep together;
                         # sweep points estimated past it become "skipped (budget)" rows (the cells after
                         # the sweep take some 20 s more; at 450 s a slow host lost the longest baselines:
                         # flash notes entry 31)

# %%
import time

from systems.bench import flash
from systems.measure.results import ResultWriter
from systems.report import flash_attention as report
from systems.report import notebook as nb

ctx = nb.setup(name="06_flash_attention", profile=profile, out_dir=out_dir, handout=handout)
ours = "triton" if ctx.full else "flash_pytorch"  # what a CPU can time against naive attention
start = time.perf_counter()

# %% [markdown]
# ## Correctness: forward and recompute backward against float64
# Each implementation's O, dQ, dK, dV against float64 autograd of the direct formula, on shapes
# that are not multiples of any tile, with n_queries != n_keys (the queries are the last
# positions), causal and not. Errors are divided by max(1, max |reference|); the bounds are ours.

# %%
writer = ResultWriter(ctx.result_path("check"))
checks = [(("flash_pytorch",), ("fp32",)), (("triton", "triton_pytorch_bwd"), ("bf16",)),
          (("triton", "triton_ieee"), ("fp32",))]  # (implementations, dtypes) of the full profile
if ctx.full:
    calls = [c for impls, dtypes in checks for c in flash.check_warm_calls(impls=impls, dtypes=dtypes)]
    nb.md(report.prewarm_line(flash.prewarm([*calls, *flash.sweep_warm_calls(flash.full_profile_grid())])))
    rows = [r for impls, dtypes in checks for r in flash.check_rows(impls=impls, dtypes=dtypes, device="cuda",
                                                                      writer=writer)]
    where = f"on {ctx.gpu}"
else:
    rows = flash.check_rows(impls=("flash_pytorch",), dtypes=("fp32",), writer=writer)
    rows += flash.check_in_interpreter(out_path=ctx.result_path("check_interpreter"))
    where = "on this CPU through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess; its dots are numpy's)"
check = report.check_table(rows)
nb.show(check, caption="max error vs float64 / max(1, max |reference|)",
        formats={c: "{:.1e}" for c in ("O", "dQ", "dK", "dV", "bound")})

# %%
for (problem, part), text in report.forward_answers(check, triton_where=where).items():
    nb.answer(ctx, problem, part, text)
nb.answer(ctx, "flash_backward", "", report.backward_answer(check))

# %% [markdown]
# ## flash_benchmarking: forward, backward and end to end
# Batch 1, causal, every power of two from 128 to 65536 x d 16, 32, 64, 128 x bf16 and fp32
# (smoke: two lengths and head dims, fp32, on the CPU). Each pass is timed by
# `systems.measure.timer.time_fn` (`triton.testing.do_bench` on a GPU): medians, with our p10 and
# p90, over at least 3 timed calls. fp32 times our kernels twice: with the default dots (tf32x3,
# or TF32 where torch allows it; each row records the precision it ran) and with IEEE fp32 dots
# (`FlashVariant(fp32_dot="ieee")`).
# **TFLOP/s are model FLOPs** (`systems.measure.flops`): matmuls only, causal attention counts the
# pairs its mask keeps, the backward is 2x the forward, and FlashAttention's recomputed Q K^T is
# not counted (naive attention computes the full score matrix: about twice the work counted). The
# tiles our kernels ran with, as the autotuner picked them: `results/06_flash_attention_plans.jsonl`.

# %%
cfg = flash.full_profile_grid(budget_s=budget_s - (time.perf_counter() - start)) if ctx.full else flash.smoke_grid()
# the smoke grid runs no Triton kernel: it has no plans to record (and leaves no empty file)
sweep = flash.flash_benchmarking(cfg, writer=ResultWriter(ctx.result_path("sweep")), device=ctx.device,
                                 plans_writer=ResultWriter(ctx.result_path("plans")) if ctx.full else None)
for pass_ in flash.PASSES:
    nb.show(report.latency_table(sweep, pass_, ours=ours),
            caption=f"{report.PASS_NAMES[pass_]}: median ms per implementation, ours' spread and rate, "
                    f"naive / ours (> 1: ours faster), on {ctx.gpu}; — = did not run")
nb.show(report.status_table(sweep), caption="points that did not run, and why")

# %%
ceilings = flash.matmul_ceilings() if ctx.full else []  # a CPU has no such ceiling to draw
if ceilings:
    nb.show(report.ceiling_table(ceilings), caption="measured cuBLAS matmul rates: each dot precision's ceiling")
fig = report.plot_tflops(sweep, ceilings=ceilings, title=f"Causal attention, batch 1, on {ctx.gpu} "
                                                         "(dotted: the measured matmul ceilings)")
nb.save_figure(fig, ctx, "tflops")

# %% [markdown]
# Which multiply each side runs in fp32 is measured, not assumed: the rows record each side's dot
# precision, the ceilings above are cuBLAS's in each, and one profiled naive fp32 step names the
# matmul kernels torch chose (the full profile).

# %%
if ctx.full:
    kernels = flash.matmul_kernels("naive", seq=4096, d=64, dtype="fp32",
                                   trace_path=ctx.out_dir / "traces" / f"{ctx.name}_naive_fp32.json")
    nb.show(kernels[["name", "category", "calls", "ms", "tf32"]].head(8),
            caption="naive fp32 attention, seq 4096, d 64: the kernels of one forward + backward")
    nb.answer(ctx, "flash_benchmarking", "a",
              report.benchmark_answer(sweep, ours=ours, device=ctx.gpu, handout=ctx.handout, like_for_like=False)
              + "\n\n" + report.fp32_answer(sweep, ceilings=ceilings, kernels=kernels))
else:
    nb.md("**CPU reading.** " + report.benchmark_answer(sweep, ours=ours, device=ctx.gpu, handout=ctx.handout))
    nb.not_run(ctx, "flash_benchmarking", "a", "the deliverable times the Triton kernels on a GPU (the full "
               "profile); this smoke run timed the PyTorch version against naive attention on the CPU")

# %% [markdown]
# ## Against SDPA's flash and cuDNN backends (our targets, not the handout's)
# Over the bf16 sweep at seq 1k-64k x d 64 and 128: each point's baseline time / our time per pass
# (> 1: ours is faster) and their geometric means against the project's targets
# (`systems.bench.flash.SPEED_TARGETS`). Where a call's host work outlasts its kernels, the ratio
# measures the host.

# %%
if ctx.full:
    ratios = flash.speed_ratios(sweep)
    geomeans = flash.geomean_ratios(ratios)
    nb.show(ratios, caption="baseline ms / our ms per point (> 1: ours faster)")
    nb.show(geomeans, caption=f"geometric means over {flash.RATIO_GRID}")
    nb.md(report.sdpa_answer(ratios, geomeans))

# %% [markdown]
# ## The 2025 handout's leaderboard configuration
# The 2025 handout's FlashAttention-2 leaderboard (its section 1.3.3, no Problem box): q, k, v of
# shape (16, 16384, 64) in bf16, causal, forward + backward, beside SDPA's flash and cuDNN backends.

# %%
if ctx.full:
    lb = flash.leaderboard(writer=ResultWriter(ctx.result_path("leaderboard")))
    nb.show(lb.reindex(columns=["impl", "status", "fwd_ms", "bwd_ms", "e2e_ms", "e2e_p10_ms", "e2e_p90_ms", "e2e_tflops"]),
            caption=f"(16, 16384, 64) bf16 causal on {ctx.gpu}")
    nb.md(report.leaderboard_answer(lb, gpu=ctx.gpu))
