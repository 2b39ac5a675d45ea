"""The one timer's statistics and marks on the host clock (the device clock is exercised by the GPU
tests of every harness that times a step)."""

import time

import pytest
import torch

from systems.measure.timer import Marks, median_p10_p90


def test_median_and_percentiles():
    assert median_p10_p90([3.0]) == (3.0, 3.0, 3.0)
    median, p10, p90 = median_p10_p90([float(v) for v in range(11)])
    assert (median, p10, p90) == (5.0, 1.0, 9.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_p10_p90([])


def test_marks_across_steps_span_them():
    first, second = Marks(torch.device("cpu")), Marks(torch.device("cpu"))
    first.mark("start")
    time.sleep(0.01)
    first.mark("optimizer")
    second.mark("start")
    time.sleep(0.01)
    second.mark("optimizer")
    span = second.ms_since(first, "start", "optimizer")
    # the span holds both steps: at least their sum, and it agrees with the host clock's marks
    assert span >= first.ms("start", "optimizer") + second.ms("start", "optimizer")
    assert span == pytest.approx((second.points["optimizer"] - first.points["start"]) * 1e3)
    with pytest.raises(KeyError, match="no mark"):
        second.ms_since(first, "forward", "optimizer")
