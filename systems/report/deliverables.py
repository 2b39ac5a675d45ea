"""Every deliverable of the two CS336 assignment-2 handouts, and the notebook that answers it.

The report's first section (the deliverables index) renders this table: one row per problem and
sub-question, linking to its answer, with a status computed from the run. This module is only the
table and its accessors; rendering and status live elsewhere.

- ``handout``: "2025" (v1.0.4) or "2026" (v26.1.1). The same problem name can ask different things
  in the two years (2026's ``memory_profiling`` adds (f), and 2026 renames the model sizes: its ``xl``
  is 2025's "2.7B"), so each handout lists its own parts.
- ``part``: the handout's sub-question letter, or "" for a problem with no (a), (b), ... markers. A
  problem whose only sub-question is (a) (``pytorch_attention``, ``flash_benchmarking``) keeps "a".
- ``kind``: "code" (an implementation or script the handout asks for, graded by its tests where it
  has them), "written" (prose, possibly with timings), "table", "figure", or "number" (a quantity or
  closed-form expression with its short justification).
- ``needs``: what a real answer needs beyond the CPU smoke run (``None``: the smoke run already gives
  it, e.g. the closed forms of notebook 09 or the code checked on the CPU).

Rows follow the handout order; the tests compare problem names, parts and the count of
"Deliverable:" lines with the handout texts where those are present.

Counts are not written down here (they would go stale): ``python -m systems.report.deliverables``
prints the number of deliverables per handout and per notebook, from ``summary()``.

Mapping notes. 2025's ``ddp_bucketed_benchmarking`` (b) asks for equations: notebook 09 answers it
under its own heading (closed form, no GPU); notebook 07 fits the same model to measured all-reduce
times. 2025's FlashAttention-2 leaderboard (its section 1.3.3) has no Problem box and no Deliverable
line, so it has no row, though notebook 06 times its configuration; 2026's ``leaderboard`` problem
(a full 8B training step) is notebook 10's.
"""

from __future__ import annotations

import csv
import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HANDOUTS = ("2025", "2026")
KINDS = ("code", "written", "table", "figure", "number")

# What a real answer needs beyond the CPU smoke run.
# "6 GPUs": the all-reduce sweep goes up to 6 processes, one GPU each; "2 GPUs of >= 130 GiB": the 2026
# leaderboard's 8B step (systems.bench.leaderboard.MIN_GPU_MEMORY_GIB)
NEEDS = (None, "a GPU", "2 GPUs", "6 GPUs", "2 GPUs of >= 130 GiB")


@dataclass(frozen=True)
class Deliverable:
    handout: str  # "2025" or "2026"
    problem: str  # the handout's problem name, e.g. "benchmarking_script"
    part: str  # "a", "b", ...; "" when the problem has no sub-questions
    title: str  # what is asked, in our words
    kind: str  # one of KINDS
    notebook: str  # the notebook stem that answers it
    needs: str | None  # what answering it needs beyond a CPU smoke run
    note: str | None = None  # where the answer departs from the letter of the question, and why

    def __post_init__(self) -> None:
        # a typo in the table should fail when it is read, not render as a broken row
        if self.handout not in HANDOUTS:
            raise ValueError(f"{self.problem}: handout must be one of {HANDOUTS}, got {self.handout!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{self.handout} {self.problem} ({self.part}): kind must be one of {KINDS}, "
                             f"got {self.kind!r}")
        if self.needs not in NEEDS:
            raise ValueError(f"{self.handout} {self.problem} ({self.part}): needs must be one of {NEEDS}, "
                             f"got {self.needs!r}")
        if self.part and not (len(self.part) == 1 and "a" <= self.part <= "z"):
            raise ValueError(f"{self.handout} {self.problem}: part must be '' or one letter a-z, got {self.part!r}")

    @property
    def anchor(self) -> str:
        """HTML id, unique per (handout, problem, part): problem names hold no '-', so the join is unambiguous."""
        return "-".join(s for s in (self.handout, self.problem, self.part) if s)


TABLE = Path(__file__).with_name("deliverables.tsv")  # one row per deliverable, in handout order


@functools.cache
def all_deliverables() -> tuple[Deliverable, ...]:
    """Both handouts' deliverables, read from deliverables.tsv on first use (a data file: the table
    is data, and a reader can sort and filter it as such)."""
    with TABLE.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return tuple(Deliverable(handout=r["handout"], problem=r["problem"], part=r["part"], title=r["title"],
                             kind=r["kind"], notebook=r["notebook"], needs=r["needs"] or None, note=r["note"] or None)
                 for r in rows)


@functools.cache
def _by_key() -> dict[tuple[str, str, str], Deliverable]:
    return {(d.handout, d.problem, d.part): d for d in all_deliverables()}


def _check_handout(handout: str) -> None:
    if handout not in HANDOUTS:
        raise ValueError(f"unknown handout {handout!r}; the table holds {', '.join(HANDOUTS)}")


def deliverables(handout: str) -> list[Deliverable]:
    """One handout's deliverables, in handout order."""
    _check_handout(handout)
    return [d for d in all_deliverables() if d.handout == handout]


def problems(handout: str) -> list[str]:
    """One handout's problem names, in handout order, each once."""
    return list(dict.fromkeys(d.problem for d in deliverables(handout)))


def find(handout: str, problem: str, part: str = "") -> Deliverable:
    """The deliverable for (handout, problem, part); ValueError for an unknown handout, KeyError if absent."""
    _check_handout(handout)
    found = _by_key().get((handout, problem, part))
    if found is not None:
        return found
    parts = [d.part for d in all_deliverables() if d.handout == handout and d.problem == problem]
    if parts:
        listed = ", ".join(repr(p) for p in parts)
        raise KeyError(f"{handout} handout: problem {problem!r} has no part {part!r}; its parts are {listed}")
    elsewhere = [h for h in HANDOUTS
                 if h != handout and any(d.handout == h and d.problem == problem for d in all_deliverables())]
    hint = f" (the {elsewhere[0]} handout has it)" if elsewhere else ""
    raise KeyError(f"{handout} handout has no problem {problem!r}{hint}")


def summary() -> dict[str, dict[str, int]]:
    """Deliverables per notebook for each handout, notebooks in order."""
    return {h: dict(sorted(Counter(d.notebook for d in deliverables(h)).items())) for h in HANDOUTS}


def _main() -> None:
    for handout, per_notebook in summary().items():
        print(f"{handout}: {sum(per_notebook.values())} deliverables in {len(problems(handout))} problems")
        for notebook, n in per_notebook.items():
            print(f"  {notebook:<22} {n}")


if __name__ == "__main__":
    _main()
