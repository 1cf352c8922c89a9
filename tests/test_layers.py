"""The layer rule of docs/design.md, enforced on the imports of every module (read with ast).

core <- graph <- load <- {check, convert}; watch beside them (core only below it); report
and cli on top. A module imports its own package and the layers below it, never a layer
above and never a sibling pillar; and no two files or folders import each other, not even
through an import inside a function.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "ampaudit"
# Each top-level folder's layer; a module may import only from a lower layer or its own folder.
LAYERS = {"_version": -1, "core": 0, "graph": 1, "load": 2, "check": 3, "convert": 3, "watch": 3, "report": 4,
          "integrations": 4, "cli": 5, "__init__": 6, "__main__": 6}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The ampaudit module an import refers to (``from a.b import c`` may name module a.b.c)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "ampaudit":
                target = _resolve(name)
                if target is not None:
                    found.add(target)
    return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_walk_sees_the_package():
    assert len(MODULES) > 80
    assert "ampaudit.check.audit" in GRAPH["ampaudit.check.run"]  # a lazy import inside a function counts
    assert all(folder in LAYERS for folder in map(_folder, MODULES)), set(map(_folder, MODULES)) - set(LAYERS)


def test_no_module_imports_a_layer_above_or_a_sibling():
    wrong = []
    for module, targets in GRAPH.items():
        here = _folder(module)
        for target in targets:
            there = _folder(target)
            if there != here and LAYERS[there] >= LAYERS[here] and not (module == "ampaudit" or target == "ampaudit"):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _without_parent_packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    # Importing a.b.c runs a/__init__ and a/b/__init__ first; that is Python's doing, not an
    # arrow between the two files, so an import of a module's own ancestor package is left out.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}


def test_no_import_cycle_between_files():
    assert _cycles(_without_parent_packages(GRAPH)) == []


def _folder_path(module: str) -> str:
    path = MODULES[module]
    return str(path.parent.relative_to(ROOT))


def test_no_import_cycle_between_folders():
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in _without_parent_packages(GRAPH).items():
        for target in targets:
            a, b = _folder_path(module), _folder_path(target)
            if a != b and not a.startswith(b + "/"):  # a subfolder may use its parent package
                edges[a].add(b)
    assert _cycles(edges) == []


@pytest.mark.parametrize("pillar", ["check", "convert", "watch"])
def test_pillars_share_code_only_through_lower_layers(pillar):
    others = {"check", "convert", "watch"} - {pillar}
    reach = {t for m, ts in GRAPH.items() if _folder(m) == pillar for t in ts}
    assert not {_folder(t) for t in reach} & others


def test_design_doc_names_every_module_and_layer():
    # docs/design.md is the map of this layout: a module it does not name is a module the
    # map does not show, so it must be updated with the code.
    design = (ROOT / "docs" / "design.md").read_text()
    rule_folders = {"graph_rules", "script_rules"}  # one file per rule: the folder is named instead
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and p.parent.name not in rule_folders and p.name not in design]
    assert missing == []
    for folder in LAYERS:
        if not folder.startswith("_"):
            assert f"{folder}/" in design, folder
