"""Figures for the parallelism-math notebook (09): compute against communication time."""

from __future__ import annotations

from typing import Callable

import matplotlib.pyplot as plt
import numpy as np

from systems.analysis import parallel_math as pm


def mark_crossover(ax, x: float, label: str, *, color: str = "k") -> None:
    """A dashed vertical line at the crossover, labelled along it."""
    ax.axvline(x, color=color, ls="--", lw=1)
    ax.annotate(label, xy=(x, 0.5), xycoords=("data", "axes fraction"), rotation=90, va="center", ha="right",
                fontsize=8, color=color)


def crossover_panel(ax, *, compute: Callable[[float], float], comm: Callable[[float], float], bound: float,
                    n_max: float, title: str, n_points: int, comm_label: str = "communication") -> np.ndarray:
    """Compute and communication time (ms per layer) against device count N, crossover marked."""
    ns = np.linspace(1, n_max, n_points)
    ax.plot(ns, [compute(n) * 1e3 for n in ns], label="compute")
    ax.plot(ns, [comm(n) * 1e3 for n in ns], label=comm_label)
    mark_crossover(ax, bound, f"N = {bound:.1f}")
    ax.set(title=title, xlabel="devices N", ylabel="ms per layer", yscale="log")
    ax.legend(fontsize=8)
    return ns


def bucket_overhead_figure(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float,
                           title: str, n_points: int):
    """Bucketed-DDP exposed overhead against bucket size, with the model's optimum marked."""
    sizes_mb = np.geomspace(0.1, total_bytes / 1e6, n_points)
    over = [pm.ddp_bucket_overhead(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                   per_call_overhead_s=per_call_overhead_s, n_buckets=total_bytes / (mb * 1e6)) * 1e3
            for mb in sizes_mb]
    best = pm.optimal_bucket_bytes(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                   per_call_overhead_s=per_call_overhead_s) / 1e6
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sizes_mb, over)
    mark_crossover(ax, best, f"optimum {best:,.0f} MB")
    ax.set(xscale="log", yscale="log", xlabel="bucket size (MB)", ylabel="overhead after backward (ms)", title=title)
    return fig
