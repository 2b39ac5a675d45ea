"""Notebook 08 (sharding and FSDP): figures."""

from __future__ import annotations


def plot_timeline(ax, timeline: dict, *, title: str = "", window: tuple[float, float] | None = None) -> None:
    """Three lanes (compute, all-gather, reduce-scatter) with the units' forward ranges shaded."""
    lo, hi = window or (timeline["step"] or (0.0, max(b for _, b in timeline["compute"])))
    clip = lambda xs: [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in xs if b > lo and a < hi]  # noqa: E731
    ax.broken_barh(clip(timeline["compute"]), (20, 8), facecolors="tab:blue")
    ax.broken_barh(clip(timeline["gather"]), (10, 8), facecolors="tab:orange")
    ax.broken_barh(clip(timeline["reduce"]), (0, 8), facecolors="tab:green")
    for k, (_, a, b) in enumerate(timeline["units"]):
        if b > lo and a < hi:
            ax.axvspan(max(a, lo), min(b, hi), color="0.85" if k % 2 else "0.93", zorder=0)
    comm = "NCCL" if timeline["kind"] == "gpu" else "gloo"
    ax.set_yticks([4, 14, 24], [f"{comm} reduce-scatter", f"{comm} all-gather", "compute"])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time in step (ms); shaded: one unit's forward each")
    if title:
        ax.set_title(title)
