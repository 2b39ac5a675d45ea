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
# # 03 · Mixed precision: accumulation, autocast dtypes, BF16 speed
# What does training in lower precision cost in accuracy and buy in speed? We sum 0.01 a thousand
# times in several precisions (`mixed_precision_accumulation`), read the dtypes autocast actually
# produces in a toy model's forward and backward, show by a run what in LayerNorm is sensitive to
# fp16 and bf16, and time bf16 autocast against fp32 for the selected handout's model sizes
# (`benchmarking_mixed_precision`).

# %% tags=["parameters"]
profile = "smoke"        # "smoke": CPU, debug model; "full": the handout's sizes on a GPU
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": whose Table 1 of sizes
budget_s = 240           # full profile: (c) points that would start later are "skipped (budget)"

# %%
from systems.bench import precision as mp
from systems.bench.benchmark import run_sweep
from systems.bench.budget import Budget
from systems.config import handout_sizes
from systems.measure.results import ResultWriter, read_results
from systems.report import mixed_precision as report
from systems.report import notebook as nb

ctx = nb.setup(name="03_mixed_precision", profile=profile, out_dir=out_dir, handout=handout)

# %% [markdown]
# ## 1 · Accumulating 0.01 a thousand times
# The handout's four loops, then the same loops with bf16 in place of fp16. `stored_increment` is
# 0.01 as the increment's dtype holds it; `error_from_increment_rounding` is 1000 × (that − 0.01),
# the part of the error that comes from representing 0.01 rather than from adding.

# %%
acc = mp.accumulation_experiment()
ResultWriter(ctx.result_path("accumulation")).write_many(acc.to_dict("records"))
nb.show(acc, formats={c: "{:.6g}" for c in ("stored_increment", "result", "abs_error",
                                             "error_from_increment_rounding")})
nb.answer(ctx, "mixed_precision_accumulation", "", report.accumulation_answer(acc))

# %% [markdown]
# ## 2 (a) · Dtypes under autocast, probed
# The handout's ToyModel (fc1 → ReLU → LayerNorm → fc2, `torch.nn` layers). One forward and backward
# under fp16 autocast and one under bf16 autocast; forward hooks record each module's output dtype,
# tensor hooks the dtype of the gradients flowing back, and a dispatch-level recorder the dtypes the
# matmul and `native_layer_norm` kernels were actually called with.

# %%
probe = mp.probe_all(("fp16", "bf16"), device=mp.autocast_device())
ResultWriter(ctx.result_path("dtypes")).write_many(probe.to_dict("records"))
nb.show(report.dtype_matrix(probe).reset_index(), caption=f"dtypes observed under {probe['device'].iloc[0]} autocast")
nb.answer(ctx, "benchmarking_mixed_precision", "a", report.dtype_answer(probe))

# %% [markdown]
# ## 2 (b) · What in LayerNorm is sensitive
# LayerNorm computes a mean and a variance over the hidden dimension: a sum of `d` squares. We draw
# activations `x = scale · (z + m)` with `z ~ N(0, 1)`, shape (rows, d), in fp64, round them once to
# fp16 / bf16 / fp32 and compute the statistics three ways: `sum_sq` (one pass: Σx²/d − mean², the sum
# held in the dtype, as a hand-written kernel or a naive RMSNorm would), `two_pass` (Σ(x − mean)²/d in
# the dtype) and `torch_kernel` (`F.layer_norm` on the low-precision tensor: fp32 statistics inside).
# Errors are against fp64. `m = 0` sweeps the magnitude; `m = 10` makes the mean large against the
# spread, as in residual-stream outlier channels.

# %%
ln_scales = [10.0 ** (k / 2) for k in range(-8, 9)] if ctx.full else [10.0 ** k for k in range(-4, 5)]
ln = mp.layernorm_sensitivity(scales=ln_scales, d=1024, rows=64 if ctx.full else 16, mean_to_std=(0.0, 10.0))
ResultWriter(ctx.result_path("layernorm")).write_many(ln.to_dict("records"))
nb.show(report.layernorm_table(ln, mean_to_std=0.0, value="var_rel_err", methods=("sum_sq", "two_pass")),
        caption="median relative error of the variance, m = 0 (inf: overflowed)", formats={"scale": "{:.3g}"})
nb.show(report.layernorm_table(ln, mean_to_std=ln.mean_to_std.max(), value="out_max_err"),
        caption="max |LayerNorm output − fp64|, m = 10", formats={"scale": "{:.3g}"})
nb.save_figure(report.plot_layernorm(ln), ctx, "layernorm")
nb.answer(ctx, "benchmarking_mixed_precision", "b", report.layernorm_answer(report.layernorm_summary(ln)))

# %% [markdown]
# ## 2 (c) · bf16 autocast against fp32, every size that fits
# The harness (`systems.bench.benchmark`) at context 512, batch 4: forward, forward+backward and the full
# train step (AdamW), fp32 (TF32 off, so it is true fp32) against bf16 autocast over fp32 master weights,
# 5 warm-up and 10 measured steps. The two precisions run back to back per size and mode, smallest size
# first; a size that does not fit is recorded as `oom`. Smoke profile: the `debug` size on the CPU,
# context 64, batch 2, 1 + 3 steps.

# %%
if ctx.full:
    sweep = mp.precision_sweep_configs(list(handout_sizes(ctx.handout).values()), context_length=512, batch_size=4,
                                       device="cuda")
else:
    sweep = mp.precision_sweep_configs(["debug"], context_length=64, batch_size=2, device="cpu",
                                       default_steps=(1, 3))
bench_path = ctx.result_path("bf16_vs_fp32")
run_sweep(sweep, out_path=bench_path, budget=Budget(budget_s if ctx.full else None))
records = read_results(bench_path)
speed = report.speedup_table(records, handout=ctx.handout)
nb.show(speed[["size", "mode", "n_params", "fp32_status", "bf16_status", "fp32_ms", "fp32_p10_ms", "fp32_p90_ms",
               "bf16_ms", "bf16_p10_ms", "bf16_p90_ms", "speedup", "fp32_tok_s", "bf16_tok_s", "fp32_peak_gib",
               "bf16_peak_gib"]],
        caption=f"bf16 autocast vs fp32 on {ctx.gpu}: median step (p10, p90), tokens/s, peak memory")
nb.save_figure(report.plot_speedup(speed, title=f"bf16 autocast vs fp32 on {ctx.gpu} (context "
                                                f"{sweep[0].context_length}, batch {sweep[0].batch_size})"),
               ctx, "bf16_speedup")
nb.answer(ctx, "benchmarking_mixed_precision", "c",
          report.speedup_answer(speed, records, device=ctx.device, gpu=ctx.gpu, handout=ctx.handout))
