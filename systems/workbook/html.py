"""The HTML report: every executed notebook under ``out_dir/writeup/executed`` in one self-contained page."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path


class ReportError(RuntimeError):
    """The report cannot be built from what is on disk (the message names the file)."""


_MD_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


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


def build_report(out_dir: Path) -> Path:
    """Concatenate every executed notebook under out_dir/writeup/executed into writeup/report.html."""
    import nbformat
    from nbconvert import HTMLExporter

    executed = sorted((out_dir / "writeup" / "executed").glob("[0-9][0-9]_*.ipynb"))
    executed = [p for p in executed if not p.name.endswith(".input.ipynb")]
    if not executed:
        raise ReportError(f"no executed notebooks under {out_dir / 'writeup' / 'executed'}")
    report_dir = out_dir / "writeup"
    report = nbformat.v4.new_notebook()
    report.cells.append(nbformat.v4.new_markdown_cell(
        "# LLM training-systems workbook: report\n\n"
        + "\n".join(f"- [{p.stem}](#{p.stem})" for p in executed)))
    for p in executed:
        nb = nbformat.read(p, as_version=4)
        report.cells.append(nbformat.v4.new_markdown_cell(f'<a id="{p.stem}"></a>\n\n---'))
        for cell in nb.cells:
            if "injected-parameters" in cell.metadata.get("tags", []):
                continue
            if cell.cell_type == "code":
                # progress bars and warnings go to stderr: keep them in the executed notebook, not the report
                # and a bare repr of a cell's last value (text/plain only) is not a result either
                cell.outputs = [o for o in cell.outputs
                                if not (o.output_type == "stream" and o.name == "stderr")
                                and not (o.output_type == "execute_result" and set(o.get("data", {})) == {"text/plain"})]
                for o in cell.outputs:
                    if "text/markdown" in o.get("data", {}):
                        o.data["text/markdown"] = _portable_links(o.data["text/markdown"], out_dir, report_dir)
            else:
                cell.source = _portable_links(cell.source, out_dir, report_dir)
            report.cells.append(cell)
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(report)
    path = report_dir / "report.html"
    path.write_text(body)
    return path


