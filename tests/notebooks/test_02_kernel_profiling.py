"""Notebook 02 (kernel profiling) in its smoke profile, for each handout."""

import pytest

from systems.measure.results import read_records
from tests.notebooks.smoke import asked, recorded, recorded_pairs, run_smoke

NB = "02_kernel_profiling"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_02_smoke(tmp_path, handout):
    run_smoke("02", tmp_path, handout=handout)
    for stem in ("train_step_timeline", "categories"):
        assert (tmp_path / "figures" / f"{NB}_{stem}.png").exists()
    rows = read_records(tmp_path / "results" / f"{NB}_summary.jsonl")
    assert len(rows) == 12 and all(r["status"] == "ok" for r in rows)
    # every nsys_profile question of the handout is answered, once
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
    answers = recorded(tmp_path, NB)
    assert all(a["status"] == "answered" for a in answers)
    assert {str(a["handout"]) for a in answers} == {handout}
