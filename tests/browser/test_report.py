"""The HTML report as a reader sees it in Chromium: built from notebook 01's smoke profile, then its
deliverables index links, the code toggle, the figures and the absence of tracebacks checked in
the rendered page. Every check runs and the test fails listing all that went wrong."""

import re
import subprocess
import sys

import pytest

from systems.measure.env import REPO_ROOT

# The traceback IPython prints, its colour escapes left raw (the ESC byte, or the text of a code such
# as "[0;31m" once the byte is dropped), and the lines of a traceback nbconvert turned into coloured spans.
TRACEBACK = "Traceback (most recent call last)"
ANSI_ESCAPE = re.compile(r"\x1b\[|\[\d+(;\d+)+m")
TRACEBACK_LINE = re.compile(r"Error\b|Exception\b|^-{3,}>|^Cell In\[", re.MULTILINE)

# In the page: each in-page link of the deliverables index, whether it is displayed, and the
# element it points to (an id inside hidden code would be a link that scrolls nowhere).
INDEX_LINKS = """() => [...document.querySelectorAll('table.deliverables a[href^="#"]')].map(a => {
    const id = decodeURIComponent(a.getAttribute('href').slice(1));
    const target = document.getElementById(id);
    return {id: id, label: a.textContent, shown: a.getClientRects().length > 0, found: target !== null,
            displayed: target !== null && target.getClientRects().length > 0};
})"""
INDEX_ROWS = """() => [...document.querySelectorAll('table.deliverables tbody tr')].map(
    tr => [...tr.cells].map(td => td.textContent))"""
IMAGES = """() => [...document.images].map(img => ({src: img.src.slice(0, 60), complete: img.complete,
                                                  width: img.naturalWidth}))"""
# Text and ANSI-coloured spans of every output area, hidden or not.
OUTPUTS = """() => [...document.querySelectorAll('.jp-OutputArea-output')].map(o => ({
    text: o.textContent, ansi: o.querySelector('[class*="ansi-"]') !== null}))"""
HIDDEN_BY = """el => { for (let e = el; e; e = e.parentElement) {
    if (getComputedStyle(e).display === 'none') return e.className || e.tagName; } return null; }"""


def _index_problems(page) -> list[str]:
    problems = []
    index = page.locator("table.deliverables")
    if index.count() != 1:
        return [f"expected one deliverables index (table.deliverables), found {index.count()}"]
    if not index.is_visible():
        problems.append("the deliverables index is not displayed when the report opens (code hidden): it is inside "
                        f"an element of class {index.evaluate(HIDDEN_BY)!r} that has display: none")
    links = page.evaluate(INDEX_LINKS)
    if not links:
        ran = [row for row in page.evaluate(INDEX_ROWS) if row[2] == "01_benchmarking"]
        return problems + [
            "the deliverables index links to no answer, so no link could be followed: the rows of the notebook "
            "that ran (01_benchmarking) say " + "; ".join(f"{row[0]}: {row[3]}" for row in ran)
            + " (a row links to its answer once the notebook records it with nb.answer or nb.not_run)"]
    problems += [f"index link {link['label']!r} -> #{link['id']}: no element with that id in the page"
                 for link in links if not link["found"]]
    problems += [f"index link {link['label']!r} -> #{link['id']}: the element is not displayed (hidden code?)"
                 for link in links if link["found"] and not link["displayed"]]
    # Followed as a reader follows them: a click scrolls the answer into view.
    for link in links:
        if not (link["shown"] and link["displayed"]):
            continue
        page.locator(f'table.deliverables a[href="#{link["id"]}"]').first.click()
        top = page.evaluate("id => document.getElementById(id).getBoundingClientRect().top", link["id"])
        # scrolling lands on whole device pixels, so a target at a fractional offset ends up to a
        # pixel above the window's top edge: still in view
        if not -1 < top < page.viewport_size["height"]:
            problems.append(f"index link {link['label']!r}: after the click its answer is {top:.0f} px from the "
                            "top of the window, out of view")
    page.evaluate("window.scrollTo(0, 0)")
    return problems


def _toggle_problems(page) -> list[str]:
    button = page.locator("#toggle-code")
    code, prose = page.locator(".jp-CodeCell .jp-InputArea"), page.locator(".jp-MarkdownCell .jp-RenderedMarkdown")
    if button.count() != 1 or code.count() == 0 or prose.count() == 0:
        return [f"expected one #toggle-code button, code cells and markdown cells; found {button.count()} "
                f"button(s), {code.count()} code input(s), {prose.count()} markdown cell(s)"]
    seen, problems = [], []
    for step in ("when the page opens", "after one click", "after two clicks"):
        seen.append((step, code.first.is_visible(), prose.first.is_visible(), button.inner_text()))
        if step != "after two clicks":
            button.click()
    expected = [(False, True, "Show code"), (True, True, "Hide code"), (False, True, "Show code")]
    for (step, *state), want in zip(seen, expected):
        if tuple(state) != want:
            problems.append(f"code toggle {step}: code {'shown' if state[0] else 'hidden'}, markdown "
                            f"{'shown' if state[1] else 'hidden'}, button {state[2]!r}; expected code "
                            f"{'shown' if want[0] else 'hidden'}, markdown shown, button {want[2]!r}")
    return problems


def _image_problems(page) -> list[str]:
    images = page.evaluate(IMAGES)
    if not images:
        return ["the report has no <img>: notebook 01's figures are missing"]
    return [f"image {img['src']}... did not load (naturalWidth {img['width']})" for img in images
            if not img["complete"] or img["width"] == 0]


def _traceback_problems(page) -> list[str]:
    problems = []
    for output in page.evaluate(OUTPUTS):
        text = output["text"]
        if TRACEBACK in text or ANSI_ESCAPE.search(text):
            problems.append(f"an output shows a traceback or raw ANSI escapes: {text[:300]!r}")
        elif output["ansi"] and TRACEBACK_LINE.search(text):
            problems.append(f"an output shows an ANSI-coloured traceback: {text[:300]!r}")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_links_toggle_figures_and_no_tracebacks_in_chromium(chromium, tmp_path, screenshot_dir):
    out_dir = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "systems.workbook", "run", "--only", "01", "--profile", "smoke",
                          "--out-dir", str(out_dir), "--no-progress"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = out_dir / "writeup" / "report.html"

    page = chromium()
    page.goto(report.as_uri())  # waits for the load event, after every image
    try:
        problems = (_index_problems(page) + _toggle_problems(page) + _image_problems(page)
                    + _traceback_problems(page))
    finally:
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(screenshot_dir / "report.png"))
    assert not problems, f"{report} in Chromium:\n- " + "\n- ".join(problems)
