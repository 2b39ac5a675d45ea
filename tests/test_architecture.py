"""docs/ARCHITECTURE.md's rules, checked on the source: which layer may import which, and no
import circles between modules (imports inside functions included: a lazy import that closes a
circle is still one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from systems.measure.env import REPO_ROOT

PACKAGE = REPO_ROOT / "systems"
# lowest first; a module may import its own layer and the layers before it (docs/ARCHITECTURE.md)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config", ("systems.config",)),
    ("measure", ("systems.measure",)),
    ("model", ("systems.model", "systems.optim", "systems.attention", "systems.kernels")),
    ("parallel", ("systems.parallel",)),
    ("train", ("systems.train",)),
    ("analysis", ("systems.analysis",)),
    ("bench", ("systems.bench",)),
    ("report", ("systems.report",)),
    ("workbook", ("systems.workbook",)),
)
# test helpers (systems.testing, like torch.testing) stand beside the layers and may use measure
OUTSIDE = {"systems": 0, "systems.testing": 1}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The systems modules ``path`` imports, anywhere in the file, resolved to the modules that exist."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from systems.x import y": y may be a module or a name inside x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("systems") and t != name:
                out.add(t)
    return out


def layer_of(name: str) -> int:
    if name in OUTSIDE:
        return OUTSIDE[name]
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS here and to docs/ARCHITECTURE.md")


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def test_every_module_imports_only_its_layer_and_below():
    bad = []
    for name, deps in graph().items():
        for dep in deps:
            if dep in OUTSIDE and OUTSIDE[dep] == 0:
                continue  # the package root (systems/__init__.py re-exports the config)
            if layer_of(dep) > layer_of(name):
                bad.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    g = graph()
    # a package's __init__ that re-exports its submodules imports them by design; a circle through
    # it is only a circle if a submodule also needs the package's __init__ for something of its own
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for start in sorted(g):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_architecture_doc_names_every_layer(layer):
    doc = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert f"`{layer}`" in doc
