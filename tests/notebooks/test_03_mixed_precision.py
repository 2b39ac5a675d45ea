"""Notebook 03 (mixed precision) in its smoke profile, for each handout."""

import pandas as pd
import pytest

from systems.report.deliverables import deliverables


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_03_smoke(tmp_path, handout):
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=["03"], profile="smoke", out_dir=tmp_path, report=False, progress=False,
                         parameters={"handout": handout})
    assert len(runs) == 1
    assert runs[0].ok, runs[0].error
    assert (tmp_path / "figures" / "03_mixed_precision_bf16_speedup.png").exists()
    assert (tmp_path / "figures" / "03_mixed_precision_layernorm.png").exists()
    for stem in ("accumulation", "dtypes", "layernorm", "bf16_vs_fp32"):
        assert (tmp_path / "results" / f"03_mixed_precision_{stem}.jsonl").exists()
    answers = pd.read_json(tmp_path / "results" / "03_mixed_precision_deliverables.jsonl", lines=True)
    asked = sorted((d.problem, d.part) for d in deliverables(handout) if d.notebook == "03_mixed_precision")
    assert sorted(zip(answers["problem"], answers["part"].fillna(""))) == asked
