"""Every notebook is a jupytext percent script whose header names a kernel, so that
`jupytext --to ipynb` + papermill (without this project's runner) can execute it."""

import pytest

from systems.measure.env import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_header_has_a_kernelspec(path):
    import jupytext

    nb = jupytext.read(path)
    spec = nb.metadata.get("kernelspec", {})
    # papermill reads the kernel's name from here ("No kernel name found" without it)
    assert spec.get("name") == "python3", path.name
    assert spec.get("language") == "python" and spec.get("display_name"), path.name
    assert path.read_text().startswith("# ---\n# jupyter:\n"), path.name
