"""The HTML report: every executed notebook under ``out_dir/writeup/executed`` in one self-contained
page, headed by the deliverables index and the run's provenance.

- **Deliverables index** (the first section): one row per Problem and sub-question of the chosen
  handout (``systems.report.deliverables``), linking to its answer, with a status computed from
  the answers the notebooks recorded (``results/NN_name_deliverables.jsonl``, written by
  ``nb.answer`` / ``nb.not_run``): answered, not run here and why, or missing.
- **Provenance**: per notebook, the commit, machine, profile and date its answers carry, and
  whether the tree was allowed to be dirty; mixed commits are flagged.
- **Code** is in the page but hidden; a button shows and hides it.
- Figures are embedded (data URIs), so the page is one file; a cell that raised shows a one-line
  note instead of a traceback, and the index marks its notebook as failed.
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections import defaultdict
from pathlib import Path

from systems.config import DEFAULT_HANDOUT, check_handout
from systems.measure.results import read_records
from systems.report.deliverables import deliverables


class ReportError(RuntimeError):
    """The report cannot be built from what is on disk (the message names the file)."""


_MD_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
TOGGLE = """
<style>
  body:not(.show-code) .jp-CodeCell .jp-Cell-inputWrapper { display: none; }
  #toggle-code { position: fixed; top: 0.6em; right: 0.6em; z-index: 10; padding: 0.3em 0.8em; }
  table.deliverables td, table.deliverables th { padding: 0.15em 0.6em; text-align: left; vertical-align: top; }
  table.deliverables .answered { color: #1a7f37; } table.deliverables .not-run { color: #9a6700; }
  table.deliverables .missing, table.deliverables .failed { color: #cf222e; }
</style>
"""
TOGGLE_BUTTON = """
<button id="toggle-code" type="button" aria-pressed="false">Show code</button>
<script>
  document.getElementById("toggle-code").addEventListener("click", function () {
    var on = document.body.classList.toggle("show-code");
    this.textContent = on ? "Hide code" : "Show code";
    this.setAttribute("aria-pressed", on ? "true" : "false");
  });
</script>
"""


def _portable_links(text: str, out_dir: Path, report_dir: Path) -> str:
    """Markdown links written relative to out_dir (the notebooks' working paths): PNGs are
    embedded as data URIs, so the report is one self-contained file; other existing files are
    re-pointed relative to the report."""

    def fix(m: re.Match) -> str:
        bang, label, target = m.groups()
        path = out_dir / target
        if "://" in target or target.startswith(("#", "data:", "/")) or not path.is_file():
            return m.group(0)
        if bang and path.suffix.lower() == ".png":
            return f"![{label}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"
        return f"{bang}[{label}]({os.path.relpath(path, report_dir)})"

    return _MD_LINK.sub(fix, text)


def _read_notebook(path: Path):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - truncated JSON, a bad schema: name the file, say what to do
        raise ReportError(f"{path}: not a readable notebook ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                          "re-run that notebook or delete the file") from None


def _failed_cell(nb) -> str | None:
    """'cell N raised E: message' for the first cell with an error output, else None."""
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {index} raised {out.get('ename')}: {str(out.get('evalue', '')).splitlines()[0][:200]}"
    return None


def answers(out_dir: Path, handout: str) -> dict[str, dict]:
    """The recorded answers of ``handout`` under out_dir/results, by anchor (the last one wins)."""
    found: dict[str, dict] = {}
    for path in sorted((out_dir / "results").glob("[0-9][0-9]_*_deliverables.jsonl")):
        for row in read_records(path):
            if row.get("handout") == handout:
                found[row["anchor"]] = row
    return found


def _run_label(env: dict) -> str:
    gpu = env.get("gpu")
    return f"{env.get('gpu_count', 1)} x {gpu}" if gpu else "CPU"


def deliverables_index(out_dir: Path, handout: str, *, failed: dict[str, str] | None = None,
                       executed: set[str] | None = None) -> str:
    """The index as HTML: one row per deliverable of ``handout`` with its status and link.
    ``failed``: notebook stem -> where it failed (its answers after that cell are missing);
    ``executed``: the notebooks whose executed copies the report holds."""
    failed, executed = failed or {}, executed or set()
    recorded = answers(out_dir, handout)
    rows, counts = [], defaultdict(int)
    for d in deliverables(handout):
        row = recorded.get(d.anchor)
        label = f"{d.problem} ({d.part})" if d.part else d.problem
        if row is not None and row.get("status") == "answered":
            status = ("answered from an earlier run's rows (not measured in this run)" if row.get("measured_by") else
                      "answered" + (" (smoke profile)" if row.get("profile") == "smoke" else ""))
            css, link = "answered", f'<a href="#{d.anchor}">{html.escape(label)}</a>'
        elif row is not None:
            status, css = f"not run here: {row.get('reason')}", "not-run"
            link = f'<a href="#{d.anchor}">{html.escape(label)}</a>'
        elif d.notebook in failed:
            status, css, link = f"failed: {d.notebook}, {failed[d.notebook]}", "failed", html.escape(label)
        elif d.notebook in executed and not (out_dir / "results" / f"{d.notebook}_deliverables.jsonl").exists():
            status, css = "in its notebook below, from a run that recorded no answers: re-run it", "missing"
            link = f'<a href="#{d.notebook}">{html.escape(label)}</a>'
        elif not (out_dir / "results" / f"{d.notebook}_deliverables.jsonl").exists():
            why = f"needs {d.needs}" if d.needs else "its notebook has not run"
            status, css, link = f"not run here: {why}", "not-run", html.escape(label)
        else:
            status, css, link = "missing: its notebook ran but recorded no answer", "missing", html.escape(label)
        counts[css] += 1
        env = (row.get("measured_by") or row.get("env")) if row else None
        run = f"{env.get('git_commit')} · {_run_label(env)}" if env else ""
        rows.append(f'<tr><td>{link}</td><td>{html.escape(d.title)}</td><td>{html.escape(d.notebook)}</td>'
                    f'<td class="{css}">{html.escape(status)}</td><td><code>{html.escape(run)}</code></td></tr>')
    summary = ", ".join(f"{n} {css.replace('-', ' ')}" for css, n in counts.items())
    return (f'<h2 id="deliverables">Deliverables of the {handout} handout</h2>'
            f"<p>{len(rows)} deliverables: {summary}. Each links to its answer; the status is computed from "
            "the answers the notebooks recorded in this run's results.</p>"
            '<table class="deliverables"><thead><tr><th>problem</th><th>what is asked</th><th>notebook</th>'
            f"<th>status</th><th>commit · machine</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def provenance(out_dir: Path, handout: str, stems: list[str]) -> str:
    """Per notebook: the commit, machine, profile and date its answers carry."""
    lines, commits = [], set()
    for stem in stems:
        rows = read_records(out_dir / "results" / f"{stem}_deliverables.jsonl", limit=1)
        if not rows:
            lines.append(f"<li>{html.escape(stem)}: no recorded answers</li>")
            continue
        env = rows[0].get("env", {})
        commits.add(env.get("git_commit"))
        dirty = " (run with --allow-dirty)" if env.get("allow_dirty") else ""
        lines.append(f"<li>{html.escape(stem)}: commit <code>{html.escape(str(env.get('git_commit')))}</code>{dirty}, "
                     f"{html.escape(_run_label(env))}, {html.escape(str(rows[0].get('profile')))} profile, "
                     f"{html.escape(str(env.get('date', ''))[:10])}</li>")
    head = (f"one commit, <code>{html.escape(str(next(iter(commits))))}</code>" if len(commits) == 1 else
            f"{len(commits)} commits: the notebooks were not all run at one commit")
    return f'<h2 id="provenance">Provenance</h2><p>The answers come from {head}.</p><ul>{"".join(lines)}</ul>'


def _clean_outputs(cell, out_dir: Path, report_dir: Path) -> None:
    """Keep what a reader needs: no stderr (progress bars, warnings), no bare text/plain reprs, a
    one-line note instead of a traceback."""
    import nbformat

    kept = []
    for o in cell.outputs:
        if o.output_type == "stream" and o.name == "stderr":
            continue
        if o.output_type == "execute_result" and set(o.get("data", {})) == {"text/plain"}:
            continue
        if o.output_type == "error":
            note = (f"**This cell raised** `{o.get('ename')}: {str(o.get('evalue', '')).splitlines()[0][:200]}`; "
                    "the notebook stopped here (its executed copy in writeup/executed has the traceback).")
            kept.append(nbformat.v4.new_output("display_data", data={"text/markdown": note}))
            continue
        if "text/markdown" in o.get("data", {}):
            o.data["text/markdown"] = _portable_links(o.data["text/markdown"], out_dir, report_dir)
        alt = o.get("metadata", {}).get("image/png", {}).get("alt")
        if "image/png" in o.get("data", {}) and alt:
            # nbconvert's template has no alternative text for an image: write the tag ourselves
            png = o.data["image/png"].replace("\n", "")
            kept.append(nbformat.v4.new_output("display_data", data={
                "text/html": f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'}))
            continue
        kept.append(o)
    cell.outputs = kept


def report_handout(notebooks: list) -> str:
    """The handout the executed notebooks answered (their injected parameter), else the default."""
    for nb in notebooks:
        for cell in nb.cells:
            if "injected-parameters" in cell.metadata.get("tags", []):
                m = re.search(r"^handout\s*=\s*['\"]?(\d{4})", cell.source, re.MULTILINE)
                if m:
                    return m.group(1)
    return DEFAULT_HANDOUT


_HANDOUT_DIR = re.compile(r"handout-(\d{4})")


def companion_reports(out_dir: Path, handout: str) -> dict[str, Path]:
    """The other handouts' reports, found by the README layout: the default handout's outputs at
    the repository root, each other handout's under ``handout-YYYY/`` beside them. Only reports
    that exist are returned, so a checkout without the other run links to nothing."""
    out_dir = Path(out_dir)
    root = out_dir.parent if _HANDOUT_DIR.fullmatch(out_dir.name) else out_dir
    candidates = {DEFAULT_HANDOUT: root / "writeup" / "report.html"}
    for sibling in sorted(root.glob("handout-[0-9][0-9][0-9][0-9]")):
        candidates[_HANDOUT_DIR.fullmatch(sibling.name).group(1)] = sibling / "writeup" / "report.html"
    return {h: path for h, path in sorted(candidates.items()) if h != handout and path.is_file()}


def _handout_line(out_dir: Path, handout: str, report_dir: Path) -> str:
    others = companion_reports(out_dir, handout)
    links = "; ".join(f"the {h} handout's report: [{os.path.relpath(path, report_dir)}]"
                      f"({os.path.relpath(path, report_dir)})" for h, path in others.items())
    return f"This report answers the {handout} handout." + (f" See also {links}." if links else "")


def build_report(out_dir: Path, *, handout: str | None = None) -> Path:
    """Concatenate every executed notebook under out_dir/writeup/executed into writeup/report.html,
    headed by the deliverables index of ``handout`` (default: the handout the notebooks ran with)
    and the provenance of their answers."""
    import nbformat
    from nbconvert import HTMLExporter

    out_dir = Path(out_dir)
    executed = sorted((out_dir / "writeup" / "executed").glob("[0-9][0-9]_*.ipynb"))
    executed = [p for p in executed if not p.name.endswith(".input.ipynb")]
    if not executed:
        raise ReportError(f"no executed notebooks under {out_dir / 'writeup' / 'executed'}: run the notebooks first "
                          "(python -m systems.workbook run)")
    notebooks = {p.stem: _read_notebook(p) for p in executed}
    handout = check_handout(handout or report_handout(list(notebooks.values())))
    failed = {stem: where for stem, nb in notebooks.items() if (where := _failed_cell(nb))}
    report_dir = out_dir / "writeup"
    report = nbformat.v4.new_notebook()
    report.cells.append(nbformat.v4.new_markdown_cell(
        "# LLM training-systems workbook: report\n\n"
        + _handout_line(out_dir, handout, report_dir) + "\n\n"
        + deliverables_index(out_dir, handout, failed=failed, executed=set(notebooks)) + "\n\n"
        + provenance(out_dir, handout, list(notebooks)) + "\n\n"
        + "Notebooks: " + " · ".join(f"[{stem}](#{stem})" for stem in notebooks)))
    for stem, nb in notebooks.items():
        report.cells.append(nbformat.v4.new_markdown_cell(f'<a id="{stem}"></a>\n\n---'))
        for cell in nb.cells:
            if "injected-parameters" in cell.metadata.get("tags", []):
                continue
            if cell.cell_type == "code":
                _clean_outputs(cell, out_dir, report_dir)
            else:
                cell.source = _portable_links(cell.source, out_dir, report_dir)
            report.cells.append(cell)
    exporter = HTMLExporter(exclude_input=False, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(report)
    body = body.replace("</head>", TOGGLE + "</head>", 1)
    opening = re.search(r"<body[^>]*>", body)
    if opening:
        body = body[:opening.end()] + TOGGLE_BUTTON + body[opening.end():]
    path = report_dir / "report.html"
    path.write_text(body)
    return path
