"""A wall-clock allowance for a sweep, so a notebook's full profile ends on time.

    budget = Budget(seconds=300)
    for point in points:
        if not budget.allows():
            rows.append({..., "status": SKIPPED})   # "skipped (budget)": the point is listed, not run
            continue
        ...

A point starts only while the time spent since the budget was made is under its allowance, so a
sweep overruns by at most its one longest point: sweeps order their points smallest first and
the notebooks set each allowance that far below their own limit. A sweep that can estimate a
point's time from an earlier one passes it (``allows(need_s=...)``), and then overruns by no more
than its estimate's error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

SKIPPED = "skipped (budget)"


@dataclass
class Budget:
    seconds: float | None = None  # None: no limit
    clock: Callable[[], float] = time.perf_counter
    start: float = field(init=False)

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0 or None (no limit), got {self.seconds!r}")
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def allows(self, need_s: float = 0.0) -> bool:
        """Whether another point, expected to take ``need_s`` seconds, may start."""
        return self.seconds is None or self.elapsed() + need_s < self.seconds

    def skipped_row(self) -> dict:
        """The fields a row for a point the budget left out carries."""
        return {"status": SKIPPED, "error": f"the sweep's {self.seconds:.0f} s budget was spent"}
