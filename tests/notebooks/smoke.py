"""What every notebook's smoke test does: run one notebook into a scratch folder, and read back
which deliverables it recorded, to compare with what the handout asks of it."""

from __future__ import annotations

from pathlib import Path

from systems.measure.results import read_records
from systems.report.deliverables import deliverables


def run_smoke(number: str, out_dir: Path, **parameters):
    """Run notebook ``number`` in the smoke profile into ``out_dir``; its run, asserted to have
    succeeded (the failure shows the notebook's error, not a bare assert)."""
    # imported here: the workbook layer imports papermill, which only the slow tests need
    from systems.workbook import run_notebooks

    runs = run_notebooks(only=[number], profile="smoke", out_dir=out_dir, parameters=parameters,
                         report=False, progress=False)
    assert len(runs) == 1, f"expected one run of notebook {number}, got {len(runs)}"
    assert runs[0].ok, runs[0].error
    return runs[0]


def asked(handout: str, notebook: str) -> list[tuple[str, str]]:
    """The (problem, part) pairs the handout gives ``notebook``, sorted."""
    return sorted((d.problem, d.part) for d in deliverables(handout) if d.notebook == notebook)


def recorded(out_dir: Path, notebook: str) -> list[dict]:
    """The answer records ``notebook`` wrote in ``out_dir``."""
    return read_records(out_dir / "results" / f"{notebook}_deliverables.jsonl")


def recorded_pairs(out_dir: Path, notebook: str) -> list[tuple[str, str]]:
    """The (problem, part) pairs ``notebook`` recorded, sorted: equal to asked() when every
    deliverable was recorded exactly once."""
    return sorted((r["problem"], r["part"] or "") for r in recorded(out_dir, notebook))
