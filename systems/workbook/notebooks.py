"""Executing the numbered notebooks headless with papermill: discovery, one notebook, a run of several.

Notebooks are jupytext "percent" scripts (notebooks/NN_name.py): output-free in git, opened as
notebooks in JupyterLab through jupytext. Each has one cell tagged ``parameters`` defining at
least ``profile`` and ``out_dir``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from systems.measure.env import REPO_ROOT
from systems.workbook.html import build_report

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


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


