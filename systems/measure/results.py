"""Tidy results: JSON-lines files, one record per line, written as they are produced."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import pandas as pd

from systems.measure.env import environment


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


class ResultWriter:
    """Appends records to a .jsonl file, each stamped with the environment, flushing every row
    so an interrupted sweep keeps what it measured."""

    def __init__(self, path: str | Path, *, overwrite: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if overwrite and self.path.exists():
            self.path.unlink()
        self.env = environment()

    def write(self, record: dict) -> dict:
        row = {k: _jsonable(v) for k, v in {**record, "env": self.env}.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def write_many(self, records: Iterable[dict]) -> None:
        for r in records:
            self.write(r)


def read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_results(path: str | Path, *, drop_env: bool = True) -> pd.DataFrame:
    """The records of a .jsonl file as a DataFrame (the env column dropped unless asked for)."""
    records = read_records(path)
    df = pd.DataFrame(records)
    if drop_env and "env" in df.columns:
        df = df.drop(columns="env")
    return df
