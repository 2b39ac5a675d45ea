"""Notebook 07's smoke profile, for both handouts (2025 adds the bucket sweep and its answer)."""

from __future__ import annotations

import pytest

from systems.measure.results import read_records
from systems.workbook import run_notebooks


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_07_smoke(tmp_path, handout):
    (run,) = run_notebooks(only=["07"], profile="smoke", out_dir=tmp_path, parameters={"handout": handout},
                           report=False, progress=False)
    assert run.ok, run.error
    ddp_rows = read_records(tmp_path / "results" / "07_distributed_ddp.jsonl")
    variants = {r["variant"] for r in ddp_rows}
    assert {"nosync", "naive", "flat", "overlap", "torch_ddp"} <= variants
    assert {r["precision"] for r in ddp_rows} == {"fp32", "bf16"}
    assert read_records(tmp_path / "results" / "07_distributed_overlap.jsonl")
    stems = ["allreduce", "ddp_variants", "overlap"] + (["bucket_model"] if handout == "2025" else [])
    for stem in stems:
        assert (tmp_path / "figures" / f"07_distributed_{stem}.png").exists()
    # every deliverable of this handout that notebook 07 answers is answered, exactly once
    from systems.report.deliverables import deliverables

    wanted = {(d.problem, d.part) for d in deliverables(handout) if d.notebook == "07_distributed"}
    answered = [(r["problem"], r["part"]) for r in read_records(tmp_path / "results" / "07_distributed_deliverables.jsonl")]
    assert sorted(answered) == sorted(wanted)
    # the committed all-reduce runs are folded in, each named by machine
    text = run.output.read_text()
    assert "13_allreduce_nccl_8xH200.jsonl" in text and "8x NVIDIA H200" in text
