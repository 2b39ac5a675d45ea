"""Executing the numbered notebooks headless with papermill: discovery, one notebook, a run of several.

Notebooks are jupytext "percent" scripts (notebooks/NN_name.py): output-free in git, opened as
notebooks in JupyterLab through jupytext. Each has one cell tagged ``parameters`` defining at
least ``profile``, ``out_dir`` and ``handout``.

What a run guarantees:
- outputs go to ``--out-dir``, by default ``build/smoke`` or ``build/full``: the committed
  ``results/``, ``figures/`` and ``writeup/`` change only when the user names the repository
  (``--out-dir .``);
- a full-profile run refuses a tree with uncommitted changes to tracked files, whose results
  could not be traced to a commit, unless ``allow_dirty`` (stamped on every row);
- two runs cannot write into one output folder at once (a lock file there);
- every ``-p NAME VALUE`` must be a parameter of the selected notebooks, and a value that looks
  like JSON must be JSON;
- a notebook that cannot run here (the full profile without a GPU, 07/08 with one GPU) is an
  error when it was asked for by name, and a reported skip in a run of every notebook.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from systems.config import check_handout
from systems.measure.env import REPO_ROOT, environ_set, git_commit, tree_is_dirty
from systems.measure.results import PREVIOUS_SUFFIX
from systems.workbook.html import ReportError, build_report

NOTEBOOK_DIR = REPO_ROOT / "notebooks"

# GPUs a notebook's full profile needs (one process per GPU, NCCL); others need one, and 09 (closed
# forms and committed measurements) none.
MIN_GPUS_FULL = {"07_distributed": 2, "08_sharding_fsdp": 2, "09_parallelism_math": 0}


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
    # never the committed outputs by default: the user names the repository to update them
    return REPO_ROOT / "build" / profile


def to_ipynb(path: Path):
    """Read a jupytext percent script as a notebook, checking its parameters cell."""
    import jupytext

    nb = jupytext.read(path)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise WorkbookError(f"{path.name}: needs exactly one cell tagged 'parameters', found {len(tagged)}")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def notebook_parameters(path: Path) -> dict[str, object]:
    """The names the notebook's parameters cell assigns, with their default values."""
    cell = next(c for c in to_ipynb(path).cells if "parameters" in c.metadata.get("tags", []))
    out = {}
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        out[target.id] = None
    return out


def check_parameters(paths: list[Path], parameters: dict) -> None:
    """Every given parameter must be one of every selected notebook's (papermill only warns)."""
    for path in paths:
        known = notebook_parameters(path)
        unknown = sorted(set(parameters) - set(known))
        if unknown:
            raise WorkbookError(f"{path.stem} has no parameter {', '.join(map(repr, unknown))}; its parameters are "
                                f"{', '.join(sorted(known))} (select notebooks with --only)")
    check_parameter_values(parameters)


def check_parameter_values(parameters: dict) -> None:
    """What the runner owns, and the values every notebook checks in its first cell: refused before
    any kernel starts."""
    for name, option in (("profile", "--profile"), ("out_dir", "--out-dir")):
        if name in parameters:  # the runner sets these, and checks the profile against the GPUs and the commit
            raise WorkbookError(f"set {name} with {option}, not -p")
    # a bad value would otherwise fail inside every notebook's first cell, one kernel start each
    if "handout" in parameters:
        try:
            check_handout(parameters["handout"])
        except ValueError as exc:
            raise WorkbookError(f"-p {exc}") from None


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
    except Exception as exc:  # papermill wraps the cell error; anything else is also a failure
        return NotebookRun(path.stem, False, time.perf_counter() - start, dst, _describe_failure(exc, path))
    finally:
        src.unlink(missing_ok=True)
    # the notebook finished: the rows its writers moved aside are superseded
    for previous in (out_dir / "results").glob(f"{path.stem}_*{PREVIOUS_SUFFIX}"):
        previous.unlink()
    return NotebookRun(path.stem, True, time.perf_counter() - start, dst)


def check_out_dir(out: Path) -> None:
    """A one-line error, before anything runs, for an output folder that cannot be written."""
    if out.exists() and not out.is_dir():
        raise WorkbookError(f"--out-dir {out} is a file; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WorkbookError(f"cannot create --out-dir {out}: {exc.strerror}; give another folder") from None
    if not os.access(out, os.W_OK):
        raise WorkbookError(f"--out-dir {out} is not writable; give another folder")


class OutDirLock:
    """Holds ``<out>/.workbook.lock`` for a run: a second run into the same folder is refused."""

    def __init__(self, out: Path):
        self.path = out / ".workbook.lock"
        self._file = None

    def __enter__(self) -> "OutDirLock":
        self._file = self.path.open("a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise WorkbookError(f"another workbook run ({holder}) is writing into {self.path.parent}; wait for it to "
                                "finish or choose another --out-dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()}")
        self._file.flush()
        return self

    def __exit__(self, *exc) -> None:
        self._file.truncate(0)
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def check_commit(*, profile: str, allow_dirty: bool) -> None:
    """A full profile's results must be traceable to a commit: refuse uncommitted tracked changes."""
    if profile != "full" or allow_dirty:
        return
    # a runner that states the commit (a tree copied to a GPU machine, whose .git may be stale)
    # is trusted for it; otherwise ask git
    stated = os.environ.get("WORKBOOK_GIT_COMMIT")
    if (git_commit().endswith("+dirty") if stated else tree_is_dirty()):
        raise WorkbookError("the full profile records the commit of every result, and tracked files differ from "
                            "HEAD: commit them first, or pass --allow-dirty (which is stamped on every row)")


def run_notebooks(*, only: list[str] | None = None, profile: str = "auto", out_dir: str | Path | None = None,
                  parameters: dict | None = None, keep_going: bool = True, report: bool = True,
                  progress: bool = True, allow_dirty: bool = False) -> list[NotebookRun]:
    profile = default_profile() if profile == "auto" else profile
    if profile not in ("smoke", "full"):
        raise WorkbookError(f"profile must be auto, smoke or full, got {profile!r}")
    paths = discover(only)
    parameters = dict(parameters or {})
    check_parameters(paths, parameters)
    n_gpus = _gpu_count() if profile == "full" else 0
    need = {p.stem: MIN_GPUS_FULL.get(p.stem, 1) if profile == "full" else 0 for p in paths}
    if n_gpus == 0 and all(n > 0 for n in need.values()):
        raise WorkbookError(f"the full profile of {', '.join(need)} needs a CUDA GPU and this machine has none; "
                            "run --profile smoke")
    check_commit(profile=profile, allow_dirty=allow_dirty)
    # what the kernels inherit and stamp on every row: --allow-dirty, and the commit, read once
    # before anything runs (the notebooks then write tracked files, their executed copies, results
    # and figures, which would make a later read say "+dirty"); a commit stated already is kept
    stated = {"WORKBOOK_ALLOW_DIRTY": "1"} if allow_dirty else {}
    commit = git_commit()
    if commit != "unknown" and not os.environ.get("WORKBOOK_GIT_COMMIT"):
        stated["WORKBOOK_GIT_COMMIT"] = commit
    out = Path(out_dir).resolve() if out_dir else default_out_dir(profile)
    check_out_dir(out)
    runs: list[NotebookRun] = []
    # the run's kernels inherit the stated commit; a later run in this process (a test, a
    # JupyterLab session) must not stamp it or --allow-dirty
    with OutDirLock(out), environ_set(stated):
        for i, path in enumerate(paths, 1):
            if n_gpus < need[path.stem]:
                why = f"its full profile needs {need[path.stem]} GPUs, this machine has {n_gpus}"
                # asked for by name, not running it is a failure; in a run of every notebook, a skip
                runs.append(NotebookRun(path.stem, not only, 0.0, None, error=None if not only else why, skipped=why))
                print(f"[{i}/{len(paths)}] {path.stem}: skipped ({why})", flush=True)
                continue
            print(f"[{i}/{len(paths)}] {path.stem} ({profile}) ...", flush=True)
            run = run_notebook(path, profile=profile, out_dir=out, parameters=parameters, progress=progress)
            runs.append(run)
            status = "ok" if run.ok else f"FAILED: {run.error}"
            print(f"[{i}/{len(paths)}] {path.stem}: {status} in {run.seconds:.0f} s -> {run.output}", flush=True)
            if not run.ok and not keep_going:
                break
        if report and any(r.output is not None for r in runs):
            try:
                print(f"report: {build_report(out, handout=parameters.get('handout'))}", flush=True)
            except ReportError as exc:
                if all(r.ok for r in runs):
                    raise
                # the failed notebooks are the news (listed by the caller, exit 1), not the report
                print(f"report: not built ({exc})", flush=True)
    return runs


def parse_value(text: str):
    """A -p value: JSON when it parses; a value that looks like JSON (starts with [, { or ") must."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip()[:1] in ("[", "{", '"'):
            raise WorkbookError(f"-p value {text!r} is not valid JSON ({exc.msg} at character {exc.pos}); "
                                "quote it for the shell, e.g. -p sizes '[\"small\"]'") from None
        return text
