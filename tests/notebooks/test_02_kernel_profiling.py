"""Notebook 02 (kernel profiling) in its smoke profile, for each handout."""

import pandas as pd
import pytest

from systems.report.deliverables import deliverables


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_02_smoke(tmp_path, handout):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["02"], profile="smoke", out_dir=tmp_path, report=False, progress=False,
                         parameters={"handout": handout})
    assert runs and runs[0].ok, runs[0].error if runs else "no run"
    for stem in ("train_step_timeline", "categories"):
        assert (tmp_path / "figures" / f"02_kernel_profiling_{stem}.png").exists()
    rows = pd.read_json(tmp_path / "results" / "02_kernel_profiling_summary.jsonl", lines=True)
    assert len(rows) == 12 and (rows["status"] == "ok").all()
    # every nsys_profile question of the handout is answered, once
    answers = pd.read_json(tmp_path / "results" / "02_kernel_profiling_deliverables.jsonl", lines=True)
    asked = sorted(d.part for d in deliverables(handout) if d.notebook == "02_kernel_profiling")
    assert sorted(answers["part"]) == asked and (answers["status"] == "answered").all()
    assert set(answers["handout"].astype(str)) == {handout}
