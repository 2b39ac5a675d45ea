"""The results writer: rows flushed as written, a bad path refused before anything is measured,
an earlier run's rows kept, one machine per file, and a bad line named by file and line."""

import json

import pytest

from systems.measure import results
from systems.measure.results import ResultWriter, read_records


def test_rows_carry_the_environment_and_are_flushed_one_by_one(tmp_path):
    w = ResultWriter(tmp_path / "r.jsonl")
    w.write({"x": 1, "y": float("nan")})
    assert read_records(tmp_path / "r.jsonl")[0]["x"] == 1  # on disk before the next row
    w.write({"x": 2})
    rows = read_records(tmp_path / "r.jsonl")
    assert [r["x"] for r in rows] == [1, 2] and rows[0]["y"] is None and "git_commit" in rows[0]["env"]


def test_a_directory_is_refused_when_the_writer_is_made(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        ResultWriter(tmp_path)
    (tmp_path / "blocker").write_text("")
    with pytest.raises(ValueError, match="a file is in the way"):
        ResultWriter(tmp_path / "blocker" / "r.jsonl")


def test_starting_afresh_keeps_the_previous_rows(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultWriter(path).write({"run": 1})
    ResultWriter(path).write({"run": 2})  # a re-run, interrupted after its first row
    assert [r["run"] for r in read_records(path)] == [2]
    assert [r["run"] for r in read_records(tmp_path / "r.jsonl.previous")] == [1]


def test_appending_refuses_another_machine_or_identity(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"model": "8B", "env": {"gpu": "NVIDIA H200", "gpu_count": 2}}) + "\n")
    with pytest.raises(ValueError, match="holds rows measured on 2x NVIDIA H200"):
        ResultWriter(path, overwrite=False)
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "NVIDIA H200", "gpu_count": 2})
    with pytest.raises(ValueError, match="model='8B'"):
        ResultWriter(path, overwrite=False, identity={"model": "debug"})
    w = ResultWriter(path, overwrite=False, identity={"model": "8B"})
    w.write({"step_s": 6.0})
    assert len(read_records(path)) == 2


def test_a_bad_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"x": 1}\n\n{"x": 2\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:3: not a JSON record"):
        read_records(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_records(path)


def test_a_parent_that_cannot_exist_is_a_one_line_error_before_any_row():
    # /proc refuses new folders with ENOENT: neither a file in the way nor a permission problem
    with pytest.raises(ValueError, match="cannot create /proc/no: .*; give another results path"):
        ResultWriter("/proc/no/rows.jsonl")
