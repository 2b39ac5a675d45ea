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


def test_a_point_expected_to_overrun_does_not_start():
    now = [0.0]
    budget = Budget(seconds=10, clock=lambda: now[0])
    now[0] = 6.0
    # 4 s left: a point expected to take 3.9 s may start, one expected to take 4 s may not
    assert budget.allows(need_s=3.9) and not budget.allows(need_s=4.0)
    assert Budget(clock=lambda: now[0]).allows(need_s=1e9)  # no limit: any estimate
