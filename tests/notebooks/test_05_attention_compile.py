"""Notebook 05's smoke profile, for both handouts (their Table 1 sizes name the whole-model rows)."""

from __future__ import annotations

import pytest

from systems.measure.results import read_records
from systems.report.deliverables import deliverables


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2026", "2025"])
def test_notebook_05_smoke(tmp_path, handout):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["05"], profile="smoke", out_dir=tmp_path, report=False, progress=False,
                         parameters={"handout": handout})
    assert len(runs) == 1 and runs[0].ok, runs[0].error
    assert (tmp_path / "results" / "05_attention_compile_attention_eager.jsonl").exists()
    assert (tmp_path / "figures" / "05_attention_compile_saved_memory.png").exists()
    assert (tmp_path / "figures" / "05_attention_compile_model_compile.png").exists()
    answers = read_records(tmp_path / "results" / "05_attention_compile_deliverables.jsonl")
    want = sorted((d.problem, d.part) for d in deliverables(handout) if d.notebook == "05_attention_compile")
    assert sorted((a["problem"], a["part"]) for a in answers) == want
