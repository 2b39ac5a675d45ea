"""The environment a result was produced in: GPU, driver, library versions, git commit, date.

The commit stamp (``git_commit``):
- ``$WORKBOOK_GIT_COMMIT`` when set: a copy of the tree shipped to a remote GPU machine may carry
  no .git, or a stale one. It must look like a commit hash (7-40 hex digits, optionally
  "+dirty"): anything else, such as the first bytes of a ``.git/HEAD`` file, is refused.
- otherwise ``git rev-parse`` in this project's checkout (a clone, a worktree or a detached HEAD
  alike), with "+dirty" when tracked files differ from HEAD;
- "unknown" when this project is not a git checkout of its own (an unpacked archive, or a copy
  inside another repository, whose commit would say nothing about this code).

``WORKBOOK_ALLOW_DIRTY=1`` (set by ``workbook run --allow-dirty``) is stamped as ``allow_dirty``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

REPO_ROOT = Path(__file__).resolve().parents[2]
UNKNOWN_COMMIT = "unknown"
_COMMIT = re.compile(r"^[0-9a-f]{7,40}(\+dirty)?$")


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def check_commit(value: str) -> str:
    """``value`` if it looks like a (possibly dirty) commit hash, else a one-line ValueError."""
    if not _COMMIT.match(value):
        raise ValueError(f"WORKBOOK_GIT_COMMIT={value!r} is not a commit hash; set it to the output of "
                         "`git rev-parse --short=12 HEAD` (with '+dirty' if the tree has changes)")
    return value


def is_own_checkout() -> bool:
    """Whether this project's root is the top of a git work tree (a clone or a worktree)."""
    top = _run(["git", "rev-parse", "--show-toplevel"])
    return top is not None and Path(top).resolve() == REPO_ROOT


def tree_is_dirty() -> bool | None:
    """Whether tracked files differ from HEAD; None when this is not a checkout of its own."""
    if not is_own_checkout():
        return None
    return bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))


def git_commit() -> str:
    """HEAD's hash (12 digits), with '+dirty' when tracked files differ from it; see the module docstring."""
    if os.environ.get("WORKBOOK_GIT_COMMIT"):
        return check_commit(os.environ["WORKBOOK_GIT_COMMIT"])
    if not is_own_checkout():
        return UNKNOWN_COMMIT
    head = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if head is None:
        return UNKNOWN_COMMIT
    return head + ("+dirty" if tree_is_dirty() else "")


@functools.cache
def _static_environment() -> dict:
    import torch

    env: dict = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
        "triton": None,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if shutil.which("nvidia-smi"):
            drv = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
            env["driver"] = drv.splitlines()[0] if drv else None
    env["git_commit"] = git_commit()
    env["allow_dirty"] = os.environ.get("WORKBOOK_ALLOW_DIRTY") == "1"
    return env


def environment() -> dict:
    """Environment metadata for a results record (cached per process, dated per call)."""
    return {**_static_environment(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside, and what was there before put back on exit (a variable
    that was unset is unset again): a later run in the same process must not inherit them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
