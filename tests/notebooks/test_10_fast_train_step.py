"""Notebook 10's smoke profile for both handouts: it runs every variant of its plan, draws its
figures, answers the 2026 leaderboard question from a row of the leaderboard's configuration only
(a debug row from the command line is passed over), and records nothing for the 2025 handout,
which gives it no question. It times the GEMMs of a block, both layouts, and answers from them."""

import json
import subprocess
import sys

import pytest

from systems.bench import train_step as ts
from systems.measure.results import read_records


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_10_smoke(tmp_path, handout):
    # a CPU debug row where the notebook looks first: what the CLI appends on a machine without GPUs
    debug = dict(model="debug", batch_size=2, context_length=64, precision="bf16", world_size=2, backend="gloo",
                 status="ok", step_s=0.02, tflops_per_gpu=0.0, per_rank=[], env=dict(gpu=None))
    (tmp_path / "results").mkdir(parents=True)
    (tmp_path / "results" / "12_leaderboard_8b.jsonl").write_text(json.dumps(debug) + "\n")
    proc = subprocess.run([sys.executable, "-m", "systems.workbook", "run", "--only", "10", "--profile", "smoke",
                           "--out-dir", str(tmp_path), "--no-progress", "-p", "handout", handout],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for stem in ("phases", "timeline", "gemms"):
        assert (tmp_path / "figures" / f"10_fast_train_step_{stem}.png").exists()
    rows = read_records(tmp_path / "results" / "10_fast_train_step_steps.jsonl")
    assert {r["variant"] for r in rows} == set(ts.SMOKE_PLAN.variants["debug"])
    assert all(r["status"] == "ok" for r in rows)
    gemm_rows = read_records(tmp_path / "results" / "10_fast_train_step_gemms.jsonl")
    assert {(r["projections"], r["gemm"]) for r in gemm_rows} == {
        (layout, g) for layout in ("separate", "fused") for g in ("forward", "input_grad", "weight_grad")}
    answers = read_records(tmp_path / "results" / "10_fast_train_step_deliverables.jsonl")
    if handout == "2026":
        assert [(a["problem"], a["status"]) for a in answers] == [("leaderboard", "answered")]
    else:
        assert answers == []
    executed = (tmp_path / "writeup" / "executed" / "10_fast_train_step.ipynb").read_text()
    assert "8B model on 2 x NVIDIA H200" in executed and "2 x None" not in executed
    assert "model 'debug'" in executed  # the passed-over row is named, not shown as the 8B step
    assert "QKV and W1/W3 as one GEMM each" in executed  # the smoke plan measures the fused-projections lever
    assert "The matmuls, shape by shape" in executed and "Slowest: " in executed
