"""Models fitted to measurements: the alpha-beta model of a collective's time."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def fit_latency_bandwidth(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = o + s / w (the alpha-beta model): (o seconds, w bytes/s algbw)."""
    s, t = np.asarray(sizes_bytes, float), np.asarray(times_s, float)
    if len(s) < 2 or len(set(s.tolist())) < 2:
        raise ValueError("need at least two distinct sizes to fit latency and bandwidth")
    slope, intercept = np.polyfit(s, t, 1)
    return max(float(intercept), 0.0), float(1.0 / slope)
