"""Notebook 03 (mixed_precision_accumulation, benchmarking_mixed_precision): tables, figures and
answer text from the experiments of ``systems.bench.precision``.

    accumulation_answer(acc)                 the handout's four loops (and bf16's), explained
    dtype_matrix(probe), dtype_answer(...)    (a) the dtypes autocast produced in the toy model
    layernorm_summary(ln), plot_layernorm(ln), layernorm_answer(...)   (b) what in LayerNorm is sensitive
    speedup_table(records), plot_speedup(...), speedup_answer(...)     (c) bf16 autocast against fp32
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from systems.bench.precision import FP16_MAX, LN_METHODS
from systems.config import size_label
from systems.measure.devices import dtype_of
from systems.measure.timer import median_p10_p90
from systems.report.notebook import join_words, noise_side

# our threshold for "not bound by its FLOPs": with time = fixed + FLOPs / rate, a next size doing r× the
# FLOPs in T× the time puts a share (r − T) / (r − 1) of this step in the fixed part (at least that if the
# fixed part grows with size too); "not bound by its FLOPs" once that share is over this
FLOP_BOUND_SHARE = 0.5

# ----------------------------------------------------------------------------- accumulation


def spacing(value: float, dtype: str) -> float:
    """Distance between adjacent representable numbers of ``dtype`` around ``value`` (normal range)."""
    return float(torch.finfo(dtype_of(dtype)).eps) * 2.0 ** math.floor(math.log2(abs(value)))


def accumulation_answer(acc: pd.DataFrame) -> str:
    """Why each loop of ``accumulation_experiment`` lands where it does, from its rows."""
    a = acc.set_index("loop")
    fp32, fp16 = a.loc["fp32 += fp32"], a.loc["fp16 += fp16"]
    mixed, cast = a.loc["fp32 += fp16"], a.loc["fp32 += fp16.to(fp32)"]
    bf16, bf16_mixed = a.loc["bf16 += bf16"], a.loc["fp32 += bf16"]
    same_cast = "the same" if mixed.result == cast.result else "a different"
    return (
        f"Summing 0.01 a thousand times gives {fp32.result:.6g} in fp32 (error {fp32.abs_error:.2g}: fp32's 24-bit "
        f"mantissa rounds every partial sum a little). With an fp16 accumulator it gives {fp16.result:.5g} (error "
        f"{fp16.abs_error:.3g}, {fp16.abs_error / fp32.abs_error:,.0f}× fp32's): near 10, fp16's spacing is "
        f"{spacing(fp16.result, 'fp16'):g}, so each added 0.01 is rounded by a large fraction of itself. Keeping the "
        f"accumulator in fp32 but adding fp16 increments gives {mixed.result:.6g}; {same_cast} result comes out when "
        f"the increment is cast to fp32 explicitly ({cast.result:.6g}), because `fp32 += fp16` promotes to fp32 "
        f"anyway. That error ({mixed.abs_error:.3g}) is almost exactly the increment's own rounding "
        f"({mixed.error_from_increment_rounding:.3g} = 1000 × ({mixed.stored_increment:.7g} − 0.01)), so the fp32 "
        f"accumulator removes the accumulation error and only the representation error remains. bf16 is worse: a "
        f"bf16 accumulator stalls at {bf16.result:g} (error {bf16.abs_error:g}): there bf16's spacing is "
        f"{spacing(bf16.result, 'bf16'):g}, so adding {bf16.stored_increment:.4g} (less than half of it) rounds back "
        f"to the same number every time; and even with an fp32 accumulator the bf16 increment "
        f"({bf16_mixed.stored_increment:.7g}) leaves an error of {bf16_mixed.abs_error:.3g}. Lesson: keep "
        f"accumulators (sums, reductions, master weights) in fp32 and use the low precision for the operands.")


# ----------------------------------------------------------------------------- (a) autocast dtypes


def dtype_matrix(probe: pd.DataFrame) -> pd.DataFrame:
    """Quantities as rows, one column per autocast dtype (the order of first appearance kept)."""
    order = list(dict.fromkeys(probe["quantity"]))
    wide = probe.pivot_table(index="quantity", columns="autocast", values="dtype", aggfunc="first")
    wide = wide.reindex(order)
    wide.columns.name = None
    return wide


def _dtype_of(dtypes: pd.DataFrame, quantity: str, cast: str) -> str:
    value = dtypes.loc[quantity, cast] if quantity in dtypes.index and cast in dtypes.columns else None
    return f"`{value}`" if isinstance(value, str) else "not observed"


def _dtypes_of(dtypes: pd.DataFrame, prefix: str, cast: str, exclude: str = "grad of ") -> str:
    vals = sorted({v for q, v in dtypes[cast].items()
                   if q.startswith(prefix) and not q.startswith(exclude) and isinstance(v, str)})
    return ", ".join(f"`{v}`" for v in vals) or "not observed"


def dtype_answer(probe: pd.DataFrame) -> str:
    """(a): each quantity's dtype under fp16 (and bf16) autocast, as the probe observed it."""
    dtypes = dtype_matrix(probe)
    device = probe["device"].iloc[0]
    lines = []
    for cast in [c for c in ("fp16", "bf16") if c in dtypes.columns]:
        lines.append(
            f"- **{cast} autocast ({device}):** parameters inside autocast {_dtypes_of(dtypes, 'parameter ', cast)}; "
            f"the fc1 matmul runs on {_dtype_of(dtypes, 'fc1 matmul operands (x, weight)', cast)} operands and fc1's "
            f"output is {_dtype_of(dtypes, 'fc1 output', cast)}; the LayerNorm kernel is called on "
            f"{_dtype_of(dtypes, 'LayerNorm kernel input', cast)}, keeps its mean/rstd in "
            f"{_dtype_of(dtypes, 'LayerNorm saved mean / rstd', cast)} and returns "
            f"{_dtype_of(dtypes, 'LayerNorm output', cast)}; the logits are "
            f"{_dtype_of(dtypes, 'logits (fc2 output)', cast)}, the loss {_dtype_of(dtypes, 'loss', cast)}; activation "
            f"gradients are {_dtype_of(dtypes, 'grad of logits', cast)} and {_dtype_of(dtypes, 'grad of fc1 output', cast)}, "
            f"and the parameter gradients {_dtypes_of(dtypes, 'grad ', cast)} (autocast's cast is differentiable: its "
            f"backward casts the gradient back to the fp32 parameter).")
    for r in probe[probe["quantity"] == "(whole probe)"].itertuples():
        lines.append(f"- **{r.autocast} autocast ({device})** did not run: {r.probe}")
    note = ""
    if device == "cpu" and "bf16" in dtypes.columns and dtypes.loc["LayerNorm output", "bf16"] != "fp32":
        note = (" On this CPU run LayerNorm's *output* comes back in the low precision: CPU autocast does not list "
                "`layer_norm` among its fp32 ops, so the op follows its input. The kernel still computes its "
                "statistics in fp32 (the saved mean/rstd row). CUDA autocast lists `layer_norm` as an fp32 op; the "
                "full profile on a GPU shows its output dtype there.")
    return ("\n\n" + "\n".join(lines) + "\n\nThe parameters stay fp32 (autocast casts a copy for each matmul, so "
            "the optimizer updates fp32 master weights); matmuls and their outputs are in the low precision; the "
            "loss is computed in fp32; gradients of the parameters arrive in fp32." + note)


# ----------------------------------------------------------------------------- (b) LayerNorm


def layernorm_table(df: pd.DataFrame, *, mean_to_std: float, value: str,
                    methods: tuple[str, ...] = LN_METHODS) -> pd.DataFrame:
    """One row per activation scale, one column per "dtype method": ``value`` (e.g. var_rel_err)."""
    sub = df[(df.mean_to_std == mean_to_std) & df.method.isin(methods)]
    wide = sub.pivot_table(index="scale", columns=["dtype", "method"], values=value)
    wide.columns = [f"{dtype} {method}" for dtype, method in wide.columns]  # ("fp16", "sum_sq") -> "fp16 sum_sq"
    return wide.reset_index()


def layernorm_summary(df: pd.DataFrame) -> dict:
    """The numbers the notebook's answer quotes, computed from a layernorm_sensitivity table."""

    def sub(dtype, method, offset):
        return df[(df.dtype == dtype) & (df.method == method) & (df.mean_to_std == offset)].sort_values("scale")

    def first_scale(frame, mask):
        hit = frame[mask]
        return float(hit.scale.iloc[0]) if len(hit) else None

    centred = df.mean_to_std.min()
    offset = df.mean_to_std.max()
    fp16_sq = sub("fp16", "sum_sq", centred)
    fp16_tp = sub("fp16", "two_pass", centred)
    bf16_sq = sub("bf16", "sum_sq", centred)
    fp16_kernel = sub("fp16", "torch_kernel", centred)
    ok = fp16_sq[fp16_sq.nonfinite_frac == 0]
    return {
        "d": int(df.d.iloc[0]),
        "fp16_max": FP16_MAX,
        "fp16_sum_sq_overflow_scale": first_scale(fp16_sq, fp16_sq.nonfinite_frac > 0),
        "fp16_two_pass_overflow_scale": first_scale(fp16_tp, fp16_tp.nonfinite_frac > 0),
        "fp16_kernel_overflow_scale": first_scale(fp16_kernel, fp16_kernel.nonfinite_frac > 0),
        # underflow end: the smallest scale at which fp16's variance error exceeds 10 %
        "fp16_sum_sq_underflow_scale": (float(ok[ok.var_rel_err > 0.1].scale.max())
                                        if (ok.var_rel_err > 0.1).any() else None),
        "bf16_any_nonfinite": bool((df[df.dtype == "bf16"].nonfinite_frac > 0).any()),
        "bf16_var_rel_err_median": float(bf16_sq.var_rel_err.median()),
        "fp16_var_rel_err_median_finite": float(ok.var_rel_err.median()) if len(ok) else None,
        "fp32_var_rel_err_median": float(sub("fp32", "sum_sq", centred).var_rel_err.median()),
        "offset": float(offset),
        "bf16_offset_sum_sq_out_err": float(sub("bf16", "sum_sq", offset).out_max_err.median()),
        "bf16_offset_two_pass_out_err": float(sub("bf16", "two_pass", offset).out_max_err.median()),
        "bf16_offset_kernel_out_err": float(sub("bf16", "torch_kernel", offset).out_max_err.median()),
        "fp32_offset_sum_sq_out_err": float(sub("fp32", "sum_sq", offset).out_max_err.median()),
        "bf16_input_rel_err": float(df[df.dtype == "bf16"].input_rel_err.median()),
        "fp16_input_rel_err": float(df[(df.dtype == "fp16") & (df.nonfinite_frac == 0)].input_rel_err.median()),
    }


def plot_layernorm(df: pd.DataFrame):
    """Left: variance error of centred activations against scale (x where a row overflowed) for
    the hand-written statistics; the torch kernel is left out there because its statistics are
    fp32 and, below sqrt(eps), its variance is swamped by eps. Right: normalised-output error of
    every method for activations whose mean is large against their spread."""
    import matplotlib.pyplot as plt

    centred, offset = df.mean_to_std.min(), df.mean_to_std.max()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    colours = {"fp16": "tab:red", "bf16": "tab:blue", "fp32": "tab:green"}
    styles = {"sum_sq": "-", "two_pass": "--", "torch_kernel": ":"}
    panels = [(axes[0], centred, "var_rel_err", "relative error of the variance", ("sum_sq", "two_pass")),
              (axes[1], offset, "out_max_err", "max |LayerNorm output error|", LN_METHODS)]
    for ax, off, col, ylabel, methods in panels:
        sub = df[df.mean_to_std == off]
        finite_vals = sub[col].replace([np.inf], np.nan)
        ceiling = float(finite_vals.max()) * 10 if finite_vals.notna().any() else 1.0
        for (dt, method), grp in sub.groupby(["dtype", "method"], sort=False):
            if method not in methods:
                continue
            grp = grp.sort_values("scale")
            ok = np.isfinite(grp[col]) & (grp.nonfinite_frac == 0)
            ax.plot(grp.scale[ok], grp[col][ok], styles.get(method, "-"), color=colours.get(dt),
                    marker=".", label=f"{dt} {method}")
            if (~ok).any():
                ax.scatter(grp.scale[~ok], np.full((~ok).sum(), ceiling), marker="x", color=colours.get(dt))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("activation scale (std of x)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"mean / std = {off:g}" + ("  (x: inf/nan)" if ax is axes[0] else ""))
    fig.tight_layout()
    handles, labels = axes[1].get_legend_handles_labels()  # the right panel has every method
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=8)
    return fig


def layernorm_answer(s: dict) -> str:
    """(b): what in LayerNorm is sensitive, in fp16 and in bf16, from ``layernorm_summary``."""

    def scale(v):
        return "no scale tried" if v is None else f"{v:g}"

    kernel = ("never produced inf/nan before the input itself overflowed" if s["fp16_kernel_overflow_scale"] is None
              else f"first produced inf/nan at scale {scale(s['fp16_kernel_overflow_scale'])}")
    return (
        f"The sensitive part is the variance: a sum of `d` = {s['d']} squares. In fp16 (largest finite value "
        f"{s['fp16_max']:,.0f}) the one-pass sum of squares overflows to inf from activation scale "
        f"{scale(s['fp16_sum_sq_overflow_scale'])} on (the two-pass sum from {scale(s['fp16_two_pass_overflow_scale'])}), "
        f"far below the point where any single activation would overflow, and every output of those rows is inf/nan; "
        f"at the small end the squares underflow, and the variance is off by more than 10 % up to scale "
        f"{scale(s['fp16_sum_sq_underflow_scale'])}. The fp32-internal kernel on fp16 input {kernel}. bf16 has fp32's "
        f"exponent range: {'no' if not s['bf16_any_nonfinite'] else 'some'} bf16 run overflowed, at any scale; but with "
        f"8 mantissa bits its variance error is {s['bf16_var_rel_err_median']:.2g} (median over scales) against "
        f"{s['fp16_var_rel_err_median_finite']:.2g} for fp16 where fp16 stays finite and "
        f"{s['fp32_var_rel_err_median']:.2g} for fp32; rounding the activations alone costs "
        f"{s['bf16_input_rel_err']:.2g} relative in bf16 against {s['fp16_input_rel_err']:.2g} in fp16. When the mean "
        f"is {s['offset']:g}× the spread, the one-pass bf16 variance cancels catastrophically (median max output error "
        f"{s['bf16_offset_sum_sq_out_err']:.3g}, against {s['fp32_offset_sum_sq_out_err']:.2g} in fp32); two-pass gives "
        f"{s['bf16_offset_two_pass_out_err']:.2g} and the fp32-internal kernel {s['bf16_offset_kernel_out_err']:.2g}, "
        f"which is the rounding of the bf16 input and output. So with bf16 "
        + ("LayerNorm no longer needs protecting from overflow, but " if not s["bf16_any_nonfinite"] else "")
        + "its reductions should still run in fp32 for precision, which is what the kernels do (the dtype probe "
        "shows fp32 mean/rstd) and why CUDA autocast keeps `layer_norm` among its fp32 ops.")


# ----------------------------------------------------------------------------- (c) bf16 vs fp32


def speedup_table(records: pd.DataFrame | list[dict], *, baseline: str = "fp32", candidate: str = "bf16",
                  handout: str | None = None) -> pd.DataFrame:
    """One row per (size, mode): both step times (median, 10th and 90th percentile), tokens/s, the
    FLOPs of one step, and the speedup baseline_time / candidate_time of the medians; NaN where either side did not run
    (its status is kept). ``noise_side``: which precision's median lies inside the other's p10–p90 range, or None
    (``precision_noise_side``), decided here once per row so every sentence about the row reads the same verdict.
    ``size`` is the handout's name for the preset in ``model`` (2026's "xl" for 2.7B)."""
    df = pd.DataFrame(records)
    if df.empty:
        return df
    for col in ("step_mean_s", "step_times_s", "tokens_per_s", "n_params", "peak_memory_gib", "mfu",
                "flops_per_step"):
        if col not in df.columns:
            df[col] = np.nan
    keys = ["model", "mode"]
    out = []
    for (model, mode), grp in df.groupby(keys, sort=False):
        row = {"size": size_label(model, handout) if handout else model, "model": model, "mode": mode,
               "n_params": grp["n_params"].dropna().max(), "flops_per_step": grp["flops_per_step"].dropna().max()}
        for prec in (baseline, candidate):
            r = grp[grp.precision == prec]
            r = r.iloc[-1] if len(r) else None
            row[f"{prec}_status"] = r["status"] if r is not None else "missing"
            ok = r is not None and r["status"] == "ok"
            # the median resists the odd slow step (a GC pause, a clock change); the mean where a
            # record has no per-step times
            steps = r["step_times_s"] if ok and isinstance(r["step_times_s"], list) else None
            median, p10, p90 = median_p10_p90(steps) if steps else ((r["step_mean_s"],) * 3 if ok else (np.nan,) * 3)
            row[f"{prec}_ms"], row[f"{prec}_p10_ms"], row[f"{prec}_p90_ms"] = median * 1e3, p10 * 1e3, p90 * 1e3
            tokens = r.get("batch_size", np.nan) * r.get("context_length", np.nan) if ok else np.nan
            row[f"{prec}_tok_s"] = (tokens / median if steps and np.isfinite(tokens) else
                                    r["tokens_per_s"] if ok else np.nan)
            row[f"{prec}_peak_gib"] = r["peak_memory_gib"] if ok else np.nan
            row[f"{prec}_mfu"] = r["mfu"] if ok else np.nan
        row["speedup"] = row[f"{baseline}_ms"] / row[f"{candidate}_ms"]
        row["noise_side"] = precision_noise_side(row, precisions=(baseline, candidate))
        out.append(row)
    table = pd.DataFrame(out)
    table["n_params"] = table["n_params"].astype(float)
    return table


def plot_speedup(table: pd.DataFrame, *, title: str | None = None):
    """Speedup (fp32 time / bf16 time) against parameter count, one line per mode."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for mode, grp in table.groupby("mode", sort=False):
        grp = grp.dropna(subset=["speedup"]).sort_values("n_params")
        if grp.empty:
            continue
        ax.plot(grp["n_params"], grp["speedup"], marker="o", label=mode)
        for _, r in grp.iterrows():
            ax.annotate(r["size"], (r["n_params"], r["speedup"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("speedup of bf16 autocast over fp32 (×)")
    ax.set_title(title or "bf16 autocast vs fp32")
    ax.legend()
    fig.tight_layout()
    return fig


def precision_noise_side(row, *, precisions: tuple[str, str] = ("fp32", "bf16")) -> str | None:
    """Which precision's median lies inside the other's p10–p90 range of step times, or None
    (``notebook.noise_side``, the report's rule; ``speedup_table`` gives a record without per-step
    times a spread of its mean alone, and stores this as its ``noise_side`` column)."""
    return noise_side({p: (row[f"{p}_ms"], row[f"{p}_p10_ms"], row[f"{p}_p90_ms"]) for p in precisions})


def _point(r: dict) -> str:
    """'small 55.7 → 57.0 ms (0.98×)', saying so where the speedup is within noise."""
    inside = r["noise_side"]  # pandas stores a str column's None as NaN: either means beyond noise
    other = "bf16" if inside == "fp32" else "fp32"
    noise = (f", within noise: {inside}'s median lies inside {other}'s p10–p90 range, "
             f"{r[f'{other}_p10_ms']:,.1f}–{r[f'{other}_p90_ms']:,.1f} ms" if pd.notna(inside) else "")
    return f"{r['size']} {r['fp32_ms']:,.1f} → {r['bf16_ms']:,.1f} ms ({r['speedup']:.2f}×{noise})"


def _direction(ran: pd.DataFrame) -> str:
    """Faster, slower or within noise, counted over the points that ran in both precisions."""
    noise = ran.noise_side.notna()
    faster, slower = (ran.speedup > 1) & ~noise, (ran.speedup < 1) & ~noise
    if faster.all():
        return "bf16 autocast is faster everywhere"
    if slower.all():
        return "bf16 autocast is slower everywhere"
    if noise.all():
        return "bf16 autocast is neither faster nor slower beyond the noise anywhere"
    counts = [f"{name} at {int(k.sum())}" for name, k in (("faster", faster), ("slower", slower),
                                                           ("within noise", noise)) if k.any()]
    return "bf16 autocast is " + join_words(counts) + " of the points"


def _fixed_cost_bound(grp: pd.DataFrame) -> list[str]:
    """For each point within noise, whether most of its bf16 step is a cost that does not grow with
    the FLOPs (``FLOP_BOUND_SHARE``), from the next size up in the same mode. What that cost is (kernel
    launches, host overhead, memory-bound work) these rows cannot say, so the answer does not name it."""
    out = []
    points = grp.sort_values("n_params").to_dict("records")
    for this, nxt in zip(points, points[1:]):
        if pd.isna(this["noise_side"]) or not (this["flops_per_step"] > 0 and nxt["flops_per_step"] > 0):
            continue  # NaN FLOPs (a record without them) fail the test too
        flops, time = nxt["flops_per_step"] / this["flops_per_step"], nxt["bf16_ms"] / this["bf16_ms"]
        fixed = (flops - time) / (flops - 1) if flops > 1 else 0.0  # the comment at FLOP_BOUND_SHARE
        if fixed > FLOP_BOUND_SHARE:
            out.append(f"For {this['size']}, {this['mode']} is not bound by its FLOPs: {nxt['size']} does "
                       f"{flops:.2f}× its FLOPs in only {time:.2f}× its bf16 time, so about {fixed:.0%} of "
                       f"{this['size']}'s bf16 step goes to costs that do not grow with the FLOPs, and bf16, which "
                       f"speeds up only the matmuls, has little to gain there.")
    return out


def _out_of_order(ran: pd.DataFrame) -> list[str]:
    """Sizes where a precision's train step came out shorter than its forward + backward alone, though
    it runs both and an optimizer step on top: their times move by more than their spread says."""
    out = []
    for size, grp in ran.groupby("size", sort=False):
        modes = grp.set_index("mode")
        if not {"train_step", "forward_backward"} <= set(modes.index):
            continue
        for prec in ("fp32", "bf16"):
            step, fb = modes.loc["train_step", f"{prec}_ms"], modes.loc["forward_backward", f"{prec}_ms"]
            if step < fb:
                out.append(f"For {size}, the {prec} train step (median {step:,.1f} ms) came out shorter than the "
                           f"{prec} forward_backward ({fb:,.1f} ms), though the train step runs that forward and "
                           f"backward and an optimizer step on top: {size}'s times move by more than their p10–p90 "
                           f"shows.")
    return out


def speedup_answer(speed: pd.DataFrame, records: pd.DataFrame, *, device: str, gpu: str, handout: str) -> str:
    """(c): the timings with and without bf16 autocast and how the gap moves with size; a speedup
    whose medians lie within each other's p10–p90 spread is reported as noise, not as faster or slower."""
    ran = speed.dropna(subset=["speedup"])
    if ran.empty:
        return "No size ran in both precisions, so there is no comparison."
    parts, notes = [], []
    for mode, grp in ran.groupby("mode", sort=False):
        grp = grp.sort_values("n_params")
        times = ", ".join(_point(r) for r in grp.to_dict("records"))
        trend = ""
        if len(grp) > 1:
            first, last = grp.iloc[0], grp.iloc[-1]
            trend = (f"; {'rising' if last.speedup > first.speedup else 'falling'} with size, "
                     f"{first.speedup:.2f}× → {last.speedup:.2f}×")
        parts.append(f"- **{mode}** (fp32 → bf16): {times}{trend}.")
        if device == "cuda":
            notes += _fixed_cost_bound(grp)
    notes += _out_of_order(ran)
    missing = records[records.status != "ok"]
    fit = ("Points that did not run: " + "; ".join(
        f"{size_label(r.model, handout)} {r.mode} {r.precision}: {r.status}" for r in missing.itertuples()) + "."
           if len(missing) else "Every size ran in both precisions.")
    overall = ran.speedup
    # what autocast changes is the op list's; how much of a step the matmuls take is notebook 02's measurement
    why = ("Autocast runs the matmuls in bf16 (what follows them reads their bf16 outputs), adds the casts, and "
           "keeps the softmax, the norms' reductions and the loss in fp32; the train step's AdamW update stays "
           "fp32. Notebook 02 measures how much of a step the matmuls take by size and context."
           if device == "cuda" else
           "This is a CPU smoke run of the tiny `debug` size for a few steps: the times are dominated by "
           "framework overhead and noise, and CPU bf16 kernels are not tensor cores, so these numbers say nothing "
           "about a GPU; the full profile answers the question.")
    return (f"Speedup of bf16 autocast over fp32 (fp32 time / bf16 time, median step) on {gpu}: {_direction(ran)} "
            f"(range {overall.min():.2f}×–{overall.max():.2f}× over {len(ran)} size × mode points; a speedup is "
            f"within noise when either precision's median lies inside the other's p10–p90 range of step times):\n\n"
            + "\n".join(parts) + "\n\n" + " ".join(notes + [fit, why]))
