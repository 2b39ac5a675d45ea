"""The HTML report: the deliverables index with statuses from the recorded answers, provenance,
the code toggle, embedded figures, and no tracebacks."""

import json

import nbformat
import pytest

from systems import workbook
from systems.report.deliverables import deliverables


def _executed(tmp_path, stem: str, cells: list) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells.extend(cells)
    (tmp_path / "writeup" / "executed").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, tmp_path / "writeup" / "executed" / f"{stem}.ipynb")


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


def test_a_figure_keeps_its_description_as_alternative_text(tmp_path):
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "aGVsbG8=\n"},
                                           metadata={"image/png": {"alt": 'Step time | x: "context"'}})]
    _executed(tmp_path, "01_x", [cell])
    from bs4 import BeautifulSoup  # nbconvert's own dependency

    images = BeautifulSoup(workbook.build_report(tmp_path).read_text(), features="html.parser").find_all("img")
    assert [(i["alt"], i["src"]) for i in images] == [('Step time | x: "context"', "data:image/png;base64,aGVsbG8=")]


def _answer_rows(tmp_path, notebook: str, handout: str, rows: list[tuple], **extra) -> None:
    env = {"git_commit": "0123456789ab", "gpu": None, "date": "2026-11-24T00:00:00+00:00"}
    (tmp_path / "results").mkdir(parents=True, exist_ok=True)
    lines = []
    for d, status, reason in rows:
        lines.append(json.dumps({"notebook": notebook, "handout": handout, "problem": d.problem, "part": d.part,
                                 "anchor": d.anchor, "status": status, "reason": reason, "profile": "smoke",
                                 "env": env, **extra}))
    (tmp_path / "results" / f"{notebook}_deliverables.jsonl").write_text("\n".join(lines) + "\n")


def test_index_status_comes_from_the_recorded_answers(tmp_path):
    mine = [d for d in deliverables("2026") if d.notebook == "01_benchmarking"]
    _answer_rows(tmp_path, "01_benchmarking", "2026", [(mine[0], "answered", None), (mine[1], "not run", "no GPU")])
    cell = nbformat.v4.new_code_cell("x = 1")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": f'<a id="{mine[0].anchor}"></a> ok'})]
    _executed(tmp_path, "01_benchmarking", [cell])
    html = workbook.build_report(tmp_path, handout="2026").read_text()
    assert f'href="#{mine[0].anchor}"' in html and f'id="{mine[0].anchor}"' in html  # the link resolves
    assert "answered (smoke profile)" in html and "not run here: no GPU" in html
    assert "missing: its notebook ran but recorded no answer" in html  # mine[2] was not recorded
    two_gpu = next(d for d in deliverables("2026") if d.needs == "2 GPUs")
    assert "not run here: needs 2 GPUs" in html and two_gpu.title.split()[0] in html
    assert "0123456789ab" in html and "Provenance" in html
    with pytest.raises(ValueError, match="handout"):
        workbook.build_report(tmp_path, handout="2027")


def test_an_answer_from_another_runs_rows_names_that_run_not_this_one(tmp_path):
    lb = next(d for d in deliverables("2026") if d.problem == "leaderboard")
    _answer_rows(tmp_path, lb.notebook, "2026", [(lb, "answered", None)],
                 measured_by={"git_commit": "124754b", "gpu": "NVIDIA H200", "gpu_count": 2})
    _executed(tmp_path, lb.notebook, [nbformat.v4.new_code_cell("x = 1")])
    html = workbook.build_report(tmp_path, handout="2026").read_text()
    assert "answered from an earlier run's rows (not measured in this run)" in html
    assert "124754b · 2 x NVIDIA H200" in html and "answered (smoke profile)" not in html


def test_code_is_hidden_behind_a_toggle_and_tracebacks_become_a_note(tmp_path):
    cell = nbformat.v4.new_code_cell("secret_source_line = 1\n1 / 0")
    cell.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero",
                                           traceback=["Traceback (most recent call last):", "ZeroDivisionError"])]
    _executed(tmp_path, "02_fails", [cell])
    html = workbook.build_report(tmp_path).read_text()
    assert 'id="toggle-code"' in html and "body:not(.show-code)" in html
    assert "secret_source_line" in html  # in the page, hidden until the toggle shows it
    assert "Traceback (most recent call last)" not in html
    assert "This cell raised" in html and "ZeroDivisionError" in html


def test_a_truncated_notebook_is_named(tmp_path):
    (tmp_path / "writeup" / "executed").mkdir(parents=True)
    (tmp_path / "writeup" / "executed" / "03_cut.ipynb").write_text('{"cells": [')
    with pytest.raises(workbook.ReportError, match="03_cut.ipynb: not a readable notebook"):
        workbook.build_report(tmp_path)


def test_an_executed_notebook_without_recorded_answers_is_flagged(tmp_path):
    """A notebook in the report from a run that recorded no answers is neither "answered" nor
    "not run": the index points at it and says to re-run it."""
    _executed(tmp_path, "03_mixed_precision", [nbformat.v4.new_markdown_cell("old run")])
    html = workbook.build_report(tmp_path, handout="2026").read_text()
    assert "from a run that recorded no answers: re-run it" in html
    assert 'href="#03_mixed_precision"' in html


def test_each_handout_report_links_the_other_by_the_readme_layout(tmp_path):
    from systems.workbook.html import companion_reports

    cell = nbformat.v4.new_markdown_cell("text")
    _executed(tmp_path, "01_x", [cell])
    assert companion_reports(tmp_path, "2026") == {}  # no 2025 run beside it: no link
    main = workbook.build_report(tmp_path, handout="2026")
    assert "This report answers the 2026 handout." in main.read_text() and "See also" not in main.read_text()

    other = tmp_path / "handout-2025"
    _executed(other, "01_x", [cell])
    old = workbook.build_report(other, handout="2025")
    assert companion_reports(tmp_path, "2026") == {"2025": old}
    assert companion_reports(other, "2025") == {"2026": main}
    assert "../handout-2025/writeup/report.html" in workbook.build_report(tmp_path, handout="2026").read_text()
    assert "../../writeup/report.html" in old.read_text()
