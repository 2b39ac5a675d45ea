"""Notebook 01 (benchmarking_script): tables, figures and answer text from the harness's records
(``systems.bench.benchmark``). Sizes are labelled with the selected handout's names (2026's "xl"
is the preset 2.7B)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter
import numpy as np
import pandas as pd

from systems.bench.benchmark import PHASES
from systems.config import size_label
from systems.measure.timer import median_p10_p90

MS = 1e3
# a backward/forward time ratio this far under the FLOP count's 2 is what (b) sets out to explain
LOW_BACKWARD_RATIO = 1.8


def harness_answer(handout: str) -> str:
    """(a): what the harness does; the deliverable is code, so this names it and its options."""
    modes = ("forward only, forward and backward, or a full training step with our AdamW"
             if handout == "2026" else "forward only or forward and backward (or a full training step)")
    return (f"`systems.bench.benchmark` builds the Transformer LM from a size name of Table 1 or explicit "
            f"hyperparameters (`--d-model`, `--d-ff`, `--n-layers`, `--n-heads`), draws a random batch of token "
            f"ids and targets, runs `--warmup-steps` untimed steps and then times `--measure-steps` steps of "
            f"{modes} (`--mode forward | forward_backward | train_step`), calling `torch.cuda.synchronize()` at the "
            f"end of every phase and reading `timeit.default_timer`. Each record holds the mean and standard "
            f"deviation of the step and of each phase, its median, and from the median step tokens/s, model "
            f"FLOP/s and MFU against the GPU's named peak, and peak memory; a size that does not fit is a "
            f"record with status `oom`. Example: `python -m "
            f"systems.bench.benchmark --model-size small medium --context-length 512 --mode train_step`; from "
            f"Python, `run_benchmark(BenchmarkConfig(...))` and `run_sweep([...])`, which this notebook calls.")


def _label(r: dict, handout: str) -> str:
    return size_label(r["model"], handout)


def phase_table(records: list[dict], *, handout: str) -> pd.DataFrame:
    """One row per (size, mode): mean ± std of the step and each phase in ms (the handout's
    statistics), the step's median and 10th/90th percentiles, tokens/s, TFLOP/s and MFU of the
    median step, and peak memory; sizes that did not run keep their status."""
    rows = []
    for r in records:
        row = {"size": _label(r, handout), "mode": r["mode"], "status": r["status"],
               "params (M)": r["n_params"] / 1e6 if r.get("n_params") else np.nan}
        for key in ("step", *PHASES):
            mean, std = r.get(f"{key}_mean_s"), r.get(f"{key}_std_s")
            row[f"{key} ms"] = mean * MS if mean is not None else np.nan
            row[f"{key} std ms"] = std * MS if std is not None else np.nan
        steps = r.get("step_times_s") or []
        median, p10, p90 = median_p10_p90(steps) if steps else (np.nan,) * 3
        row.update({"step median ms": median * MS, "step p10 ms": p10 * MS, "step p90 ms": p90 * MS})
        row["tokens/s"] = r.get("tokens_per_s", np.nan)
        row["TFLOP/s"] = r.get("achieved_tflops", np.nan)
        row["MFU"] = r["mfu"] if r.get("mfu") is not None else np.nan
        row["peak GiB"] = r.get("peak_memory_gib", np.nan)
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis=1, how="all")


def peak_note(records: list[dict]) -> str:
    """Which named peak the MFU column divides by (systems.measure.hardware), or that there is none."""
    named = {(r["peak_name"], r["peak_tflops"], r["precision"] + (" with TF32" if r.get("tf32") else ""))
             for r in records if r.get("peak_name")}
    if not named:
        return "rates from the median step; no named peak for this device, so no MFU"
    return "rates from the median step; " + "; ".join(f"MFU against the {name} datasheet peak of {tf:g} TFLOP/s "
                                                      f"for {prec}" for name, tf, prec in sorted(named))


def plot_phases(records: list[dict], *, title: str, handout: str):
    """Stacked forward / backward / optimizer bars per size, std as error bars; sizes that did not
    run are named in the panel."""
    ok = [r for r in records if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [_label(r, handout) for r in ok]
    bottom = np.zeros(len(ok))
    for phase, colour in zip(PHASES, ("#4C72B0", "#DD8452", "#55A868")):
        means = np.array([(r.get(f"{phase}_mean_s") or 0) * MS for r in ok])
        stds = np.array([(r.get(f"{phase}_std_s") or 0) * MS for r in ok])
        if not means.any():
            continue
        ax.bar(sizes, means, bottom=bottom, yerr=stds, capsize=3, label=phase, color=colour)
        bottom += means
    missing = [r for r in records if r["status"] != "ok"]
    for i, r in enumerate(missing):
        ax.annotate(f"{_label(r, handout)}: {r['status']}", (0.02, 0.95 - 0.07 * i), xycoords="axes fraction")
    ax.set_xlabel("model size")
    ax.set_ylabel("time per step (ms)")
    ax.set_yscale("log" if ok and max(bottom) > 20 * min(bottom) else "linear")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _span(values: dict, fmt: str) -> str:
    """'1.90× (small) to 2.10× (xl)', or one value when all sizes agree or only one ran."""
    lo, hi = min(values, key=values.get), max(values, key=values.get)
    if len(values) == 1 or fmt.format(values[lo]) == fmt.format(values[hi]):
        return fmt.format(values[lo]) + (f" ({lo})" if len(values) == 1 else "")
    return f"{fmt.format(values[lo])} ({lo}) to {fmt.format(values[hi])} ({hi})"


def _ms(seconds: float) -> str:
    return f"{seconds * MS:,.1f} ms"


def answer_b(forward: list[dict], train: list[dict], *, handout: str) -> str:
    """(b): forward and backward (and optimizer) times per size, how they compare, how noisy."""
    fwd = {_label(r, handout): r for r in forward if r["status"] == "ok"}
    ok = [r for r in train if r["status"] == "ok" and r.get("backward_mean_s")]
    missing = [f"{_label(r, handout)} {r['mode']} ({r['status']})" for r in forward + train if r["status"] != "ok"]
    if not ok and not fwd:
        return "No size ran, so there is no timing to discuss."
    text = ""
    if fwd:
        text += ("A forward pass (inference, no autograd graph) takes " + ", ".join(
            f"{_ms(r['forward_mean_s'])} ± {_ms(r['forward_std_s'])} ({s})" for s, r in fwd.items()) + ". ")
    if ok:
        text += ("In a train step the forward / backward" + (" / optimizer step" if ok[0].get("optimizer_mean_s") else "")
                 + " take " + "; ".join(
                     f"{_label(r, handout)} " + " / ".join(_ms(r[f"{p}_mean_s"]) for p in PHASES if r.get(f"{p}_mean_s"))
                     for r in ok) + ". ")
        ratios = {_label(r, handout): r["backward_mean_s"] / r["forward_mean_s"] for r in ok}
        text += (f"The backward pass takes {_span(ratios, '{:.2f}×')} the forward's time; by FLOPs it should be 2× "
                 f"(each forward matmul has two backward ones, for the activations' and the weights' gradients). ")
        mfu = {_label(r, handout): r.get("mfu") for r in ok}
        low = {s: x for s, x in ratios.items() if x < LOW_BACKWARD_RATIO}
        high = {s: mfu[s] for s in ratios if s not in low}
        # the explanation is offered only where the data separate the two groups
        if (low and high and all(v is not None for v in mfu.values())
                and max(mfu[s] for s in low) < min(high.values())):
            text += (f"Where it is under {LOW_BACKWARD_RATIO}×, the train step's MFU is "
                     f"{_span({s: mfu[s] for s in low}, '{:.0%}')} against {_span(high, '{:.0%}')} for the sizes "
                     f"at or above it: its kernels are too small to keep the GPU "
                     f"busy, so fixed per-kernel costs, which FLOPs do not count, weigh more, and more so in the "
                     f"forward, whose operators Python dispatches one by one, than in the backward, which the C++ "
                     f"autograd engine runs. ")
        opt = {_label(r, handout): r["optimizer_mean_s"] / r["step_mean_s"] for r in ok if r.get("optimizer_mean_s")}
        if opt:
            text += f"The optimizer step is {_span(opt, '{:.1%}')} of a step. "
    cvs = {f"{_label(r, handout)} {r['mode']}": r["step_std_s"] / r["step_mean_s"] for r in [*fwd.values(), *ok]}
    worst = max(cvs, key=cvs.get)
    text += (f"The standard deviation is at most {cvs[worst]:.1%} of the mean ({worst}), "
             + ("so the variability is small: 10 measured steps after warm-up pin the mean down."
                if cvs[worst] < 0.05 else "noticeable run-to-run variability: compare configurations by ratios "
                "measured in the same run."))
    if missing:
        text += " Did not run: " + ", ".join(missing) + "."
    return text


def warmup_table(records: list[dict], *, handout: str) -> pd.DataFrame:
    rows = []
    for r in records:
        row = {"size": _label(r, handout), "warm-up steps": r["warmup"], "status": r["status"]}
        if r["status"] == "ok":
            steps = np.array(r["step_times_s"]) * MS
            row.update({"mean ms": steps.mean(), "std ms": steps.std(ddof=1) if len(steps) > 1 else 0.0,
                        "median ms": np.median(steps), "first measured ms": steps[0],
                        "first / median": steps[0] / np.median(steps)})
        rows.append(row)
    return pd.DataFrame(rows)


def plot_warmup(records: list[dict], *, title: str, handout: str):
    """Per size, every measured step's time after 0, 1 and 2 warm-up steps (log scale)."""
    ok = [r for r in records if r["status"] == "ok"]
    sizes = list(dict.fromkeys(_label(r, handout) for r in ok))
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(3.2 * max(len(sizes), 1), 3.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for r in (r for r in ok if _label(r, handout) == size):
            ax.plot(np.arange(1, len(r["step_times_s"]) + 1), np.array(r["step_times_s"]) * MS, marker="o",
                    ms=3, label=f"{r['warmup']} warm-up")
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))  # 700, not 7 × 10²
        ax.set_title(size)
        ax.set_xlabel("measured step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("step time (ms)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def warmup_answer(table: pd.DataFrame, *, device: str) -> str:
    """(c): what 0, 1 or 2 warm-up steps do to the measured steps, each statement read off the table."""
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return "No configuration ran."
    most = int(ok["warm-up steps"].max())
    by = {w: grp.set_index("size") for w, grp in ok.groupby("warm-up steps")}
    if 0 not in by or most == 0:
        return "The runs without warm-up have no warmed-up counterpart to compare with."
    cold, warm = by[0], by[most]
    sizes = [s for s in cold.index if s in warm.index]
    if not sizes:
        return "The runs without warm-up have no warmed-up counterpart to compare with."
    first = {s: cold.loc[s, "first / median"] for s in sizes}
    shift = {s: cold.loc[s, "mean ms"] / warm.loc[s, "mean ms"] - 1 for s in sizes}
    spread = {s: cold.loc[s, "std ms"] / max(warm.loc[s, "std ms"], 1e-9) for s in sizes}
    worst = max(first, key=first.get)
    causes = ("creating the CUDA context and cuBLAS handles, choosing and loading kernels, the caching allocator's "
              "first cudaMalloc calls, and AdamW creating its moment tensors" if device == "cuda" else
              "first-use code paths (operator dispatch caches, thread pools), the allocator's first requests, and "
              "AdamW creating its moment tensors")
    slower = all(v > 0 for v in shift.values()) and all(v > 1 for v in spread.values())
    text = (f"Without warm-up the first measured step takes {_span(first, '{:.1f}×')} the median of the run's later "
            f"steps" + (f" (worst: {worst})" if len(first) > 1 else "") + f", because it pays one-off costs: "
            f"{causes}. Averaged into the measured steps this moves the mean by {_span(shift, '{:+.0%}')} and the "
            f"standard deviation by a factor of {_span(spread, '{:.1f}×')} against the run with {most} warm-up "
            f"steps, " + ("so an unwarmed benchmark reports a slower, noisier step than the steady state. " if slower
                          else "not all in the direction of a slower cold run: here the noise between two "
                          "processes is as large as the cold start. "))
    later = {w: {s: by[w].loc[s, "first / median"] for s in sizes if s in by[w].index} for w in range(1, most + 1)
             if w in by}
    for w, ratios in later.items():
        if not ratios:
            continue
        top = max(ratios, key=ratios.get)
        text += (f"With {w} warm-up step{'s' if w > 1 else ''} the first measured step is {_span(ratios, '{:.2f}×')} "
                 f"the median" + (f" (still above it for {top})" if ratios[top] > 1.2 else ""))
        if w < most:
            # the whole run, not only its first step: each process's steady state can differ too
            medians = {s: by[w].loc[s, "median ms"] / warm.loc[s, "median ms"] for s in ratios}
            far = max(medians, key=lambda s: abs(medians[s] - 1))
            text += (f", and the run's median is {_span(medians, '{:.2f}×')} the {most}-warm-up run's"
                     + (f" (furthest: {far})" if len(medians) > 1 else ""))
        text += ". "
    text += ("One or two warm-up steps can leave a difference because some costs come later or repeat: the "
             "allocator keeps growing its pool until the step's peak has been reached once, autograd and the "
             "optimizer meet some code paths only on their second pass, " + (
                 "the GPU's clocks ramp up under sustained load, " if device == "cuda" else "")
             + "and a process sharing the machine adds noise that a handful of steps does not average out.")
    return text
