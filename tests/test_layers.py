"""The layer rule of docs/design.md, enforced on the imports of every module (read with ast).

Each top-level folder has an explicit set of folders it may import (``ALLOWED``), the same
arrows docs/design.md's table lists; any import outside that set fails, whatever the folders'
places in the diagram. No two files or folders import each other, not even through an import
inside a function; and core/ imports without torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "ampaudit"
PILLARS = ("check", "convert", "watch")
# Per top-level folder (or top-level file), the other folders its modules may import.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "graph": {"core"},
    "load": {"graph", "core"},
    "check": {"load", "graph", "core"},
    "convert": {"load", "graph", "core"},
    "watch": {"core"},
    "report": {"core"},
    "integrations": {"watch", "core"},
    "cli": {"check", "convert", "watch", "report", "load", "graph", "core"},
    "__init__": {"check", "convert", "watch", "core"},
    "__main__": {"cli"},
    "_version": set(),
}
LEAVES = {"_version"}  # a constant that imports nothing: any module may import it


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
    assert all(folder in ALLOWED for folder in map(_folder, MODULES)), set(map(_folder, MODULES)) - set(ALLOWED)


def test_every_import_is_an_allowed_arrow():
    wrong = []
    for module, targets in GRAPH.items():
        here = _folder(module)
        for target in targets:
            there = _folder(target)
            if there != here and there not in ALLOWED[here] | LEAVES:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_allowed_arrows_are_layers():
    # The table itself: no cycle (so the folders stack), and the pillars never reach one another.
    assert _cycles(ALLOWED) == []
    for pillar in PILLARS:
        assert not ALLOWED[pillar] & set(PILLARS), pillar


def _design_arrows() -> dict[str, set[str]]:
    """docs/design.md's arrows table: ``| watch → core | why | ... |``, one row per folder."""
    design = (ROOT / "docs" / "design.md").read_text()
    arrows = {}
    for source, targets in re.findall(r"^\| ([\w`./]+) → ([^|]+?) \|", design, flags=re.M):
        if source == "from":  # the header
            continue
        names = {t.strip().strip("`").removesuffix("/") for t in targets.split(",")} - {"nothing"}
        arrows[source.strip("`").removesuffix("/").removesuffix(".py")] = names
    return arrows


def test_design_doc_lists_the_same_arrows():
    assert _design_arrows() == {k: v for k, v in ALLOWED.items() if k not in LEAVES}


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


def test_core_imports_without_torch():
    # core/ is what the torch-free lint path stands on: each of its modules imports torch, if
    # at all, inside the function that needs it.
    names = sorted(m for m in MODULES if _folder(m) == "core")
    code = f"import sys\nfor m in {names!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_design_doc_names_every_module_and_layer():
    # docs/design.md is the map of this layout: a module it does not name is a module the
    # map does not show, so it must be updated with the code.
    design = (ROOT / "docs" / "design.md").read_text()
    rule_folders = {"graph_rules", "script_rules"}  # one file per rule: the folder is named instead
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and p.parent.name not in rule_folders and p.name not in design]
    assert missing == []
    for folder in ALLOWED:
        if not folder.startswith("_"):
            assert f"{folder}/" in design, folder
