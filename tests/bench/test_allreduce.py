"""All-reduce benchmark: runnable/not-run planning, bandwidth maths and real gloo rows."""

from __future__ import annotations

import pytest

from systems.bench import allreduce as arb
from systems.measure.results import read_records

MB = arb.MB


def test_plan_marks_world_sizes_beyond_the_gpus_not_run():
    plan = arb.plan_cases(backends=["nccl"], n_gpus=2)
    assert {(c.world_size, c.size_bytes) for c in plan.run} == {(2, s) for s in arb.HANDOUT_SIZES_BYTES}
    assert len(plan.not_run) == 2 * len(arb.HANDOUT_SIZES_BYTES)
    assert all("needs" in reason and "has 2" in reason for _, reason in plan.not_run)


def test_plan_applies_gloo_caps():
    plan = arb.plan_cases(backends=["gloo"], world_sizes=[2, 4], sizes_bytes=[MB, 10 * MB, 100 * MB],
                          max_gloo_world_size=2, max_gloo_bytes=10 * MB)
    assert [(c.world_size, c.size_bytes) for c in plan.run] == [(2, MB), (2, 10 * MB)]
    reasons = {(c.world_size, c.size_bytes): r for c, r in plan.not_run}
    assert "size" in reasons[(2, 100 * MB)] and "world size" in reasons[(4, MB)]
    with pytest.raises(ValueError, match="backend"):
        arb.plan_cases(backends=["mpi"])


def test_summary_uses_slowest_rank_and_bus_factor():
    gathered = [{"rank": 0, "times": [0.010, 0.020, 0.030], "ok": True},
                {"rank": 1, "times": [0.012, 0.018, 0.040], "ok": True}]
    row = arb.summarise(gathered, backend="gloo", device="cpu", world_size=4, size_bytes=10 * MB)
    assert row["time_ms"] == pytest.approx(20.0)  # median of per-iteration maxima 12, 20, 40 ms
    assert row["algbw_GBps"] == pytest.approx(10 * MB / 0.020 / 1e9)
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 3 / 4)
    assert row["rank_spread_ms"] == pytest.approx(2.0)
    assert arb.bus_bandwidth_factor(2) == 1.0


@pytest.mark.slow
def test_gloo_run_writes_rows_and_not_run_rows(tmp_path):
    plan = arb.plan_cases(backends=["gloo"], world_sizes=[2, 6], sizes_bytes=[100_000, 1 * MB],
                          max_gloo_world_size=2)
    out = tmp_path / "allreduce.jsonl"
    arb.run_benchmark(plan, out, budget_s=0.05, min_iters=3, max_iters=5, timeout_s=60, progress=False)
    records = read_records(out)
    ok = [r for r in records if r["status"] == "ok"]
    not_run = [r for r in records if r["status"] == "not_run"]
    assert sorted(r["size_bytes"] for r in ok) == [100_000, MB]
    assert {r["world_size"] for r in not_run} == {6} and len(not_run) == 2
    for r in ok:
        assert r["correct"] is True  # the reduced values equal 1 + 2
        assert {"backend", "device", "world_size", "size_bytes", "time_ms", "time_ms_p10", "time_ms_p90",
                "rank_spread_ms", "algbw_GBps", "busbw_GBps", "status", "env"} <= r.keys()
        assert (r["backend"], r["device"], r["world_size"], r["warmup"]) == ("gloo", "cpu", 2, 5)
        assert 3 <= r["iters"] <= 5
        assert r["time_ms_p10"] <= r["time_ms"] <= r["time_ms_p90"]
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_ms"] / 1e3) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(n-1)/n = 1 at n = 2
    for r in not_run:
        assert r["time_ms"] is None and "world size" in r["reason"]


def test_the_command_writes_under_build_by_default(monkeypatch):
    """Without --out the rows never land in the committed results/ (they once replaced
    results/07_distributed_allreduce.jsonl); a re-run resumes unless --append is given."""
    assert arb.DEFAULT_OUT.startswith("build/")
    calls = []
    monkeypatch.setattr(arb, "run_benchmark", lambda plan, out_path, **kwargs: calls.append((out_path, kwargs)) or [])
    arb.main(["--backend", "gloo", "--world-sizes", "2", "--sizes-mb", "1"])
    arb.main(["--backend", "gloo", "--world-sizes", "2", "--sizes-mb", "1", "--append", "--out", "x.jsonl"])
    assert calls == [(arb.DEFAULT_OUT, {"existing": "resume"}), ("x.jsonl", {"existing": "append"})]


@pytest.mark.slow
def test_a_rerun_resumes_and_append_measures_again(tmp_path):
    """Rows already in the file for this machine are kept and skipped; --append adds new ones
    below; a row from another machine does not count as done."""
    import json

    out = tmp_path / "allreduce.jsonl"
    foreign = {"backend": "gloo", "world_size": 2, "size_bytes": 2 * MB, "status": "ok", "time_ms": 1.0,
               "env": {"hostname": "elsewhere", "gpu": None, "gpu_count": 0, "cpu": "x86_64"}}
    out.write_text(json.dumps(foreign) + "\n")
    plan = arb.plan_cases(backends=["gloo"], world_sizes=[2], sizes_bytes=[100_000, 2 * MB])
    budget = dict(budget_s=0.05, min_iters=3, max_iters=3, timeout_s=60, progress=False)
    first = arb.run_benchmark(plan, out, **budget)
    assert sorted(r["size_bytes"] for r in first) == [100_000, 2 * MB]  # the foreign row is no excuse
    assert arb.run_benchmark(plan, out, **budget) == []  # everything is there for this machine
    again = arb.run_benchmark(plan, out, existing="append", **budget)
    assert len(again) == 2
    records = read_records(out)
    assert records[0]["env"]["hostname"] == "elsewhere" and len(records) == 1 + 2 + 2
    with pytest.raises(ValueError, match="existing must be one of"):
        arb.run_benchmark(plan, out, existing="overwrite")


@pytest.mark.slow
def test_ctrl_c_keeps_the_rows_measured_so_far_and_the_rerun_finishes(tmp_path):
    """Interrupt the command once its first row is in the file: the row stays (rows are written
    as measured and nothing is deleted), and the same command run again measures only the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "allreduce.jsonl"
    sizes = ["24", "32", "40", "48", "56", "64", "72", "80"]
    cmd = [sys.executable, "-m", "systems.bench.allreduce", "--backend", "gloo", "--world-sizes", "2",
           "--sizes-mb", *sizes, "--out", str(out)]
    # a size runs up to 50 calls or 2 s: gloo takes about 30 ms a call for 32 MB on a CI core, so
    # each size lasts 1-2 s and the interrupt (polled every 0.2 s) lands while later sizes remain;
    # sub-MB sizes finished all eight in milliseconds and raced the interrupt
    # SIGINT back to its default in the child: a shell starts background jobs with it ignored, and
    # Python (and so the command and its ranks) then keeps ignoring Ctrl-C
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and read_records(out)):
        time.sleep(0.2)
    assert read_records(out), "no row appeared while the run was going"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group, ranks included
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    kept = read_records(out)
    assert 1 <= len(kept) < len(sizes)
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"{len(kept)} case(s) already in" in rerun.stdout
    records = read_records(out)
    assert sorted(r["size_mb"] for r in records) == [float(s) for s in sizes]  # each once
    assert records[:len(kept)] == kept
