"""The one timer's statistics and marks on the host clock (the device clock is exercised by the GPU
tests of every harness that times a step)."""

import time

import pytest
import torch

from systems.measure.timer import Marks, launch_pace, median_p10_p90, slowest_rank_median


def test_median_and_percentiles():
    assert median_p10_p90([3.0]) == (3.0, 3.0, 3.0)
    median, p10, p90 = median_p10_p90([float(v) for v in range(11)])
    assert (median, p10, p90) == (5.0, 1.0, 9.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_p10_p90([])


def test_slowest_rank_median():
    # per step the slowest rank: max(1, 3, 2) = 3, max(5, 1, 2) = 5, max(2, 6, 2) = 6, max(4, 2, 9) = 9;
    # the third rank's fifth step is past the others' last, so left out. Median of [3, 5, 6, 9]: 5.5;
    # inclusive percentiles at positions 0.3 and 2.7 of the sorted four: 3 + 0.3 * 2 = 3.6, 6 + 0.7 * 3 = 8.1
    median, p10, p90 = slowest_rank_median([[1.0, 5.0, 2.0, 4.0], [3.0, 1.0, 6.0, 2.0], [2.0, 2.0, 2.0, 9.0, 100.0]])
    assert median == 5.5
    assert p10 == pytest.approx(3.6) and p90 == pytest.approx(8.1)  # float rounding of the interpolation
    assert slowest_rank_median([[2.0]]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="at least one rank"):
        slowest_rank_median([])


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


def test_launch_pace_times_the_ops_it_issues(monkeypatch):
    # a clock that advances 5 us per call: one read before and one after each batch of 10 ops
    # (the adds themselves do not read it) gives 5 us / 10 ops = 0.5 us per op in every batch
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 5e-6)
    pace = launch_pace("cpu", ops=10, repeats=3)
    assert pace == pytest.approx({"median_us": 0.5, "p10_us": 0.5, "p90_us": 0.5})
    monkeypatch.undo()
    real = launch_pace("cpu", ops=200, repeats=5)
    assert 0 < real["p10_us"] <= real["median_us"] <= real["p90_us"]
    with pytest.raises(ValueError, match="ops >= 1"):
        launch_pace("cpu", ops=0)


@pytest.mark.slow
def test_launch_pace_in_a_child_process_measures_there(monkeypatch):
    # this process can neither make a tensor nor read the clock: only a spawned interpreter, which
    # imports the modules afresh, can measure (the GPU test in tests/report/test_notebook.py checks
    # that the caller then holds no CUDA context)
    def refuse(*args, **kwargs):
        raise AssertionError("measured in the calling process")

    monkeypatch.setattr(torch, "zeros", refuse)
    monkeypatch.setattr(time, "perf_counter", refuse)
    pace = launch_pace("cpu", ops=200, repeats=3, in_child=True)
    assert set(pace) == {"median_us", "p10_us", "p90_us"}
    assert 0 < pace["p10_us"] <= pace["median_us"] <= pace["p90_us"]
    with pytest.raises(AssertionError, match="calling process"):
        launch_pace("cpu", ops=200, repeats=3)
