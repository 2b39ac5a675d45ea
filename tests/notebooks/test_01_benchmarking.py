"""Notebook 01 (benchmarking) in its smoke profile through the command line, for each handout."""

import subprocess
import sys

import pandas as pd
import pytest

from systems.measure.env import REPO_ROOT


@pytest.mark.slow
@pytest.mark.parametrize("handout", ["2025", "2026"])
def test_notebook_01_smoke_through_the_cli(tmp_path, handout):
    proc = subprocess.run([sys.executable, "-m", "systems.workbook", "run", "--only", "01", "--profile", "smoke",
                           "--out-dir", str(tmp_path), "--no-progress", "-p", "handout", handout],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    html = (tmp_path / "writeup" / "report.html").read_text()
    # the answers render under their deliverable anchors (they read "Answer (b)" before nb.answer)
    for part in ("a", "b", "c"):
        assert f'id="{handout}-benchmarking_script-{part}"' in html
    assert "benchmarking_script (b)" in html and "benchmarking_script (c)" in html
    for stem in ("phases", "warmup"):
        assert (tmp_path / "figures" / f"01_benchmarking_{stem}.png").stat().st_size > 5000
    for stem in ("timings", "warmup"):
        assert (tmp_path / "results" / f"01_benchmarking_{stem}.jsonl").exists()
    timings = pd.read_json(tmp_path / "results" / "01_benchmarking_timings.jsonl", lines=True)
    assert sorted(timings["mode"]) == ["forward", "train_step"] and (timings["status"] == "ok").all()
