"""Notebook 05's smoke profile, for both handouts (their Table 1 sizes name the whole-model rows)."""

from __future__ import annotations

import pytest

from tests.notebooks.smoke import asked, recorded_pairs, run_smoke

NB = "05_attention_compile"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2026", "2025"])
def test_notebook_05_smoke(tmp_path, handout):
    run_smoke("05", tmp_path, handout=handout)
    assert (tmp_path / "results" / f"{NB}_attention_eager.jsonl").exists()
    assert (tmp_path / "figures" / f"{NB}_saved_memory.png").exists()
    assert (tmp_path / "figures" / f"{NB}_model_compile.png").exists()
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
