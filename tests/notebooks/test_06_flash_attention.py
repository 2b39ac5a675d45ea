"""Notebook 06's smoke profile for both handouts: it runs, writes its rows and figure, and records
exactly one answer (or a reason it could not) for every deliverable the handout gives it."""

import pytest

from systems.measure.results import read_records
from tests.notebooks.smoke import asked, recorded, recorded_pairs, run_smoke

NB = "06_flash_attention"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_06_smoke(tmp_path, handout):
    run_smoke("06", tmp_path, handout=handout)
    results = tmp_path / "results"
    checks = read_records(results / f"{NB}_check.jsonl")
    checks += read_records(results / f"{NB}_check_interpreter.jsonl")
    assert {r["impl"] for r in checks} == {"flash_pytorch", "triton"} and all(r["saves_lse"] for r in checks)
    sweep = read_records(results / f"{NB}_sweep.jsonl")
    assert sweep and all(r["status"] == "ok" and r["e2e_tflops"] > 0 for r in sweep)
    # no Triton point in the smoke grid, so no plans and no empty plans file
    assert not (results / f"{NB}_plans.jsonl").exists()
    assert (tmp_path / "figures" / f"{NB}_tflops.png").stat().st_size > 5000
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
    answers = recorded(tmp_path, NB)
    assert {r["handout"] for r in answers} == {handout}
    statuses = {(r["problem"], r["part"]): r["status"] for r in answers}
    assert statuses.pop(("flash_benchmarking", "a")) == "not run"  # it times GPU kernels
    assert set(statuses.values()) == {"answered"}
