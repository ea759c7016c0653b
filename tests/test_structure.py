"""The house's shape, measured: no import cycle (lazy imports included), no private name imported across
modules, no library module over 700 lines, a one-line docstring atop each module."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("partitioner", "runtime", "smp")
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(module imported, name imported or "", line) for every import of the library's own modules in ``path``,
    at any depth (an import inside a function is an edge too)."""
    out = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, "", node.lineno) for a in node.names if a.name in MODULES)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_lazy_imports_included():
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        edges[name] |= {target for target, _, _ in _imports(name, path) if target in MODULES and target != name}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    edges: dict[str, set[str]] = defaultdict(set, {"partitioner.ir": {"partitioner.walk"},
                                                   "partitioner.walk": {"partitioner.ir"}})
    assert _cycles(edges) == [["partitioner.ir", "partitioner.walk"]]


def test_no_private_name_imported_across_modules():
    private = [f"{path.relative_to(ROOT)}:{line} imports {what} from {target}"
               for name, path in MODULES.items() for target, what, line in _imports(name, path)
               if what.startswith("_") and not what.startswith("__") and target != name]
    assert private == []


def test_no_library_module_over_700_lines():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_says_its_job_in_a_docstring(name):
    path = MODULES[name]
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and docstring.strip(), f"{path.relative_to(ROOT)} has no docstring saying its job"
