"""Fits of models to measurements, against data made from known parameters."""

import pytest

from systems.analysis.fits import fit_latency_bandwidth


def test_fit_recovers_latency_and_bandwidth():
    o, w = 50e-6, 100e9
    sizes = [1e6, 1e7, 1e8, 1e9]
    fo, fw = fit_latency_bandwidth(sizes, [o + s / w for s in sizes])
    assert fo == pytest.approx(o, rel=1e-6) and fw == pytest.approx(w, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_latency_bandwidth([1e6], [1e-3])
