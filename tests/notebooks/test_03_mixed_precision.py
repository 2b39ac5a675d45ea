"""Notebook 03 (mixed precision) in its smoke profile, for each handout."""

import pytest

from tests.notebooks.smoke import asked, recorded_pairs, run_smoke

NB = "03_mixed_precision"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_03_smoke(tmp_path, handout):
    run_smoke("03", tmp_path, handout=handout)
    assert (tmp_path / "figures" / f"{NB}_bf16_speedup.png").exists()
    assert (tmp_path / "figures" / f"{NB}_layernorm.png").exists()
    for stem in ("accumulation", "dtypes", "layernorm", "bf16_vs_fp32"):
        assert (tmp_path / "results" / f"{NB}_{stem}.jsonl").exists()
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
