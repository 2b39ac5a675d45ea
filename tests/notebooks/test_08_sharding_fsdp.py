"""Notebook 08's smoke profile, for both handouts (2026 adds FSDP and its accounting)."""

from __future__ import annotations

import pytest

from systems.measure.results import read_records
from systems.report.deliverables import deliverables
from systems.workbook import run_notebooks


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_08_smoke(tmp_path, handout):
    runs = run_notebooks(only=["08"], profile="smoke", out_dir=tmp_path, parameters={"handout": handout},
                         report=False, progress=False)
    assert runs and runs[0].ok, runs[0].error if runs else "no run"
    for stem in ("optimizer", "fsdp", "gathers", "check"):
        assert (tmp_path / "results" / f"08_sharding_fsdp_{stem}.jsonl").exists()
    for stem in ("fsdp_vs_fsdp2", "gather_timeline", "gather_slack"):
        assert (tmp_path / "figures" / f"08_sharding_fsdp_{stem}.png").stat().st_size > 5000
    wanted = {(d.problem, d.part) for d in deliverables(handout) if d.notebook == "08_sharding_fsdp"}
    answered = [(r["problem"], r["part"]) for r in read_records(tmp_path / "results" / "08_sharding_fsdp_deliverables.jsonl")]
    assert sorted(answered) == sorted(wanted)
