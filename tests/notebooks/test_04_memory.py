"""Notebook 04's smoke profile, for both handouts (2026 adds (f) and gradient_checkpointing)."""

from __future__ import annotations

import pytest

from tests.notebooks.smoke import asked, recorded, recorded_pairs, run_smoke

NB = "04_memory"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2026", "2025"])
def test_notebook_04_smoke(tmp_path, handout):
    run_smoke("04", tmp_path, handout=handout)
    assert (tmp_path / "figures" / f"{NB}_timeline_train_step.png").exists()
    # every deliverable of this notebook for the handout is answered, once
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
    assert all(a["status"] == "answered" for a in recorded(tmp_path, NB))
    assert (tmp_path / "figures" / f"{NB}_checkpoint_groups.png").exists() == (handout == "2026")
