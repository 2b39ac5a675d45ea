"""The environment a result was produced in: GPU, driver, library versions, git commit, date."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD's hash, with '+dirty' when tracked files differ from it.

    $WORKBOOK_GIT_COMMIT, when set, wins: a copy of the tree shipped to a remote GPU machine may
    carry no .git, or a stale one whose HEAD is not the commit the tree was copied from.
    """
    if os.environ.get("WORKBOOK_GIT_COMMIT"):
        return os.environ["WORKBOOK_GIT_COMMIT"]
    head = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if head is None:
        return None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "")


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
    return env


def environment() -> dict:
    """Environment metadata for a results record (cached per process, dated per call)."""
    return {**_static_environment(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
