# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 03 · Mixed precision: accumulation, autocast dtypes, BF16 speed
# What does training in lower precision cost in accuracy and buy in speed? We sum 0.01 a thousand
# times in several precisions (`mixed_precision_accumulation`), read the dtypes autocast actually
# produces in a toy model's forward and backward, show by a run what in LayerNorm is sensitive to
# fp16 and bf16, and time bf16 autocast against fp32 for the handout's model sizes
# (`benchmarking_mixed_precision`).

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, < 60 s) or "full" (GPU, < 5 min on one H100)
out_dir = "build/smoke"  # the runner injects this

# %%
import math

import matplotlib.pyplot as plt
import torch

from systems.bench import precision as mp
from systems.report import notebook as nb
from systems.bench.benchmark import run_sweep
from systems.config import handout_sizes
from systems.measure.results import ResultWriter, read_results

ctx = nb.setup(name="03_mixed_precision", profile=profile, out_dir=out_dir)

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

# %%
a = acc.set_index("loop")
fp32, fp16 = a.loc["fp32 += fp32"], a.loc["fp16 += fp16"]
mixed, cast = a.loc["fp32 += fp16"], a.loc["fp32 += fp16.to(fp32)"]
bf16, bf16_mixed = a.loc["bf16 += bf16"], a.loc["fp32 += bf16"]
same_cast = "the same" if mixed.result == cast.result else "a different"


def spacing(value: float, dtype: torch.dtype) -> float:
    """Distance between adjacent representable numbers around value (normal range)."""
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(abs(value)))


nb.md(
    f"**Answer.** Summing 0.01 a thousand times gives {fp32.result:.6g} in fp32 (error {fp32.abs_error:.2g}: "
    f"fp32's 24-bit mantissa rounds every partial sum a little). With an fp16 accumulator it gives "
    f"{fp16.result:.5g} (error {fp16.abs_error:.3g}, {fp16.abs_error / fp32.abs_error:,.0f}× fp32's): near 10, "
    f"fp16's spacing is {spacing(fp16.result, torch.float16):g}, so each added 0.01 is rounded by a large "
    f"fraction of itself. Keeping the "
    f"accumulator in fp32 but adding fp16 increments gives {mixed.result:.6g}; {same_cast} result comes out when "
    f"the increment is cast to fp32 explicitly ({cast.result:.6g}), because `fp32 += fp16` promotes to fp32 "
    f"anyway. That error ({mixed.abs_error:.3g}) is almost exactly the increment's own rounding "
    f"({mixed.error_from_increment_rounding:.3g} = 1000 × ({mixed.stored_increment:.7g} − 0.01)), so the fp32 "
    f"accumulator removes the accumulation error and only the representation error remains. bf16 is worse: a "
    f"bf16 accumulator stalls at {bf16.result:g} (error {bf16.abs_error:g}): there bf16's spacing is "
    f"{spacing(bf16.result, torch.bfloat16):g}, so adding {bf16.stored_increment:.4g} (less than half of it) "
    f"rounds back to the same number every time; and even with an fp32 accumulator the bf16 increment "
    f"({bf16_mixed.stored_increment:.7g}) leaves an error of {bf16_mixed.abs_error:.3g}. Lesson: keep "
    f"accumulators (sums, reductions, master weights) in fp32 and use the low precision for the operands."
)

# %% [markdown]
# ## 2 (a) · Dtypes under autocast, probed
# The handout's ToyModel (fc1 → ReLU → LayerNorm → fc2, `torch.nn` layers). One forward and backward
# under fp16 autocast and one under bf16 autocast; forward hooks record each module's output dtype,
# tensor hooks the dtype of the gradients flowing back, and a dispatch-level recorder the dtypes the
# matmul and `native_layer_norm` kernels were actually called with.

# %%
probe = mp.probe_all(("fp16", "bf16"), device=mp.autocast_device())
ResultWriter(ctx.result_path("dtypes")).write_many(probe.to_dict("records"))
dtypes = mp.dtype_matrix(probe)
probe_device = probe["device"].iloc[0]
nb.md(f"Probed with **{probe_device}** autocast "
      + ("(no GPU here: CPU autocast has its own op lists, so some rows may differ from CUDA's)."
         if probe_device == "cpu" else "(CUDA autocast op lists)."))
nb.show(dtypes.reset_index())

# %%
def _dt(quantity: str, cast: str) -> str:
    value = dtypes.loc[quantity, cast] if quantity in dtypes.index and cast in dtypes.columns else None
    return f"`{value}`" if isinstance(value, str) else "not observed"


def _same(prefix: str, cast: str, exclude: str = "grad of ") -> str:
    vals = sorted({v for q, v in dtypes[cast].items()
                   if q.startswith(prefix) and not q.startswith(exclude) and isinstance(v, str)})
    return ", ".join(f"`{v}`" for v in vals) or "not observed"


failed = probe[probe.quantity == "(whole probe)"]
lines = []
for cast in [c for c in ("fp16", "bf16") if c in dtypes.columns]:
    lines.append(
        f"- **{cast} autocast ({probe_device}):** parameters inside autocast {_same('parameter ', cast)}; "
        f"the fc1 matmul runs on {_dt('fc1 matmul operands (x, weight)', cast)} operands and fc1's output is "
        f"{_dt('fc1 output', cast)}; the LayerNorm kernel is called on {_dt('LayerNorm kernel input', cast)}, "
        f"keeps its mean/rstd in "
        f"{_dt('LayerNorm saved mean / rstd', cast)} and returns {_dt('LayerNorm output', cast)}; the logits are "
        f"{_dt('logits (fc2 output)', cast)}, the loss {_dt('loss', cast)}; activation gradients are "
        f"{_dt('grad of logits', cast)} and {_dt('grad of fc1 output', cast)}, and the parameter gradients "
        f"{_same('grad ', cast)} (autocast's cast is differentiable: its backward casts the gradient back to the "
        f"fp32 parameter)."
    )
for _, r in failed.iterrows():
    lines.append(f"- **{r.autocast} autocast ({probe_device})** did not run: {r.probe}")
ln_note = ""
if probe_device == "cpu" and "bf16" in dtypes.columns and dtypes.loc["LayerNorm output", "bf16"] != "fp32":
    ln_note = (" On this CPU run LayerNorm's *output* comes back in the low precision: CPU autocast does not "
               "list `layer_norm` among its fp32 ops, so the op simply follows its input. The kernel still "
               "computes its statistics in fp32 (the saved mean/rstd row). CUDA autocast lists `layer_norm` "
               "as an fp32 op; run the full profile on a GPU to see its output dtype there.")
nb.md("**Answer.**\n\n" + "\n".join(lines) + "\n\n"
      "The parameters stay fp32 (autocast casts a copy for each matmul, so the optimizer updates fp32 master "
      "weights); matmuls and their outputs are in the low precision; the loss is computed in fp32; "
      "gradients of the parameters arrive in fp32." + ln_note)

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
centred_tbl = ln[(ln.mean_to_std == 0) & (ln.method != "torch_kernel")].pivot_table(
    index="scale", columns=["dtype", "method"], values="var_rel_err")
nb.show(centred_tbl.reset_index(), caption="median relative error of the variance, m = 0 (inf: overflowed)")
offset_tbl = ln[ln.mean_to_std == ln.mean_to_std.max()].pivot_table(
    index="scale", columns=["dtype", "method"], values="out_max_err")
nb.show(offset_tbl.reset_index(), caption="max |LayerNorm output − fp64|, m = 10")
fig = mp.plot_layernorm(ln)
nb.save_figure(fig, ctx, "layernorm")
plt.show()

# %%
s = mp.layernorm_summary(ln)


def _scale(v):
    return "no scale tried" if v is None else f"{v:g}"


kernel_overflow = ("never produced inf/nan before the input itself overflowed"
                   if s["fp16_kernel_overflow_scale"] is None
                   else f"first produced inf/nan at scale {_scale(s['fp16_kernel_overflow_scale'])}")
nb.md(
    f"**Answer.** The sensitive part is the variance: a sum of `d` = {s['d']} squares. In fp16 (largest "
    f"finite value {s['fp16_max']:,.0f}) the one-pass sum of squares overflows to inf from activation scale "
    f"{_scale(s['fp16_sum_sq_overflow_scale'])} on (the two-pass sum from "
    f"{_scale(s['fp16_two_pass_overflow_scale'])}), "
    f"far below the point where any single activation would overflow, and every output of those rows is "
    f"inf/nan; at the small end the squares underflow, and the variance is off by more than 10 % up to scale "
    f"{_scale(s['fp16_sum_sq_underflow_scale'])}. The fp32-internal kernel on fp16 input {kernel_overflow}. "
    f"bf16 has fp32's exponent range: {'no' if not s['bf16_any_nonfinite'] else 'some'} bf16 run overflowed, "
    f"at any scale; but with 8 mantissa bits its variance error is {s['bf16_var_rel_err_median']:.2g} "
    f"(median over scales) against {s['fp16_var_rel_err_median_finite']:.2g} for fp16 where fp16 stays finite "
    f"and {s['fp32_var_rel_err_median']:.2g} for fp32; rounding the activations alone costs "
    f"{s['bf16_input_rel_err']:.2g} relative in bf16 against {s['fp16_input_rel_err']:.2g} in fp16. When the mean "
    f"is {s['offset']:g}× the spread, the one-pass bf16 variance cancels catastrophically (median max output "
    f"error {s['bf16_offset_sum_sq_out_err']:.3g}, against {s['fp32_offset_sum_sq_out_err']:.2g} in fp32); two-pass "
    f"gives {s['bf16_offset_two_pass_out_err']:.2g} and the fp32-internal kernel "
    f"{s['bf16_offset_kernel_out_err']:.2g}, which is the rounding of the bf16 input and output. So LayerNorm's "
    f"reductions should run in fp32 even under bf16, which is what the kernels do (the dtype probe shows "
    f"fp32 mean/rstd) and why CUDA autocast lists `layer_norm` among its fp32 ops."
)

# %% [markdown]
# ## 2 (c) · bf16 autocast against fp32, every size that fits
# The harness (`systems.bench.benchmark`) at context 512, batch 4: forward, forward+backward and the full train
# step (AdamW), fp32 (TF32 off, so it is true fp32) against bf16 autocast over fp32 master weights. The
# two precisions run back to back per size and mode; a size that does not fit is recorded as `oom`.
# Full profile: 5 warm-up + 10 measured steps for small and medium, 3 + 5 for large, xl and 2.7B, which
# keeps the whole notebook within 5 minutes on one H100. Smoke profile: the `debug` size on the CPU,
# context 64, batch 2, 1 + 3 steps.

# %%
if ctx.full:
    sweep = mp.precision_sweep_configs(
        list(handout_sizes("2025").values()), context_length=512, batch_size=4, device="cuda",
        steps={"small": (5, 10), "medium": (5, 10), "large": (3, 5), "xl-2025": (3, 5), "2.7B": (3, 5)})
else:
    sweep = mp.precision_sweep_configs(["debug"], context_length=64, batch_size=2, device="cpu",
                                       default_steps=(1, 3))
bench_path = ctx.result_path("bf16_vs_fp32")
run_sweep(sweep, out_path=bench_path)
records = read_results(bench_path)
speed = mp.speedup_table(records)
nb.show(speed[["model", "mode", "n_params", "fp32_status", "bf16_status", "fp32_ms", "fp32_std_ms", "bf16_ms",
               "bf16_std_ms", "speedup", "fp32_tok_s", "bf16_tok_s", "fp32_peak_gib", "bf16_peak_gib"]],
        caption=f"bf16 autocast vs fp32 on {ctx.gpu}: mean ± std per step, tokens/s, peak memory")

# %%
fig = mp.plot_speedup(speed, title=f"bf16 autocast vs fp32 on {ctx.gpu} (context "
                                   f"{sweep[0].context_length}, batch {sweep[0].batch_size})")
nb.save_figure(fig, ctx, "bf16_speedup")
plt.show()

# %%
ran = speed.dropna(subset=["speedup"])
not_ok = records[records.status != "ok"]
parts = []
for mode, grp in ran.groupby("mode", sort=False):
    grp = grp.sort_values("n_params")
    lo, hi = grp.loc[grp.speedup.idxmin()], grp.loc[grp.speedup.idxmax()]
    span = (f"{lo.speedup:.2f}× ({lo.model}) to {hi.speedup:.2f}× ({hi.model})" if len(grp) > 1
            else f"{lo.speedup:.2f}× ({lo.model})")
    if len(grp) > 1:
        first, last = grp.iloc[0], grp.iloc[-1]
        trend = (f"; from {first.model} to {last.model} it goes {first.speedup:.2f}× → {last.speedup:.2f}× "
                 f"({'rising' if last.speedup > first.speedup else 'falling'} with size)")
    else:
        trend = ""
    parts.append(f"- **{mode}:** {span}{trend}.")
if len(not_ok):
    oom = "; ".join(f"{r.model} {r['mode']} {r.precision}: {r.status}" for _, r in not_ok.iterrows())
    fit = f"Points that did not run: {oom}."
else:
    fit = "Every size ran in both precisions."
overall = ran.speedup
direction = ("bf16 autocast is faster everywhere" if (overall > 1).all() else
             "bf16 autocast is slower everywhere" if (overall < 1).all() else
             "bf16 autocast is faster at some points and slower at others")
why = ("On the GPU the matmuls move to bf16 tensor cores, and more of the step is matmul as the model grows, "
       "while the casts, the fp32 softmax/norm/loss and (for the train step) the fp32 AdamW update do not "
       "speed up." if ctx.device == "cuda" else
       "This is a CPU smoke run of the tiny `debug` size for a few steps: the times are dominated by "
       "framework overhead and noise, and CPU bf16 kernels are not tensor cores, so these numbers say nothing "
       "about a GPU; the full profile answers the question.")
nb.md(f"**Answer.** Speedup of bf16 autocast over fp32 (fp32 time / bf16 time) on {ctx.gpu}, {direction} "
      f"(range {overall.min():.2f}×–{overall.max():.2f}× over {len(ran)} size × mode points):\n\n"
      + "\n".join(parts) + f"\n\n{fit} {why}")
