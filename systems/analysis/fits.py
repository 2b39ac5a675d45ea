"""Models fitted to measurements: the alpha-beta model of a collective's time, and power laws
(how saved memory grows with sequence length)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


def fit_latency_bandwidth(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = o + s / w (the alpha-beta model): (o seconds, w bytes/s algbw)."""
    s, t = np.asarray(sizes_bytes, float), np.asarray(times_s, float)
    if len(s) < 2 or len(set(s.tolist())) < 2:
        raise ValueError("need at least two distinct sizes to fit latency and bandwidth")
    slope, intercept = np.polyfit(s, t, 1)
    return max(float(intercept), 0.0), float(1.0 / slope)


@dataclass
class PowerLawFit:
    """y = prefactor * x ** exponent, fitted in log-log space."""

    exponent: float
    prefactor: float
    r2: float  # of the log-log regression
    n: int

    def predict(self, x) -> np.ndarray:
        return self.prefactor * np.asarray(x, dtype=float) ** self.exponent


def fit_power_law(x: Iterable[float], y: Iterable[float]) -> PowerLawFit:
    """Least squares of log y = log a + b log x; returns b as the exponent."""
    x, y = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need at least two (x, y) pairs of equal length, got {x.size} and {y.size}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("a log-log fit needs positive x and y")
    if np.unique(x).size < 2:
        raise ValueError("a fit needs at least two distinct x values")
    lx, ly = np.log(x), np.log(y)
    b, log_a = np.polyfit(lx, ly, 1)
    resid = ly - (log_a + b * lx)
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return PowerLawFit(exponent=float(b), prefactor=float(np.exp(log_a)), r2=r2, n=int(x.size))
