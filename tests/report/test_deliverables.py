"""The deliverables table (systems.report.deliverables) against the handout texts and the notebooks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from systems.report import deliverables as dl

REPO = Path(__file__).resolve().parents[2]

# The pdftotext extractions live outside the repository (next to the main checkout, or at the
# workplace's shared folder); a fresh clone has neither, so the checks against them skip there.
HANDOUT_DIRS = (REPO.parent / "shared" / "handouts", Path("/work/shared/handouts"))
HANDOUT_FILES = {"2025": "cs336_assignment2_2025.txt", "2026": "cs336_assignment2_2026.txt"}

PROBLEM = re.compile(r"Problem \((?P<name>[a-z0-9_]+)\)")
# A sub-question opens a line: "(b) Time the ...", possibly after the form feed pdftotext puts at a
# page's first line (hence [^\S\n], any blank but a newline). Requiring a capital after the marker
# skips the typeset maths of the FlashAttention section, where "(j)" superscripts start lines.
MARKER = re.compile(r"^[^\S\n]*\((?P<letter>[a-z])\)[^\S\n]+(?=[A-Z])", re.MULTILINE)

# Problems whose parts the extractor cannot read, checked by hand against the text instead.
HAND_CHECKED_PARTS = {
    # Part (a) holds a nested list of the script's steps lettered (a)-(f) again (2025 lines 445-452),
    # indented only a few columns deeper than the real (a); the layout gives no reliable way to tell
    # them from sub-questions. 2026 numbers that list (i)-(vi), which the extractor already skips.
    ("2025", "pytorch_attention"): ("a",),
}


def handout_text(handout: str) -> str:
    for folder in HANDOUT_DIRS:
        path = folder / HANDOUT_FILES[handout]
        if path.is_file():
            return path.read_text(encoding="utf-8")
    pytest.skip(f"handout text {HANDOUT_FILES[handout]} not found in {', '.join(map(str, HANDOUT_DIRS))}: "
                "fresh clones (CI) have no shared/handouts folder, so the checks against the texts skip")


def problem_boxes(text: str) -> dict[str, str]:
    """Problem name -> its text, from its "Problem (name)" heading to the next one (or the end).

    Running to the next heading rather than to the box's end is harmless: the prose between boxes
    has no sub-question markers or "Deliverable:" lines (the counts below would show it)."""
    heads = list(PROBLEM.finditer(text))
    names = [m["name"] for m in heads]
    assert len(names) == len(set(names)), f"a problem heading repeats: {names}"
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {m["name"]: text[m.end():end] for m, end in zip(heads, ends)}


def extract_parts(box: str) -> tuple[str, ...]:
    """The sub-question letters of one box: markers taken in alphabetical sequence, so a stray
    out-of-order letter (2026's "(i)" and "(v)" list items) is ignored; ("",) when there are none."""
    found: list[str] = []
    for m in MARKER.finditer(box):
        if m["letter"] == chr(ord("a") + len(found)):
            found.append(m["letter"])
    return tuple(found) or ("",)


def table_parts(handout: str) -> dict[str, tuple[str, ...]]:
    parts: dict[str, list[str]] = {}
    for d in dl.deliverables(handout):
        parts.setdefault(d.problem, []).append(d.part)
    return {p: tuple(v) for p, v in parts.items()}


@pytest.mark.parametrize("handout", dl.HANDOUTS)
def test_problem_names_match_the_handout(handout):
    text = handout_text(handout)
    in_text = list(problem_boxes(text))
    in_table = dl.problems(handout)
    assert set(in_table) - set(in_text) == set(), "in the table but not in the handout"
    assert set(in_text) - set(in_table) == set(), "in the handout but not in the table"
    assert in_table == in_text, "the table should follow the handout's order"


@pytest.mark.parametrize("handout", dl.HANDOUTS)
def test_parts_match_the_sub_question_markers(handout):
    boxes = problem_boxes(handout_text(handout))
    table = table_parts(handout)
    wrong = []
    for problem, box in boxes.items():
        expected = HAND_CHECKED_PARTS.get((handout, problem)) or extract_parts(box)
        if table.get(problem) != expected:
            wrong.append(f"{problem}: table {table.get(problem)}, handout {expected}")
    assert not wrong, f"{handout}: " + "; ".join(wrong)


def test_hand_checked_problems_exist_and_need_it():
    for (handout, problem), parts in HAND_CHECKED_PARTS.items():
        box = problem_boxes(handout_text(handout))[problem]
        assert table_parts(handout)[problem] == parts
        # if the extractor ever reads this box right, the exception should go
        assert extract_parts(box) != parts, f"{handout} {problem}: the extractor now agrees; drop the hand check"


@pytest.mark.parametrize("handout", dl.HANDOUTS)
def test_one_row_per_deliverable_line(handout):
    # every sub-question (or part-less problem) ends in exactly one "Deliverable:"; counting them is an
    # extraction independent of the markers (pdftotext sometimes leaves one mid-line, hence no anchor)
    boxes = problem_boxes(handout_text(handout))
    table = table_parts(handout)
    for problem, box in boxes.items():
        assert box.count("Deliverable:") == len(table[problem]), f"{handout} {problem}"


@pytest.mark.parametrize("handout", dl.HANDOUTS)
def test_titles_are_our_own_words(handout):
    # no run of 6 consecutive words of a title may appear in the handout (case and layout ignored)
    words = re.findall(r"[a-z0-9]+", handout_text(handout).lower())
    text = " " + " ".join(words) + " "
    copied = []
    for d in dl.deliverables(handout):
        title = re.findall(r"[a-z0-9]+", d.title.lower())
        runs = (" ".join(title[i:i + 6]) for i in range(len(title) - 5))
        copied += [f"{d.anchor}: '{run}'" for run in runs if f" {run} " in text]
    assert not copied, "titles repeating the handout's wording: " + "; ".join(copied)


def test_anchors_are_unique_and_well_formed():
    anchors = [d.anchor for d in dl.all_deliverables()]
    assert len(anchors) == len(set(anchors))
    assert all(re.fullmatch(r"20\d\d-[a-z0-9_]+(-[a-z])?", a) for a in anchors), anchors
    assert dl.find("2026", "benchmarking_script", "b").anchor == "2026-benchmarking_script-b"
    assert dl.find("2025", "naive_ddp").anchor == "2025-naive_ddp"


def test_every_named_notebook_exists():
    for notebook in {d.notebook for d in dl.all_deliverables()}:
        assert (REPO / "notebooks" / f"{notebook}.py").is_file(), notebook


def test_fields():
    for d in dl.all_deliverables():
        assert d.kind in dl.KINDS, d
        assert d.needs in dl.NEEDS, d
        assert 0 < len(d.title) <= 90, d
    for handout in dl.HANDOUTS:  # a problem has either no parts or parts a, b, c, ... with no gap
        for problem, parts in table_parts(handout).items():
            letters = tuple(chr(ord("a") + i) for i in range(len(parts)))
            assert parts in (("",), letters), f"{handout} {problem}: {parts}"


def test_handout_order_and_filtering():
    handouts = [d.handout for d in dl.all_deliverables()]
    assert handouts == sorted(handouts), "2025's rows come first, then 2026's"
    for handout in dl.HANDOUTS:
        rows = dl.deliverables(handout)
        assert rows and all(d.handout == handout for d in rows)
        assert dl.deliverables(handout) is not rows, "callers may mutate the list they get"


def test_unknown_handout_raises():
    with pytest.raises(ValueError, match="2027"):
        dl.deliverables("2027")
    with pytest.raises(ValueError, match="2027"):
        dl.find("2027", "benchmarking_script", "a")


def test_find_explains_what_is_missing():
    with pytest.raises(KeyError, match="its parts are 'a', 'b', 'c'"):
        dl.find("2025", "benchmarking_script", "d")
    with pytest.raises(KeyError, match="the 2025 handout has it"):
        dl.find("2026", "communication_accounting", "a")
    with pytest.raises(KeyError, match="no problem 'nope'"):
        dl.find("2026", "nope")


def test_invalid_rows_are_rejected():
    with pytest.raises(ValueError, match="kind"):
        dl.Deliverable(handout="2026", problem="x", part="a", title="t", kind="essay", notebook="01_benchmarking", needs=None)
    with pytest.raises(ValueError, match="part"):
        dl.Deliverable(handout="2026", problem="x", part="ii", title="t", kind="code", notebook="01_benchmarking", needs=None)
    with pytest.raises(ValueError, match="handout"):
        dl.Deliverable(handout="2024", problem="x", part="", title="t", kind="code", notebook="01_benchmarking", needs=None)


def test_summary_counts(capsys):
    counts = dl.summary()
    assert list(counts) == list(dl.HANDOUTS)
    for handout, per_notebook in counts.items():
        assert sum(per_notebook.values()) == len(dl.deliverables(handout))
        assert list(per_notebook) == sorted(per_notebook)
    dl._main()
    out = capsys.readouterr().out
    assert f"2025: {len(dl.deliverables('2025'))} deliverables" in out


def test_the_leaderboards_memory_need_is_the_benchs_threshold():
    # the index's words and the check that decides whether the step runs must name one number
    from systems.bench.leaderboard import MIN_GPU_MEMORY_GIB

    assert f"2 GPUs of >= {MIN_GPU_MEMORY_GIB:g} GiB" in dl.NEEDS
    assert any(d.needs == f"2 GPUs of >= {MIN_GPU_MEMORY_GIB:g} GiB" for d in dl.deliverables("2026"))
