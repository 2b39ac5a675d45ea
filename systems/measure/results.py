"""Tidy results: JSON-lines files, one record per line, each stamped with its environment, written
as they are produced.

Nothing is lost, nothing is mixed:
- every row is flushed as it is written, so an interrupted sweep keeps what it measured;
- a writer that starts a file afresh (``overwrite=True``) first moves an existing file aside to
  ``<name>.previous`` instead of deleting it, so an interrupted re-run still has the previous
  run's rows (the workbook removes ``.previous`` files once a notebook has finished);
- a writer that appends (``overwrite=False``) refuses a file whose rows come from another machine
  or another ``identity`` (e.g. another model or profile): one file, one machine;
- the path is checked when the writer is made, before any measurement, so a bad path fails first.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable

import pandas as pd

from systems.measure.env import environment

PREVIOUS_SUFFIX = ".previous"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def machine_of(env: dict) -> str:
    """What one results file may hold rows of, and how the report names a row's machine: the GPU
    model and count ('2x NVIDIA H200'), or the CPU ('CPU only (x86_64)')."""
    if env.get("gpu"):
        return f"{env.get('gpu_count') or 1}x {env['gpu']}"
    return f"CPU only ({env.get('cpu') or 'unknown CPU'})"


def check_writable(path: Path) -> None:
    """A one-line error now, before anything is measured, for a path rows cannot be written to."""
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a file (a directory?): give a .jsonl file path for the results")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"cannot create {parent}: a file is in the way; give another results path") from None
    except PermissionError:
        raise ValueError(f"cannot create {parent}: permission denied; give another results path") from None
    except OSError as exc:  # a parent that cannot exist (under /proc), a read-only file system
        raise ValueError(f"cannot create {parent}: {exc.strerror or exc}; give another results path") from None
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{path} is not writable; give another results path")


class ResultWriter:
    """Writes records to a .jsonl file, one line each, flushed per row.

    ``overwrite=True`` starts the file afresh (the old one kept as ``<name>.previous``);
    ``overwrite=False`` appends, refusing a file of another machine or another ``identity``
    (a dict of fields every row of the file must share, e.g. ``{"model": "8B", "world_size": 2}``).
    """

    def __init__(self, path: str | Path, *, overwrite: bool = True, identity: dict | None = None):
        self.path = Path(path)
        check_writable(self.path)
        self.env = environment()
        self.identity = dict(identity or {})
        if overwrite:
            if self.path.exists() and self.path.stat().st_size:
                self.path.replace(self.path.with_name(self.path.name + PREVIOUS_SUFFIX))
            self.path.write_text("")
        else:
            self._check_same_source()

    def _check_same_source(self) -> None:
        existing = read_records(self.path, limit=1)
        if not existing:
            return
        first = existing[0]
        theirs, ours = machine_of(first.get("env") or {}), machine_of(self.env)
        # a row with no stamp (written by hand, or by an older tool) says nothing about its machine
        if first.get("env") and theirs != ours:
            raise ValueError(f"{self.path} holds rows measured on {theirs}; this run is on {ours}: "
                             "one file holds one machine's rows, so write to another file")
        for key, value in self.identity.items():
            if key in first and first[key] != value:
                raise ValueError(f"{self.path} holds rows with {key}={first[key]!r}; this run has {key}={value!r}: "
                                 "write to another file")

    def write(self, record: dict) -> dict:
        row = {k: _jsonable(v) for k, v in {**record, **self.identity, "env": self.env}.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def write_many(self, records: Iterable[dict]) -> None:
        for r in records:
            self.write(r)


def read_records(path: str | Path, *, limit: int | None = None) -> list[dict]:
    """The records of a .jsonl file ([] when it does not exist); a line that is not a JSON object
    raises a ValueError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg}); fix or remove that line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            out.append(record)
            if limit is not None and len(out) >= limit:
                break
    return out


def read_results(path: str | Path, *, drop_env: bool = True) -> pd.DataFrame:
    """The records of a .jsonl file as a DataFrame (the env column dropped unless asked for)."""
    records = read_records(path)
    df = pd.DataFrame(records)
    if drop_env and "env" in df.columns:
        df = df.drop(columns="env")
    return df
