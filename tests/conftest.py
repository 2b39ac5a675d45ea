"""Fixtures shared by several component test files."""

import pytest


def _trace_event(name: str, cat: str, ts: float, dur: float, tid: int = 7, ext: int | None = None) -> dict:
    """One complete ("X") Chrome-trace event as torch.profiler exports it; ``ext`` is the
    "External id" that ties a GPU annotation to its CPU range."""
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}
    if ext is not None:
        e["args"] = {"External id": ext}
    return e


@pytest.fixture
def trace_event():
    return _trace_event
