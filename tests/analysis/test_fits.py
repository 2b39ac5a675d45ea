"""Fits of models to measurements, against data made from known parameters."""

import numpy as np
import pytest

from systems.analysis.fits import fit_latency_bandwidth, fit_power_law


def test_fit_recovers_latency_and_bandwidth():
    o, w = 50e-6, 100e9
    sizes = [1e6, 1e7, 1e8, 1e9]
    fo, fw = fit_latency_bandwidth(sizes, [o + s / w for s in sizes])
    assert fo == pytest.approx(o, rel=1e-6) and fw == pytest.approx(w, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_latency_bandwidth([1e6], [1e-3])


def test_fit_power_law_recovers_exponent():
    x = np.array([256, 1024, 4096, 8192, 16384], dtype=float)
    fit = fit_power_law(x, 3.0 * x**2)
    assert fit.exponent == pytest.approx(2.0, abs=1e-9) and fit.prefactor == pytest.approx(3.0, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    noisy = 5.0 * x**1.5 * np.exp(rng.normal(0, 0.02, x.size))  # 2 % multiplicative noise
    assert fit_power_law(x, noisy).exponent == pytest.approx(1.5, abs=0.05)
    # quadratic plus a linear term: the fit sits just under 2, as for P plus the output
    mixed = 8 * x**2 * 4 + 8 * x * 128 * 4
    assert 1.9 < fit_power_law(x, mixed).exponent < 2.0
    with pytest.raises(ValueError):
        fit_power_law([1, 2], [1, -1])
    with pytest.raises(ValueError):
        fit_power_law([2, 2], [1, 3])
