"""What the browser tests share: the system Chromium, driven through Playwright, with a new profile.

Without Playwright or Chromium they skip and say what to install; a Chromium that is installed
but does not start fails the test.
"""

import shutil
from pathlib import Path

import pytest

from systems.measure.env import REPO_ROOT

# For a person to look at after a run; build/ is git-ignored.
SCREENSHOT_DIR = REPO_ROOT / "build" / "browser"

# Playwright's own browser download needs its CDN, which closed machines cannot reach: the tests
# drive the distribution's Chromium instead. Without the background-networking flags Chromium keeps
# opening connections that a closed network refuses; --no-sandbox lets it run as root (CI).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHROMIUM_NAMES = ("chromium", "chromium-browser")
# JupyterLab's first load on two busy cores takes well over Playwright's default 30 s.
ACTION_TIMEOUT_MS = 90_000


def _chromium_executable() -> str:
    try:
        import playwright.sync_api  # noqa: F401 - only to learn whether it is installed
    except ImportError:
        pytest.skip("Playwright for Python is not installed: python3 -m pip install -e \".[test]\" "
                    "(the browser tests drive the system Chromium through it)")
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    pytest.skip(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}): install it, e.g. "
                "apt-get install chromium on Debian; the browser tests do not download one")


@pytest.fixture
def chromium(tmp_path: Path):
    """A function that opens a page in a headless Chromium with a new, empty profile under the
    test's tmp dir. The browser starts at the first call (a test builds what it shows first) and is
    closed after the test, also when it fails."""
    executable = _chromium_executable()  # skips before the test does any work
    started = {}

    def new_page():
        if not started:
            from playwright.sync_api import sync_playwright

            started["playwright"] = sync_playwright().start()
            started["context"] = started["playwright"].chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=executable, headless=True,
                args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900})
            started["context"].set_default_timeout(ACTION_TIMEOUT_MS)
        return started["context"].new_page()

    yield new_page
    if started:
        try:
            started["context"].close()
        finally:
            started["playwright"].stop()


@pytest.fixture
def screenshot_dir() -> Path:
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    return SCREENSHOT_DIR
