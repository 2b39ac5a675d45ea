"""Notebook 09's smoke profile, for both handouts (each answers its own problems)."""

from __future__ import annotations

import json

import pytest

from tests.notebooks.smoke import asked, recorded_pairs, run_smoke

NB = "09_parallelism_math"


@pytest.mark.slow
@pytest.mark.parametrize("handout, figures", [("2025", {"mesh_batch_crossover", "ddp_buckets"}),
                                              ("2026", {"dp_crossover", "tp_crossover", "fsdp_tp_region"})])
def test_notebook_09_smoke(tmp_path, handout, figures):
    run_smoke("09", tmp_path, handout=handout)
    made = {p.name for p in (tmp_path / "figures").glob("09_*.png")}
    assert {f"{NB}_{f}.png" for f in figures} <= made
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)


@pytest.mark.slow
def test_notebook_09_uses_measured_bandwidth(tmp_path):
    """With an all-reduce results file the notebook must build the worked example from it."""
    measured = tmp_path / "allreduce.jsonl"
    # times make algbw = size / time: 180 GB/s at 1 GiB, 40 GB/s at 1 MiB (fit: o ~ 20 us, w ~ 180 GB/s)
    rows = [dict(backend="nccl", world_size=2, size_bytes=2**30, algbw_GBps=180.0, busbw_GBps=180.0, status="ok",
                 time_ms=2**30 / 180e9 * 1e3),
            dict(backend="nccl", world_size=2, size_bytes=2**20, algbw_GBps=40.0, busbw_GBps=40.0, status="ok",
                 time_ms=2**20 / 40e9 * 1e3),
            dict(backend="gloo", world_size=2, size_bytes=2**30, algbw_GBps=2.0, busbw_GBps=2.0, status="ok", time_ms=500.0)]
    measured.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    text = run_smoke("09", out, allreduce_results=str(measured)).output.read_text()
    # the rows carry no environment, so no GPU is named for them
    assert "with the NCCL W measured (machine not recorded)" in text and "180" in text
