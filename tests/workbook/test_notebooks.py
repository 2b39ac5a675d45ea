"""The notebook runner: notebooks are output-free jupytext scripts; execution, failures, the report."""

import itertools
import subprocess

import pytest

from systems import workbook
from systems.measure.env import REPO_ROOT


def test_notebooks_are_output_free_jupytext_scripts():
    tracked = subprocess.run(["git", "ls-files", "notebooks"], capture_output=True, text=True, cwd=REPO_ROOT).stdout
    assert not [p for p in tracked.split() if p.endswith(".ipynb")], "notebooks/ keeps .py sources only"
    paths = workbook.discover()
    assert paths and paths[0].stem.startswith("01_")
    for path in paths:
        nb = workbook.to_ipynb(path)  # raises unless exactly one cell is tagged "parameters"
        params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert "profile" in params.source and "out_dir" in params.source, path.name
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_papermill_reads_every_parameters_cell():
    """papermill's own parser must see profile and out_dir (a '=' inside a comment defeats it)."""
    from papermill.translators import PythonTranslator

    for path in workbook.discover():
        nb = workbook.to_ipynb(path)
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        names = [p.name for p in PythonTranslator.inspect(cell)]
        assert {"profile", "out_dir"} <= set(names), (path.name, names)


def test_discover_filters_by_number_and_reports_missing():
    assert [p.stem for p in workbook.discover(["1"])] == ["01_benchmarking"]
    with pytest.raises(workbook.WorkbookError, match="no notebook matches"):
        workbook.discover(["98"])


def test_failing_cell_is_named(tmp_path):
    src = tmp_path / "99_fails.py"
    src.write_text('# %% tags=["parameters"]\nprofile = "smoke"\nout_dir = "x"\n\n# %%\nx = 1\n\n# %%\n1 / 0\n')
    run = workbook.run_notebook(src, profile="smoke", out_dir=tmp_path / "out", progress=False)
    assert not run.ok
    assert "99_fails.py: cell" in run.error and "ZeroDivisionError" in run.error
    assert run.output.exists()  # the partial executed notebook is kept for inspection


def test_full_profile_skips_notebooks_that_need_more_gpus(monkeypatch, tmp_path, capsys):
    """In a run of every notebook, one that needs more GPUs than this machine has is skipped and
    said so; asked for by name, not running it is a failure (the run exits non-zero)."""
    from systems.workbook import notebooks as runner

    monkeypatch.setattr(runner, "_gpu_count", lambda: 1)
    monkeypatch.setattr(runner, "check_commit", lambda **kw: None)
    monkeypatch.setattr(runner, "discover", lambda only=None: [p for p in runner.NOTEBOOK_DIR.glob("0[78]_*.py")])
    monkeypatch.setattr(runner, "run_notebook", lambda *a, **k: pytest.fail("should not execute"))
    why = "its full profile needs 2 GPUs, this machine has 1"
    runs = workbook.run_notebooks(profile="full", out_dir=tmp_path, progress=False)
    assert sorted((r.name, r.ok, r.skipped) for r in runs) == [("07_distributed", True, why),
                                                                ("08_sharding_fsdp", True, why)]
    assert "skipped" in capsys.readouterr().out
    runs = workbook.run_notebooks(only=["07", "08"], profile="full", out_dir=tmp_path, progress=False)
    assert [(r.ok, r.error) for r in runs] == [(False, why), (False, why)]


def test_full_profile_without_a_gpu_is_an_error(monkeypatch, tmp_path, capsys):
    from systems.workbook import notebooks as runner

    monkeypatch.setattr(runner, "_gpu_count", lambda: 0)
    assert workbook.main(["run", "--only", "01", "--profile", "full", "--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_full_profile_refuses_a_dirty_tree_unless_allowed(monkeypatch, tmp_path):
    from systems.workbook import notebooks as runner

    monkeypatch.delenv("WORKBOOK_GIT_COMMIT", raising=False)  # else the stated commit is trusted
    monkeypatch.setattr(runner, "tree_is_dirty", lambda: True)
    with pytest.raises(workbook.WorkbookError, match="--allow-dirty"):
        runner.check_commit(profile="full", allow_dirty=False)
    runner.check_commit(profile="full", allow_dirty=True)
    runner.check_commit(profile="smoke", allow_dirty=False)  # smoke results are never committed


def test_unknown_parameter_lists_the_notebooks_parameters(capsys, tmp_path):
    assert workbook.main(["run", "--only", "01", "--profile", "smoke", "--out-dir", str(tmp_path),
                          "-p", "bogus_param", "3"]) == 2
    err = capsys.readouterr().err
    assert "no parameter 'bogus_param'" in err and "profile" in err and "out_dir" in err


def test_bad_json_parameter_is_named(capsys, tmp_path):
    assert workbook.main(["run", "--only", "01", "--profile", "smoke", "--out-dir", str(tmp_path),
                          "-p", "sizes", '["debug"']) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert workbook.parse_value("2025") == 2025 and workbook.parse_value("full") == "full"


def test_out_dir_that_is_a_file_fails_before_running(capsys, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("")
    assert workbook.main(["run", "--only", "01", "--profile", "smoke", "--out-dir", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_second_run_into_the_same_folder_is_refused(tmp_path):
    from systems.workbook.notebooks import OutDirLock

    with OutDirLock(tmp_path):
        with pytest.raises(workbook.WorkbookError, match="another workbook run"):
            workbook.run_notebooks(only=["01"], profile="smoke", out_dir=tmp_path, progress=False)
    with OutDirLock(tmp_path):  # released: the next run may take it
        pass


def test_a_finished_notebook_drops_the_rows_its_writers_moved_aside(tmp_path):
    src = tmp_path / "99_writes.py"
    src.write_text('# %% tags=["parameters"]\nprofile = "smoke"\nout_dir = "x"\n\n# %%\n'
                   'from systems.measure.results import ResultWriter\n'
                   'ResultWriter(f"{out_dir}/results/99_writes_rows.jsonl").write({"x": 1})\n')
    out = tmp_path / "out"
    (out / "results").mkdir(parents=True)
    (out / "results" / "99_writes_rows.jsonl").write_text('{"x": 0}\n')
    run = workbook.run_notebook(src, profile="smoke", out_dir=out, progress=False)
    assert run.ok, run.error
    assert not list((out / "results").glob("*.previous"))


def test_cli_unknown_notebook_exits_non_zero(capsys):
    assert workbook.main(["run", "--only", "98", "--profile", "smoke"]) == 2
    assert "no notebook matches" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("python3"))
    assert command in ci.splitlines()


def test_the_run_states_its_commit_before_the_notebooks_write(monkeypatch, tmp_path):
    """The kernels stamp the commit the run started at, not one made "+dirty" by the executed
    notebooks, results and figures the run itself writes into a checkout; and, with --allow-dirty,
    that flag. Neither outlives the run: a later run in the same process must not inherit them."""
    import os

    from systems.workbook import notebooks as runner

    monkeypatch.delenv("WORKBOOK_GIT_COMMIT", raising=False)
    monkeypatch.delenv("WORKBOOK_ALLOW_DIRTY", raising=False)
    seen = []

    def fake_run(*args, **kwargs):  # what a kernel started now would inherit
        seen.append({k: os.environ.get(k) for k in ("WORKBOOK_GIT_COMMIT", "WORKBOOK_ALLOW_DIRTY")})
        return runner.NotebookRun("01_benchmarking", True, 0.0, None)

    monkeypatch.setattr(runner, "git_commit", lambda: "0123456789ab")
    monkeypatch.setattr(runner, "run_notebook", fake_run)
    workbook.run_notebooks(only=["01"], profile="smoke", out_dir=tmp_path, progress=False, report=False,
                           allow_dirty=True)
    workbook.run_notebooks(only=["01"], profile="smoke", out_dir=tmp_path, progress=False, report=False)
    assert seen == [{"WORKBOOK_GIT_COMMIT": "0123456789ab", "WORKBOOK_ALLOW_DIRTY": "1"},
                    {"WORKBOOK_GIT_COMMIT": "0123456789ab", "WORKBOOK_ALLOW_DIRTY": None}]
    assert "WORKBOOK_GIT_COMMIT" not in os.environ and "WORKBOOK_ALLOW_DIRTY" not in os.environ
    # a commit the caller states (a tree copied to a GPU machine) is the one the kernels get
    monkeypatch.setenv("WORKBOOK_GIT_COMMIT", "fedcba987654")
    workbook.run_notebooks(only=["01"], profile="smoke", out_dir=tmp_path, progress=False, report=False)
    assert seen[-1]["WORKBOOK_GIT_COMMIT"] == "fedcba987654"


@pytest.mark.parametrize("name, value, message", [
    ("handout", "2024", "handout must be one of 2025, 2026"),
    ("profile", "full", "set profile with --profile"),
    ("out_dir", "elsewhere", "set out_dir with --out-dir"),
])
def test_a_bad_parameter_value_fails_before_any_notebook_runs(capsys, tmp_path, name, value, message):
    assert workbook.main(["run", "--only", "01", "09", "--profile", "smoke", "--out-dir", str(tmp_path),
                          "-p", name, value]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "writeup").exists()  # refused before the first kernel started


def test_the_readmes_workbook_commands_name_real_notebooks_and_parameters():
    import shlex

    from systems.workbook import notebooks as runner

    commands = [line.split("#")[0].rstrip(" \\") for line in (REPO_ROOT / "README.md").read_text().splitlines()
                if line.startswith("python3 -m systems.workbook run") or line.startswith("python3 -m systems.workbook submit")]
    assert len(commands) >= 4
    for command in commands:
        words = shlex.split(command)[3:]
        only = words[words.index("--only") + 1:] if "--only" in words else []
        only = list(itertools.takewhile(lambda w: not w.startswith("-"), only))
        params = {words[i + 1]: runner.parse_value(words[i + 2]) for i, w in enumerate(words) if w == "-p"}
        runner.check_parameters(runner.discover(only or None), params)  # raises on a name or value the notebooks refuse
