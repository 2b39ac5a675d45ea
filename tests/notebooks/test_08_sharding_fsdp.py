"""Notebook 08's smoke profile, for both handouts (2026 adds FSDP and its accounting)."""

from __future__ import annotations

import pytest

from tests.notebooks.smoke import asked, recorded_pairs, run_smoke

NB = "08_sharding_fsdp"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_08_smoke(tmp_path, handout):
    run_smoke("08", tmp_path, handout=handout)
    for stem in ("optimizer", "fsdp", "gathers", "check"):
        assert (tmp_path / "results" / f"{NB}_{stem}.jsonl").exists()
    for stem in ("fsdp_vs_fsdp2", "gather_timeline", "gather_slack"):
        assert (tmp_path / "figures" / f"{NB}_{stem}.png").stat().st_size > 5000
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
