"""Notebook 07's smoke profile, for both handouts (2025 adds the bucket sweep and its answer)."""

from __future__ import annotations

import pytest

from systems.measure.results import read_records
from tests.notebooks.smoke import asked, recorded_pairs, run_smoke

NB = "07_distributed"


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_07_smoke(tmp_path, handout):
    run = run_smoke("07", tmp_path, handout=handout)
    ddp_rows = read_records(tmp_path / "results" / f"{NB}_ddp.jsonl")
    variants = {r["variant"] for r in ddp_rows}
    assert {"nosync", "naive", "flat", "overlap", "torch_ddp"} <= variants
    assert {r["precision"] for r in ddp_rows} == {"fp32", "bf16"}
    # the read variant maps the other GPU's memory: on gloo it is a row that says why it did not run
    assert [r["status"] for r in ddp_rows if r["variant"] == "peer_update:read"] == ["not run (needs exactly 2 GPUs)"]
    assert read_records(tmp_path / "results" / f"{NB}_overlap.jsonl")
    rounds = read_records(tmp_path / "results" / f"{NB}_paired.jsonl")
    assert [r["round"] for r in rounds] == [0, 1] and all(r["status"] == "ok" for r in rounds)
    # torch DDP runs inside the rounds too, and the targets give its ratio within them
    assert all(r["torch_ddp_ms"] > 0 for r in rounds)
    stems = ["allreduce", "ddp_variants", "overlap"] + (["bucket_model"] if handout == "2025" else [])
    for stem in stems:
        assert (tmp_path / "figures" / f"{NB}_{stem}.png").exists()
    # every deliverable of this handout that notebook 07 answers is answered, exactly once
    assert recorded_pairs(tmp_path, NB) == asked(handout, NB)
    # the committed all-reduce runs are folded in, each named by machine
    text = run.output.read_text()
    assert "by the rounds' median it runs at" in text
    assert "13_allreduce_nccl_8xH200.jsonl" in text and "8x NVIDIA H200" in text
