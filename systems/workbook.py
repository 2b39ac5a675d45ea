"""Execute the numbered notebooks headless with papermill and export one HTML report.

    python -m systems.workbook run [--only 01 03] [--profile auto|smoke|full] [--out-dir DIR] [-p NAME VALUE]
    python -m systems.workbook list
    python -m systems.workbook report [--out-dir DIR]
    python -m systems.workbook submit|status ...   (Slurm batch jobs: systems/slurm.py)

Notebooks are jupytext "percent" scripts (notebooks/NN_name.py): output-free in git,
opened as notebooks in JupyterLab through jupytext. Each has one cell tagged
``parameters`` defining at least ``profile`` and ``out_dir``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from systems.measure.env import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"

# GPUs a notebook's full profile needs (one process per GPU, NCCL); others need one.
MIN_GPUS_FULL = {"07_distributed": 2, "08_sharding_fsdp": 2}


@dataclass
class NotebookRun:
    name: str
    ok: bool
    seconds: float
    output: Path | None
    error: str | None = None
    skipped: str | None = None  # why it did not run (this machine lacks what it needs)


class WorkbookError(RuntimeError):
    pass


def discover(only: list[str] | None = None) -> list[Path]:
    """notebooks/NN_*.py in order; ``only`` keeps those whose number or name matches."""
    paths = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
    if only:
        wanted = [str(o) for o in only]
        picked = [p for p in paths if any(p.stem == w or p.stem.split("_")[0] == w.zfill(2) for w in wanted)]
        missing = [w for w in wanted if not any(p.stem == w or p.stem.split("_")[0] == w.zfill(2) for p in paths)]
        if missing:
            raise WorkbookError(f"no notebook matches {missing}; have {[p.stem for p in paths]}")
        return picked
    return paths


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_profile() -> str:
    import torch

    return "full" if torch.cuda.is_available() else "smoke"


def default_out_dir(profile: str) -> Path:
    # a CPU smoke run must not overwrite the committed full-profile (GPU) outputs
    return REPO_ROOT if profile == "full" else REPO_ROOT / "build" / "smoke"


def to_ipynb(path: Path):
    """Read a jupytext percent script as a notebook, checking its parameters cell."""
    import jupytext

    nb = jupytext.read(path)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise WorkbookError(f"{path.name}: needs exactly one cell tagged 'parameters', found {len(tagged)}")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _describe_failure(exc: Exception, nb_path: Path) -> str:
    cell = getattr(exc, "cell_index", None)
    if cell is not None:
        return (f"{nb_path.name}: cell {cell} (execution count {getattr(exc, 'exec_count', '?')}) raised "
                f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
    return f"{nb_path.name}: {type(exc).__name__}: {exc}"


def run_notebook(path: Path, *, profile: str, out_dir: Path, parameters: dict | None = None,
                 progress: bool = True) -> NotebookRun:
    import nbformat
    import papermill

    executed = out_dir / "writeup" / "executed"
    executed.mkdir(parents=True, exist_ok=True)
    src = executed / f"{path.stem}.input.ipynb"
    dst = executed / f"{path.stem}.ipynb"
    nbformat.write(to_ipynb(path), src)
    params = {"profile": profile, "out_dir": str(out_dir), **(parameters or {})}
    start = time.perf_counter()
    try:
        papermill.execute_notebook(str(src), str(dst), parameters=params, cwd=str(REPO_ROOT),
                                   kernel_name="python3", progress_bar=progress, log_output=False,
                                   request_save_on_cell_execute=True)
        return NotebookRun(path.stem, True, time.perf_counter() - start, dst)
    except Exception as exc:  # papermill wraps the cell error; anything else is also a failure
        return NotebookRun(path.stem, False, time.perf_counter() - start, dst, _describe_failure(exc, path))
    finally:
        src.unlink(missing_ok=True)


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
        raise WorkbookError(f"no executed notebooks under {out_dir / 'writeup' / 'executed'}")
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


def run_notebooks(*, only: list[str] | None = None, profile: str = "auto", out_dir: str | Path | None = None,
                  parameters: dict | None = None, keep_going: bool = True, report: bool = True,
                  progress: bool = True) -> list[NotebookRun]:
    profile = default_profile() if profile == "auto" else profile
    if profile not in ("smoke", "full"):
        raise WorkbookError(f"profile must be auto, smoke or full, got {profile!r}")
    out = Path(out_dir).resolve() if out_dir else default_out_dir(profile)
    runs: list[NotebookRun] = []
    paths = discover(only)
    n_gpus = _gpu_count() if profile == "full" else 0
    for i, path in enumerate(paths, 1):
        need = MIN_GPUS_FULL.get(path.stem, 1) if profile == "full" else 0
        if n_gpus < need:
            why = f"its full profile needs {need} GPUs, this machine has {n_gpus}"
            runs.append(NotebookRun(path.stem, True, 0.0, None, skipped=why))
            print(f"[{i}/{len(paths)}] {path.stem}: skipped ({why})", flush=True)
            continue
        print(f"[{i}/{len(paths)}] {path.stem} ({profile}) ...", flush=True)
        run = run_notebook(path, profile=profile, out_dir=out, parameters=parameters, progress=progress)
        runs.append(run)
        status = "ok" if run.ok else f"FAILED: {run.error}"
        print(f"[{i}/{len(paths)}] {path.stem}: {status} in {run.seconds:.0f} s -> {run.output}", flush=True)
        if not run.ok and not keep_going:
            break
    if report and any(r.ok and not r.skipped for r in runs):
        print(f"report: {build_report(out)}", flush=True)
    return runs


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.workbook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks and export the report")
    run.add_argument("--only", nargs="+", help="notebook numbers or names, e.g. 01 03")
    run.add_argument("--profile", default="auto", choices=["auto", "smoke", "full"],
                     help="auto: full with CUDA, smoke without")
    run.add_argument("--out-dir", help="where figures/, results/ and writeup/ go "
                     "(default: the repo for full, build/smoke for smoke)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="extra papermill parameter (JSON value, else string)")
    run.add_argument("--stop-on-error", action="store_true", help="stop at the first failing notebook")
    run.add_argument("--no-progress", action="store_true")
    sub.add_parser("list", help="list the notebooks")
    rep = sub.add_parser("report", help="rebuild writeup/report.html from executed notebooks")
    rep.add_argument("--out-dir", default=str(REPO_ROOT))
    from . import slurm  # imported here: slurm imports this module

    slurm.add_commands(sub)
    args = parser.parse_args(argv)
    if args.command in slurm.COMMANDS:
        return slurm.run_command(args)

    try:
        if args.command == "list":
            for p in discover():
                print(p.stem)
            return 0
        if args.command == "report":
            print(build_report(Path(args.out_dir).resolve()))
            return 0
        runs = run_notebooks(only=args.only, profile=args.profile, out_dir=args.out_dir,
                             parameters={k: _parse_value(v) for k, v in args.parameter},
                             keep_going=not args.stop_on_error, progress=not args.no_progress)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in runs if not r.ok]
    for r in failed:
        print(f"FAILED {r.error}\n  partial output: {r.output}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
