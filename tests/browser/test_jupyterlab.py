"""JupyterLab as the README tells a person to use it: its `jupyter lab` command at the repository
root, a double click on notebooks/01_benchmarking.py, the parameters cell edited, Run All Cells,
a figure in the output.

The server gets config, data and runtime folders of its own (nothing from ~/.jupyter comes in,
nothing is written there), keeps checkpoints outside the repository and does not autosave, so
that the notebook file stays as committed; it is stopped by PID after the test, also on failure.
"""

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from systems.measure.env import REPO_ROOT
from systems.workbook.notebooks import NOTEBOOK_DIR, notebook_parameters, to_ipynb

NOTEBOOK = NOTEBOOK_DIR / "01_benchmarking.py"
KERNEL = "Python 3 (ipykernel)"
SERVER_START_S = 90
# Notebook 01's smoke profile runs in about 20 s alone; two busy cores can make that three times as long.
RUN_ALL_S = 150
# `VAR=value ... jupyter lab` in the README: the environment the README starts JupyterLab with.
README_COMMAND = re.compile(r"^((?:[A-Z_]+=\S+\s+)*)jupyter lab\b", re.MULTILINE)
TRACEBACK = "Traceback (most recent call last)"


def readme_lab_environment() -> dict[str, str]:
    """The variables the README's `jupyter lab` command sets (the test starts JupyterLab the same way)."""
    match = README_COMMAND.search((REPO_ROOT / "README.md").read_text())
    assert match, "README.md has no `jupyter lab` command line (its JupyterLab section tells a person how to start it)"
    return dict(assignment.split("=", 1) for assignment in match.group(1).split())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@dataclass
class Lab:
    port: int
    token: str
    log: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def api(self, path: str, *, method: str = "GET"):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:]


def _stop(proc: subprocess.Popen, lab: Lab) -> None:
    """Kernels first, through the server (they run in sessions of their own, so a signal to the
    server's process group would not reach them), then the server by its PID."""
    if proc.poll() is None:
        try:
            for kernel in lab.api("kernels"):
                lab.api(f"kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass  # a server that no longer answers still gets the signal below
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def jupyter_lab(tmp_path):
    home = tmp_path / "jupyter"
    settings = home / "config" / "lab" / "user-settings" / "@jupyterlab"
    # Running cells makes the notebook dirty; an autosave would write the edited parameters cell
    # into notebooks/01_benchmarking.py.
    _write_json(settings / "docmanager-extension" / "plugin.jupyterlab-settings", {"autosave": False})
    # No news or update pop-ups over the page (and no requests for them).
    _write_json(settings / "apputils-extension" / "notification.jupyterlab-settings",
                {"fetchNews": "false", "checkForUpdates": False})
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "IPYTHONDIR": str(home / "ipython"),
           **readme_lab_environment()}
    lab = Lab(port=_free_port(), token=secrets.token_hex(16), log=tmp_path / "jupyterlab.log")
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={lab.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={lab.token}",
               f"--ServerApp.root_dir={REPO_ROOT}", "--ServerApp.allow_root=True",
               # an absolute checkpoint dir: opening a notebook writes no .ipynb_checkpoints/ into notebooks/
               f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with lab.log.open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode} before it served:\n{lab.log_tail()}")
            try:
                lab.api("status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not answer within {SERVER_START_S} s:\n{lab.log_tail()}")
                time.sleep(0.5)
        yield lab
    finally:
        _stop(proc, lab)


def _folder_state(folder: Path) -> dict[str, bytes | None]:
    """Every entry of the folder, hidden ones included, with the bytes of its files."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()}


def _error_outputs(panel) -> list[str]:
    # textContent, not innerText: the notebook skips rendering cells out of view, whose innerText is empty
    return [text[:1500] for text in panel.locator(".jp-OutputArea-output").all_text_contents() if TRACEBACK in text]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_double_click_opens_notebook_01_as_a_notebook_and_run_all_draws_a_figure(chromium, jupyter_lab, tmp_path,
                                                                                  screenshot_dir):
    from playwright.sync_api import expect

    assert notebook_parameters(NOTEBOOK)["profile"] == "smoke", \
        f"{NOTEBOOK.name}'s parameters cell must default to the smoke profile (it runs on any machine)"
    source = to_ipynb(NOTEBOOK)
    parameters_index = next(i for i, c in enumerate(source.cells) if "parameters" in c.metadata.get("tags", []))
    out_dir = tmp_path / "lab-out"
    before = _folder_state(NOTEBOOK_DIR)

    page = chromium()
    try:
        page.goto(jupyter_lab.url("lab"))
        # Opened as a person opens a file: a double click in the file browser, on notebooks/ and then on the file.
        listing = page.locator(".jp-DirListing-content")
        listing.locator(".jp-DirListing-item", has=page.locator(".jp-DirListing-itemText", has_text=re.compile(
            r"^notebooks$"))).dblclick()
        listing.locator(".jp-DirListing-item", has=page.locator(".jp-DirListing-itemText", has_text=re.compile(
            rf"^{re.escape(NOTEBOOK.name)}$"))).dblclick()

        opened = page.locator(".jp-NotebookPanel, .jp-FileEditor").first
        opened.wait_for()
        assert page.locator(".jp-FileEditor").count() == 0, (
            f"{NOTEBOOK.name} opened in the text editor: the default viewer of .py files is not jupytext's "
            "notebook (jupyter-config/labconfig/default_setting_overrides.json, read through the README's "
            "JUPYTER_CONFIG_PATH)")
        panel = page.locator(".jp-NotebookPanel")
        cells = panel.locator(".jp-Notebook .jp-Cell")
        expect(cells).to_have_count(len(source.cells))
        expect(panel.locator(".jp-KernelName")).to_have_text(KERNEL)

        parameters = cells.nth(parameters_index).locator(".cm-content")
        expect(parameters).to_contain_text('profile = "smoke"')
        edited = re.sub(r"^out_dir\s*=.*$", f"out_dir = {json.dumps(str(out_dir))}  # this test's folder",
                        source.cells[parameters_index].source, flags=re.MULTILINE)
        edited = re.sub(r"^profile\s*=.*$", 'profile = "smoke"', edited, flags=re.MULTILINE)
        parameters.click()
        page.keyboard.press("ControlOrMeta+a")
        # one insertion, so the editor adds no brackets or indentation of its own
        page.keyboard.insert_text(edited)
        expect(parameters).to_contain_text(f"out_dir = {json.dumps(str(out_dir))}")
        page.keyboard.press("Escape")

        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

        # Run All goes on after the first figure: wait until every code cell has run (a cell that
        # raises stops Run All, so a traceback ends the wait too), then look for the figure.
        figure = panel.locator(".jp-OutputArea-output img").first
        prompts = panel.locator(".jp-CodeCell .jp-InputPrompt")
        deadline = time.monotonic() + RUN_ALL_S
        while not all(re.fullmatch(r"\[\d+\]:", text.strip()) for text in prompts.all_text_contents()):
            errors = _error_outputs(panel)
            assert not errors, f"a cell of {NOTEBOOK.name} raised:\n{errors[0]}"
            assert time.monotonic() < deadline, (f"cells still unfinished {RUN_ALL_S} s after Run All Cells "
                                                 f"(prompts {prompts.all_text_contents()})")
            time.sleep(1)
        errors = _error_outputs(panel)
        assert not errors, f"a cell of {NOTEBOOK.name} raised:\n{errors[0]}"
        assert figure.count() == 1, "every cell ran and no output area shows a figure (<img>)"
        figure.scroll_into_view_if_needed()
        expect(figure).to_be_visible()
        assert figure.evaluate("img => img.naturalWidth") > 0, "the figure's image did not load"
        assert (out_dir / "figures" / "01_benchmarking_phases.png").is_file(), \
            f"the kernel did not write into the out_dir set in the parameters cell ({out_dir})"
    finally:
        page.screenshot(path=str(screenshot_dir / "jupyterlab.png"))

    after = _folder_state(NOTEBOOK_DIR)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, (f"notebooks/ changed while JupyterLab had the notebook open (a save, a checkpoint or a "
                         f"paired .ipynb): {changed}")
