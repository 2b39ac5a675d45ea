"""Tables, figures and rendered answers for the benchmarking notebook (01)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.bench.benchmark import PHASES

MS = 1e3


def phase_table(records: list[dict]) -> pd.DataFrame:
    """One row per (size, mode): mean ± std of each phase in ms, tokens/s, MFU, peak memory; OOM kept."""
    rows = []
    for r in records:
        row = {"size": r["model"], "mode": r["mode"], "status": r["status"], "params (M)": r.get("n_params", np.nan) / 1e6
               if r.get("n_params") else np.nan}
        for key in ("step", *PHASES):
            mean, std = r.get(f"{key}_mean_s"), r.get(f"{key}_std_s")
            row[f"{key} ms"] = mean * MS if mean is not None else np.nan
            row[f"{key} std ms"] = std * MS if std is not None else np.nan
        row["tokens/s"] = r.get("tokens_per_s", np.nan)
        row["TFLOP/s"] = r.get("achieved_tflops", np.nan)
        row["MFU"] = r.get("mfu") if r.get("mfu") is not None else np.nan
        row["peak GiB"] = r.get("peak_memory_gib", np.nan)
        rows.append(row)
    df = pd.DataFrame(rows)
    return df.dropna(axis=1, how="all")


def plot_phases(records: list[dict], *, title: str):
    """Stacked forward / backward / optimizer bars per size, std as error bars."""
    ok = [r for r in records if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r["model"] for r in ok]
    bottom = np.zeros(len(ok))
    for phase, colour in zip(PHASES, ("#4C72B0", "#DD8452", "#55A868")):
        means = np.array([(r.get(f"{phase}_mean_s") or 0) * MS for r in ok])
        stds = np.array([(r.get(f"{phase}_std_s") or 0) * MS for r in ok])
        if not means.any():
            continue
        ax.bar(sizes, means, bottom=bottom, yerr=stds, capsize=3, label=phase, color=colour)
        bottom += means
    for i, r in enumerate(records):
        if r["status"] != "ok":
            ax.annotate(f"{r['model']}: {r['status'].upper()}", (0.02, 0.95 - 0.07 * i), xycoords="axes fraction")
    ax.set_ylabel("time per step (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def backward_forward_answer(records: list[dict]) -> str:
    """The (b) answer: how phases compare and how stable the measurements are."""
    ok = [r for r in records if r["status"] == "ok" and r.get("backward_mean_s")]
    oom = [r["model"] for r in records if r["status"] == "oom"]
    if not ok:
        return "No size fit in memory, so there is no timing to discuss."
    ratios = {r["model"]: r["backward_mean_s"] / r["forward_mean_s"] for r in ok}
    cvs = {r["model"]: r["step_std_s"] / r["step_mean_s"] for r in ok}
    opt_share = {r["model"]: r["optimizer_mean_s"] / r["step_mean_s"] for r in ok if r.get("optimizer_mean_s")}
    worst = max(cvs, key=cvs.get)
    mfu = {r["model"]: r.get("mfu") for r in ok}
    near = {m: x for m, x in ratios.items() if x >= 1.7}
    below = {m: x for m, x in ratios.items() if x < 1.7}
    text = f"The backward pass takes {_span(ratios, '{:.2f}×')} the forward time. "
    if near:
        text += (f"For {', '.join(near)} this is close to the 2× that the FLOP count predicts (per forward matmul, "
                 f"one for the activation gradients and one for the weight gradients). ")
    if below:
        text += (f"For {', '.join(below)} it is lower: such sizes do too little work per kernel to fill the GPU, "
                 f"so per-kernel launch and dispatch costs, which the Python forward pays and the C++ autograd "
                 f"engine largely avoids, weigh more")
        if all(mfu.get(m) is not None for m in ratios):
            text += (f" (MFU {_span({m: mfu[m] for m in below}, '{:.0%}')} against "
                     f"{_span({m: mfu[m] for m in near}, '{:.0%}') if near else 'n/a'} for the larger sizes)")
        text += ". "
    if opt_share:
        text += (f"The optimizer step is {_span(opt_share, '{:.1%}')} of a step: it is memory-bound elementwise "
                 f"work that reads and writes four tensors per parameter. ")
    text += (f"The step's standard deviation is at most {cvs[worst]:.1%} of its mean ({worst}), "
             + ("so 10 measured steps after warm-up pin the mean down well." if cvs[worst] < 0.05 else
                "noticeable run-to-run noise: compare configurations by ratios from the same run."))
    if oom:
        text += f" Out of memory: {', '.join(oom)}."
    return text


def _span(values: dict, fmt: str) -> str:
    """'1.90× (small) to 2.10× (xl)', or one value when all sizes agree or only one ran."""
    lo, hi = min(values, key=values.get), max(values, key=values.get)
    if len(values) == 1 or fmt.format(values[lo]) == fmt.format(values[hi]):
        return fmt.format(values[lo]) + (f" ({lo})" if len(values) == 1 else "")
    return f"{fmt.format(values[lo])} ({lo}) to {fmt.format(values[hi])} ({hi})"


def warmup_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        if r["status"] != "ok":
            rows.append({"size": r["model"], "warm-up steps": r["warmup"], "status": r["status"]})
            continue
        steps = np.array(r["step_times_s"]) * MS
        rows.append({"size": r["model"], "warm-up steps": r["warmup"], "status": "ok",
                     "mean ms": steps.mean(), "std ms": steps.std(ddof=1) if len(steps) > 1 else 0.0,
                     "median ms": np.median(steps), "first measured ms": steps[0],
                     "first / median": steps[0] / np.median(steps)})
    return pd.DataFrame(rows)


def plot_warmup(records: list[dict], *, title: str):
    ok = [r for r in records if r["status"] == "ok"]
    sizes = list(dict.fromkeys(r["model"] for r in ok))
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.2 * len(sizes), 3.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for r in (r for r in ok if r["model"] == size):
            ax.plot(np.arange(1, len(r["step_times_s"]) + 1), np.array(r["step_times_s"]) * MS, marker="o",
                    ms=3, label=f"{r['warmup']} warm-up")
        ax.set_yscale("log")
        ax.set_title(size)
        ax.set_xlabel("measured step")
    axes[0][0].set_ylabel("step time (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def warmup_answer(table: pd.DataFrame, *, device: str) -> str:
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return "No configuration ran."
    cold = ok[ok["warm-up steps"] == 0]
    warm = ok[ok["warm-up steps"] == ok["warm-up steps"].max()].set_index("size")
    parts = []
    for _, r in cold.iterrows():
        if r["size"] not in warm.index:
            continue
        w = warm.loc[r["size"]]
        parts.append((r["size"], r["first / median"], r["mean ms"] / w["mean ms"], r["std ms"] / max(w["std ms"], 1e-9)))
    if not parts:
        return "The cold runs have no warm counterpart to compare with."
    biggest = max(parts, key=lambda p: p[1])
    one = ok[ok["warm-up steps"] == 1].set_index("size")
    one_vs_warm = [one.loc[s, "mean ms"] / warm.loc[s, "mean ms"] for s in one.index if s in warm.index]
    causes = ("CUDA context and cuBLAS handle creation, kernel selection and module loading, and the caching "
              "allocator's first cudaMalloc calls" if device == "cuda" else
              "first-use code paths (operator dispatch caches, thread pools) and the allocator's first requests")
    infl = {p[0]: p[2] - 1 for p in parts}
    text = (f"Without warm-up the first measured step is up to {biggest[1]:.1f}× the steady-state median "
            f"({biggest[0]}), which moves the 10-step mean by {_span(infl, '{:+.0%}')} "
            f"and multiplies the standard deviation by up to {max(p[3] for p in parts):.0f}×. "
            f"The first step pays one-off costs: {causes}. ")
    if one_vs_warm:
        text += (f"After a single warm-up step the mean is within {max(abs(x - 1) for x in one_vs_warm):.1%} of the "
                 f"fully warmed mean, so most of the cost is paid once; the rest (allocator growth, later "
                 f"first-use paths such as the optimizer state) is paid in the first few steps.")
    return text
