"""Notebook 02 (kernel profiling): figures.

``plot_step_timeline``: kernel categories over time in one profiled step, from the trace.
"""

from __future__ import annotations

from pathlib import Path

from systems.measure.profiler import CATEGORIES, PHASE_RANGES, attribute, parse_trace
from systems.measure.trace import STEP_RANGE


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

