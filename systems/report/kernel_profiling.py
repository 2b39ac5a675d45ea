"""Notebook 02 (kernel profiling, the handouts' nsys_profile): tables, figures and answer text,
all built from the sweep's summary rows (``systems.bench.profile.profile_sweep``) and its
profiles.

    tool_note(nsys=..., device=...)            which profiler produced the numbers, said once
    coverage_table(summary), longest_fit(summary)   what was profiled, what ran out of memory
    forward_table / answer_a, top_kernel_table / answer_b, non_matmul_table / answer_c,
    category_shares / answer_d, softmax_table / answer_e
    plot_category_shares(summary), plot_step_timeline(trace)
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from systems.measure.profiler import CATEGORIES, PHASE_RANGES, attribute, parse_trace
from systems.measure.trace import STEP_RANGE

MS = 1e3


def _ok(summary: pd.DataFrame, mode: str | None = None) -> pd.DataFrame:
    ok = summary[summary["status"] == "ok"]
    return ok if mode is None else ok[ok["mode"] == mode]


def _percent_range(values: pd.Series, digits: int = 1, *, signed: bool = False) -> str:
    """"12.0%–40.5%"; ``signed`` for relative differences, "-12.0% to +40.5%" (a dash between
    signed numbers would read as a minus)."""
    fmt = f"{{:{'+' if signed else ''}.{digits}%}}"
    lo, hi = fmt.format(values.min()), fmt.format(values.max())
    return lo if lo == hi else f"{lo} to {hi}" if signed else f"{lo}–{hi}"


def tool_note(*, nsys: bool, device: str) -> str:
    """The one statement of which profiler measured what follows."""
    if device != "cuda":
        return ("No GPU here: this smoke run profiles with `torch.profiler` on the CPU, so the 'kernels' below "
                "are CPU operators (their self time); the full profile on a GPU reads CUDA kernels.")
    if nsys:
        return ("Kernels are read from `torch.profiler` (CUPTI) traces; `nsys` is on this machine, so the last "
                "section also runs one train step under `nsys profile` and parses its `cuda_gpu_kern_sum` report.")
    return ("`nsys` is not installed on this machine, so the profiler is `torch.profiler`: the same CUPTI kernel "
            "records Nsight Systems reads, with the named ranges (`record_function`, which `emit_nvtx` turns "
            "into NVTX ranges under nsys) that the handout asks for: `step` > `forward` / `backward` / "
            "`optimizer step`, and inside attention `attention scores` / `softmax` / `final matmul`. Warm-up "
            "steps run before the profiler starts, as an NVTX capture filter would leave them out.")


# ----------------------------------------------------------------------------- coverage


def coverage_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Size x context, one column per mode: 'ok', 'oom' or why the point was skipped."""
    cov = summary.pivot_table(index=["label", "context_length"], columns="mode", values="status", aggfunc="first",
                              sort=False)
    cov.columns.name = None
    return cov.reset_index()


def longest_fit(summary: pd.DataFrame) -> pd.DataFrame:
    """Per size: the longest context whose train step ran, and the context that ran out of memory."""
    rows = []
    for label, grp in summary[summary["mode"] == "train_step"].groupby("label", sort=False):
        ran = grp[grp["status"] == "ok"]["context_length"]
        oom = grp[grp["status"] == "oom"]["context_length"]
        rows.append({"label": label, "longest_fit": ran.max() if len(ran) else None,
                     "oom_at": oom.min() if len(oom) else None,
                     "contexts_profiled": ", ".join(str(c) for c in ran)})
    return pd.DataFrame(rows, columns=["label", "longest_fit", "oom_at", "contexts_profiled"])


def coverage_text(summary: pd.DataFrame, *, longest: bool) -> str:
    ok, oom = _ok(summary), summary[summary["status"] == "oom"]
    skipped = summary[summary["status"].str.startswith("skipped")]
    text = f"Profiled {len(ok)} of {len(summary)} points (size × context × mode)"
    if len(oom):
        text += "; out of memory: " + ", ".join(f"{r.label} at {r.context_length} ({r.mode})" for r in oom.itertuples())
    if len(skipped):
        text += f"; skipped: {len(skipped)} ({', '.join(sorted(set(skipped['status'])))})"
    text += "."
    if longest:
        fits = longest_fit(summary)
        text += " Longest power-of-two context whose train step fits: " + "; ".join(
            f"{r.label} {r.longest_fit:.0f}" + (f" ({r.oom_at:.0f} ran out of memory)" if pd.notna(r.oom_at) else
                                                " (the top of the ladder: nothing ran out of memory)")
            for r in fits.itertuples() if pd.notna(r.longest_fit)) + "."
    return text


# ----------------------------------------------------------------------------- (a)


def forward_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Forward time: the harness's timer without the profiler, the same loop under it, the profiled
    forward range's span, and the kernel time inside it."""
    ok = _ok(summary)
    return pd.DataFrame({
        "label": ok["label"], "context": ok["context_length"], "mode": ok["mode"],
        "harness ms": ok["harness_forward_s"] * MS, "harness std ms": ok["harness_forward_std_s"] * MS,
        "profiled ms": ok["profiled_forward_s"] * MS, "profiler overhead": ok["profiler_overhead"],
        "profiled span ms": ok["profiled_forward_span_s"] * MS, "span vs harness": ok["span_vs_harness"],
        "kernel ms": ok["forward_kernel_s"] * MS, "agrees": ok["agrees_within_overhead"].astype(bool),
    }).reset_index(drop=True)


def answer_a(table: pd.DataFrame, *, device: str, busy: float = 0.9) -> str:
    """(a): the profiled forward time against the harness's, split by whether kernels kept the
    device busy (kernel time >= ``busy`` of the span, our cut) or launches set the pace."""
    fa = table[table["mode"] == "forward"]
    if fa.empty:
        return "No forward-only configuration ran, so there is no forward time to compare."
    big = fa.iloc[-1]
    unit = "kernel" if device == "cuda" else "operator"
    n_agree = int(fa["agrees"].sum())
    text = (f"For {big['label']} at {big['context']:.0f} tokens a forward pass takes {big['profiled span ms']:.2f} ms in "
            f"the profile (the forward range's start to its last {unit}'s end), against {big['harness ms']:.2f} ± "
            f"{big['harness std ms']:.2f} ms by the harness's Python timer (synchronise, then `perf_counter`) on the "
            f"same model without the profiler ({big['span vs harness']:+.1%}). ")
    filled = fa["kernel ms"] / fa["profiled span ms"]
    dense, sparse = fa[filled >= busy], fa[filled < busy]
    if len(dense):
        text += (f"Where {unit}s keep the device busy ({unit} time at least {busy:.0%} of the span, our cut: "
                 f"{len(dense)} of {len(fa)} forward-only configurations) the profiled span is "
                 f"{_percent_range(dense['span vs harness'], signed=True)} off the harness's time. ")
    if len(sparse):
        worst = sparse.loc[sparse["span vs harness"].abs().idxmax()]
        text += (f"Where they do not ({', '.join(f'{r.label} {r.context:.0f}' for r in sparse.itertuples())}) the "
                 f"forward is launch-bound, and the profiler's own cost per launch changes the same loop's time by "
                 f"{_percent_range(sparse['profiler overhead'], signed=True)} (the loop run with and without it): the profiled span "
                 f"is up to {worst['span vs harness']:+.0%} off ({worst['label']} at {worst['context']:.0f} tokens, "
                 f"whose {unit}s run for {worst['kernel ms']:.2f} of the span's {worst['profiled span ms']:.2f} ms). ")
    return text + (f"Counting that overhead and two standard deviations of the timing noise, {n_agree} of {len(fa)} "
                   f"profiled forward times agree with the harness.")


# ----------------------------------------------------------------------------- (b)


def top_kernel_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (size, context): the forward pass's top kernel (inference), and the top kernel of the
    train step's forward+backward; whether it is the same kernel (full name)."""
    fwd = _ok(summary, "forward")[["label", "context_length", "top_forward_kernel", "top_forward_category",
                                   "top_forward_share", "top_forward_per_pass", "top_forward_name"]]
    train = _ok(summary, "train_step")
    cols = ["label", "context_length", "top_fwd_bwd_kernel", "top_fwd_bwd_category", "top_fwd_bwd_share",
            "top_fwd_bwd_name"]
    train = train[cols] if "top_fwd_bwd_kernel" in train.columns else pd.DataFrame(columns=cols)
    b = fwd.merge(train, on=["label", "context_length"], how="left")
    b["same kernel leads fwd+bwd"] = b["top_fwd_bwd_name"] == b["top_forward_name"]
    return b.reset_index(drop=True)


def answer_b(table: pd.DataFrame) -> str:
    if table.empty:
        return "No forward-only configuration ran."
    counts = table["top_forward_kernel"].value_counts()
    name = counts.index[0]
    rows = table[table["top_forward_kernel"] == name]
    per_pass = rows.groupby("label", sort=False)["top_forward_per_pass"].agg(lambda x: sorted(set(x)))
    both = table.dropna(subset=["top_fwd_bwd_name"])
    moved = both[~both["same kernel leads fwd+bwd"]]
    text = (f"The kernel with the most cumulative forward time is `{name}` in {counts.iloc[0]} of {len(table)} "
            f"configurations ({rows['top_forward_category'].iloc[0]}; {_percent_range(rows['top_forward_share'], 0)} "
            f"of forward kernel time)")
    if len(counts) > 1:
        text += "; elsewhere it is " + ", ".join(f"`{k}`" for k in counts.index[1:])
    text += (". It is launched " + ", ".join(f"{'/'.join(f'{n:g}' for n in v)} times per forward pass for {lbl}"
                                            for lbl, v in per_pass.items()) + ".")
    if both.empty:
        return text + " No train step ran to compare with forward+backward."
    text += (f" The same kernel also leads the train step's forward+backward in {int(both['same kernel leads fwd+bwd'].sum())} "
             f"of {len(both)} configurations")
    if moved.empty:
        return text + "."
    text += "; where it does not, the leader is " + ", ".join(
        f"`{r.top_fwd_bwd_kernel}` ({r.top_fwd_bwd_category}; {r.label}, {r.context_length})"
        for r in moved.itertuples()) + "."
    n_matmul = int((moved["top_fwd_bwd_category"] == "matmul").sum())
    if n_matmul:
        where = "there" if n_matmul == len(moved) else f"in {n_matmul} of those {len(moved)}"
        text += (f" A backward matmul takes the lead {where}: the gradient GEMMs multiply by transposed operands "
                 "(dX = dY·W, dW = dYᵀ·X), which cuBLAS serves with differently tiled kernels.")
    return text


# ----------------------------------------------------------------------------- (c)


def non_matmul_table(result, *, top: int = 12) -> pd.DataFrame:
    """The largest kernels of one profile's forward pass other than matrix multiplies."""
    fwd = result.kernels(ranges="forward")
    return fwd[fwd["category"] != "matmul"].head(top).drop(columns="name").reset_index(drop=True)


def forward_category_shares(summary: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(summary, "forward")
    cols = {f"fwd_share_{c}": c for c in CATEGORIES if f"fwd_share_{c}" in ok.columns}
    return ok[["label", "context_length", *cols]].rename(columns=cols).reset_index(drop=True)


def answer_c(result, label: str, shares: pd.DataFrame) -> str:
    fwd = result.kernels(ranges="forward")
    non_mm = fwd[fwd["category"] != "matmul"]
    if non_mm.empty:
        return f"For {label} every forward kernel is a matrix multiply."
    lead = non_mm.iloc[0]
    by_cat = non_mm.groupby("category")["share"].sum().sort_values(ascending=False)
    return (f"For {label}, kernels other than matrix multiplies take {non_mm['share'].sum():.1%} of forward kernel "
            f"time: by category " + ", ".join(f"{c} {v:.1%}" for c, v in by_cat.items() if v >= 0.001)
            + f". The largest is `{lead['kernel']}` ({lead['category']}, {lead['share']:.1%}, "
            f"{lead['instances_per_step']:.0f} launches per pass), followed by "
            + ", ".join(f"`{r.kernel}` ({r.share:.1%})" for r in non_mm.iloc[1:5].itertuples())
            + f". Across configurations the non-matmul share of the forward pass runs from "
            f"{_percent_range(1 - shares['matmul'])}: the softmax and the masking of the T×T score matrix, the "
            f"RMSNorm reductions and the SwiGLU / residual elementwise kernels each read and write whole "
            f"activations for a few FLOPs per element.")


# ----------------------------------------------------------------------------- (d)


def category_shares(summary: pd.DataFrame) -> pd.DataFrame:
    """Share of each configuration's kernel time by category (what kernels compute), and for a
    train step the share of each phase (where they ran)."""
    ok = _ok(summary)
    cats = [c for c in CATEGORIES if f"share_{c}" in ok.columns]
    phases = [f"phase_share_{p.replace(' ', '_')}" for p in PHASE_RANGES]
    out = ok[["label", "context_length", "mode"] + [f"share_{c}" for c in cats]].rename(
        columns={f"share_{c}": c for c in cats})
    for col in phases:
        out[col.removeprefix("phase_share_").replace("_", " ") + " (phase)"] = ok[col] if col in ok.columns else None
    return out.reset_index(drop=True)


def answer_d(shares: pd.DataFrame, summary: pd.DataFrame, *, device: str) -> str:
    cats = [c for c in CATEGORIES if c in shares.columns]
    pair = shares.pivot_table(index=["label", "context_length"], columns="mode", values=cats)
    if ("matmul", "forward") not in pair.columns or ("matmul", "train_step") not in pair.columns:
        return "Inference and a train step did not both run at any size and context, so there is no pair to compare."
    pair = pair.dropna()
    mm_inf, mm_train = pair[("matmul", "forward")], pair[("matmul", "train_step")]
    delta = {c: (pair[(c, "train_step")] - pair[(c, "forward")]).median() for c in cats if c != "matmul"}
    grow = max(delta, key=delta.get)
    train = _ok(summary, "train_step")
    unit = "kernels" if device == "cuda" else "operators"
    text = (f"Matrix multiplies take {_percent_range(mm_inf)} of kernel time in inference (forward only) and "
            f"{_percent_range(mm_train)} in a full train step (median change {(mm_train - mm_inf).median():+.1%} "
            f"points over {len(pair)} size × context pairs). The rest shifts by (median, percentage points) "
            + ", ".join(f"{c} {v:+.1%}" for c, v in delta.items()) + f"; {grow} grows most.")
    if "phase_share_optimizer_step" in train.columns and train["phase_share_optimizer_step"].notna().any():
        text += (f" The optimizer step (its range) is {_percent_range(train['phase_share_optimizer_step'])} of a train "
                 f"step's kernel time, in up to {train['optimizer_kernels_per_step'].max():.0f} {unit} per step; by "
                 f"what they compute {train['optimizer_elementwise_share'].median():.0%} (median) of its time is "
                 f"elementwise ({'the multi-tensor `_foreach` kernels' if device == 'cuda' else 'per-parameter operators'}"
                 f" of our AdamW): memory-bound work that reads and writes every parameter, gradient and moment.")
    return text


def plot_category_shares(shares: pd.DataFrame, *, title: str):
    """Stacked category shares per (size, context), inference beside the train step."""
    import matplotlib.pyplot as plt

    modes = [m for m in ("forward", "train_step") if m in set(shares["mode"])]
    cats = [c for c in CATEGORIES if c in shares.columns]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False, sharey=True)
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for ax, mode in zip(axes[0], modes):
        sub = shares[shares["mode"] == mode]
        ticks = [f"{r.label} {r.context_length}" for r in sub.itertuples()]
        bottom = pd.Series(0.0, index=sub.index)
        for cat in cats:
            ax.bar(ticks, sub[cat], bottom=bottom, color=colors[cat], label=cat)
            bottom += sub[cat].fillna(0)
        ax.set_title("inference (forward only)" if mode == "forward" else "train step (fwd + bwd + AdamW)")
        ax.set_xlabel("size, context")
        ax.tick_params(axis="x", labelsize=7, rotation=90)
    axes[0][0].set_ylabel("share of kernel time")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.suptitle(title)
    fig.tight_layout()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)  # beside, not over, the bars
    return fig


# ----------------------------------------------------------------------------- (e)


def softmax_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Forward pass: softmax kernel time against the two attention matmuls', and the same for FLOPs."""
    ok = _ok(summary, "forward")
    mm = ok["attention_scores_matmul_s"] + ok["final_matmul_matmul_s"]
    e = pd.DataFrame({
        "label": ok["label"], "context": ok["context_length"], "softmax ms": ok["softmax_s"] * MS,
        "attention matmuls ms": mm * MS, "softmax / matmul time": ok["softmax_to_matmul_time"],
        "softmax / matmul FLOPs": ok["softmax_to_matmul_flops"]})
    e["time ratio / FLOP ratio"] = e["softmax / matmul time"] / e["softmax / matmul FLOPs"]
    return e.reset_index(drop=True)


def answer_e(table: pd.DataFrame) -> str:
    if table.empty:
        return "No forward-only configuration ran."
    return (f"The softmax performs {_percent_range(table['softmax / matmul FLOPs'], 2)} of the two attention "
            f"matmuls' FLOPs (QKᵀ and PV) but takes {table['softmax / matmul time'].min():.3g}–"
            f"{table['softmax / matmul time'].max():.3g}× their runtime: per FLOP it is "
            f"{table['time ratio / FLOP ratio'].min():.3g}–{table['time ratio / FLOP ratio'].max():.3g}× slower. "
            f"The matmuls reuse each loaded element d_head times; the softmax reads and writes the whole B·H·T² "
            f"score tensor for a handful of FLOPs per element, so memory bandwidth, not arithmetic, sets its time.")


# ----------------------------------------------------------------------------- timeline


def plot_step_timeline(source, *, step: int = -1, ax=None, title: str | None = None):
    """Kernel categories over time in one step, drawn from the Chrome trace (or a ProfileResult's
    items, themselves parsed from it); phases shaded. Returns the figure."""
    import matplotlib.pyplot as plt

    if isinstance(source, (str, Path)):
        items, ranges = parse_trace(source)
        items = attribute(items, ranges)
    else:  # a systems.bench.profile.ProfileResult
        items, ranges = source.items, source.ranges
    n = int(items["step_index"].max()) + 1 if len(items) else 0
    if n == 0:
        raise ValueError("the trace has no kernels inside a 'step' range")
    k = step % n
    steps = ranges[ranges["name"] == STEP_RANGE].sort_values("ts").reset_index(drop=True)
    t0, t1 = steps.loc[k, "ts"], steps.loc[k, "end"]
    mine = items[(items["step_index"] == k) & items["on_timeline"]]
    dur = mine["wall_dur"] if "wall_dur" in mine.columns else mine["dur"]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.2))
    else:
        fig = ax.figure
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for y, cat in enumerate(CATEGORIES):
        sel = mine["category"] == cat
        bars = list(zip((mine.loc[sel, "ts"] - t0) / 1e3, dur[sel] / 1e3))
        if bars:
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors[cat], linewidth=0)
    for i, phase in enumerate(PHASE_RANGES):
        pr = ranges[(ranges["name"] == phase) & (ranges["ts"] >= t0) & (ranges["end"] <= t1 + 1e-3)]
        for r in pr.itertuples():
            ax.axvspan((r.ts - t0) / 1e3, (r.end - t0) / 1e3, color=f"C{i + 6}", alpha=0.12, lw=0,
                       label=phase)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_yticks(range(len(CATEGORIES)), CATEGORIES)
    # GPU work launched inside the step can finish after the CPU range closes (asynchronous
    # launches): keep it in view
    end = max(t1, float((mine["ts"] + dur).max())) if len(mine) else t1
    ax.set_xlim(0, (end - t0) / 1e3)
    ax.set_xlabel("time since step start (ms)")
    what = "GPU kernels" if (mine["device"] == "cuda").any() else "CPU operators"
    ax.set_title(title or f"one step: {what} by category")
    fig.tight_layout()
    return fig
