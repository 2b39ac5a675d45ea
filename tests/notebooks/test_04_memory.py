"""Notebook 04's smoke profile, for both handouts (2026 adds (f) and gradient_checkpointing)."""

from __future__ import annotations

import pytest

from systems.measure.results import read_records
from systems.report.deliverables import deliverables


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2026", "2025"])
def test_notebook_04_smoke(tmp_path, handout):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["04"], profile="smoke", out_dir=tmp_path, report=False, progress=False,
                         parameters={"handout": handout})
    assert runs and runs[0].ok, runs[0].error if runs else "no run"
    assert (tmp_path / "figures" / "04_memory_timeline_train_step.png").exists()
    # every deliverable of this notebook for the handout is answered, once
    answers = read_records(tmp_path / "results" / "04_memory_deliverables.jsonl")
    got = sorted((a["problem"], a["part"]) for a in answers)
    want = sorted((d.problem, d.part) for d in deliverables(handout) if d.notebook == "04_memory")
    assert got == want and all(a["status"] == "answered" for a in answers)
    assert (tmp_path / "figures" / "04_memory_checkpoint_groups.png").exists() == (handout == "2026")
