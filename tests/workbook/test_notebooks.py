"""The notebook runner: notebooks are output-free jupytext scripts; execution, failures, the report."""

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
    from systems.workbook import notebooks as runner

    monkeypatch.setattr(runner, "_gpu_count", lambda: 1)
    monkeypatch.setattr(runner, "run_notebook", lambda *a, **k: pytest.fail("should not execute"))
    runs = workbook.run_notebooks(only=["07", "08"], profile="full", out_dir=tmp_path, progress=False)
    assert [(r.name, r.ok, r.skipped) for r in runs] == [
        ("07_distributed", True, "its full profile needs 2 GPUs, this machine has 1"),
        ("08_sharding_fsdp", True, "its full profile needs 2 GPUs, this machine has 1")]
    assert "skipped" in capsys.readouterr().out


def test_cli_unknown_notebook_exits_non_zero(capsys):
    assert workbook.main(["run", "--only", "98", "--profile", "smoke"]) == 2
    assert "no notebook matches" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("python3"))
    assert command in ci.splitlines()


def test_report_embeds_relative_images_and_repoints_links(tmp_path):
    import base64

    import nbformat

    (tmp_path / "figures").mkdir()
    png = b"\x89PNG\r\n\x1a\nfake"
    (tmp_path / "figures" / "x.png").write_bytes(png)
    (tmp_path / "figures" / "x.html").write_text("<html></html>")
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "text/markdown": "![t](figures/x.png) [viz](figures/x.html) [web](https://example.org) ![gone](figures/none.png)"}),
        nbformat.v4.new_output("execute_result", data={"text/plain": "PosixPath('/tmp/x.png')"}, execution_count=1),
        nbformat.v4.new_output("stream", name="stderr", text="progress 50%")]
    nb.cells.append(cell)
    (tmp_path / "writeup" / "executed").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "writeup" / "executed" / "01_x.ipynb")
    html = workbook.build_report(tmp_path).read_text()
    assert base64.b64encode(png).decode() in html  # embedded: the report stands alone
    assert "../figures/x.html" in html  # resolves from writeup/
    assert "https://example.org" in html and "figures/none.png" in html  # left alone
    assert "PosixPath" not in html and "progress 50%" not in html  # reprs and stderr stay in the notebook
