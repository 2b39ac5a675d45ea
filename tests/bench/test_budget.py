"""systems.bench.budget: a sweep's wall-clock allowance."""

import pytest

from systems.bench.budget import SKIPPED, Budget


def test_allows_until_the_allowance_is_spent():
    now = [0.0]
    budget = Budget(seconds=10, clock=lambda: now[0])
    assert budget.allows()
    now[0] = 9.99
    assert budget.allows() and budget.elapsed() == pytest.approx(9.99)
    now[0] = 10.0
    assert not budget.allows()
    assert budget.skipped_row() == {"status": SKIPPED, "error": "the sweep's 10 s budget was spent"}


def test_no_limit_and_bad_input():
    now = [0.0]
    budget = Budget(clock=lambda: now[0])
    now[0] = 1e9
    assert budget.allows()
    for bad in (0, -5):
        with pytest.raises(ValueError, match="seconds must be > 0"):
            Budget(seconds=bad)
