"""Read a model file without running it: which entry points it defines, and whether its
top level is safe to import (only imports, definitions, assignments and a main guard).

This is what lets ``ampaudit check train.py`` never start a training run by accident.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from ampaudit.core.errors import LoadError

FACTORY_NAMES = ("get_model", "build_model", "create_model", "make_model")
MODEL_ATTRIBUTE = "model"


@dataclass
class SourceScan:
    path: Path
    names: set[str] = field(default_factory=set)  # every top-level name bound by def/class/assign/import
    factories: list[str] = field(default_factory=list)  # FACTORY_NAMES present, in lookup order
    has_model_attribute: bool = False
    classes: list[str] = field(default_factory=list)
    class_refs: dict[str, set[str]] = field(default_factory=dict)  # class -> names its body mentions
    unsafe: tuple[int, int, str] | None = None  # (line, col, what) of the first statement that runs code

    @property
    def has_entry_point(self) -> bool:
        return bool(self.factories or self.has_model_attribute or self.classes)


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


_WHAT = {
    ast.For: "a for loop", ast.AsyncFor: "a for loop", ast.While: "a while loop", ast.With: "a with block",
    ast.AsyncWith: "a with block", ast.Expr: "a call", ast.Assert: "an assert", ast.Raise: "a raise",
    ast.Delete: "a del", ast.Match: "a match statement",
}


# Base classes that rule a class out as a model: autograd Functions, datasets, enums...
_NON_MODULE_BASES = frozenset({
    "Function", "Exception", "BaseException", "Enum", "IntEnum", "StrEnum", "Flag", "Dataset", "IterableDataset",
    "NamedTuple", "TypedDict", "Protocol", "ABC", "object", "Sampler", "Optimizer", "LRScheduler", "_LRScheduler",
})


def _not_a_module(base: ast.expr) -> bool:
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
    return name is not None and (name in _NON_MODULE_BASES or name.endswith(("Error", "Exception")))


def _bound_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_names(elt)]
    return []


def _scan_block(body: list[ast.stmt], scan: SourceScan) -> None:
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            scan.names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scan.names.add(stmt.name)
        elif isinstance(stmt, ast.ClassDef):
            scan.names.add(stmt.name)
            if stmt.bases and not all(_not_a_module(b) for b in stmt.bases):
                scan.classes.append(stmt.name)
                scan.class_refs[stmt.name] = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                scan.names.update(_bound_names(target))
        elif isinstance(stmt, ast.If):
            if _is_main_guard(stmt):
                continue  # never runs on import
            _scan_block(stmt.body, scan)
            _scan_block(stmt.orelse, scan)
        elif isinstance(stmt, ast.Try):  # try: import x / except ImportError: x = None
            _scan_block(stmt.body, scan)
            for handler in stmt.handlers:
                _scan_block(handler.body, scan)
            _scan_block(stmt.orelse, scan)
            _scan_block(stmt.finalbody, scan)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring or ellipsis
        elif isinstance(stmt, (ast.Pass, ast.Global, ast.Nonlocal)):
            continue
        elif scan.unsafe is None:
            scan.unsafe = (stmt.lineno, stmt.col_offset + 1, _WHAT.get(type(stmt), type(stmt).__name__.lower()))


def scan_source(path: Path, source: str) -> SourceScan:
    """Parse ``source``; a syntax error becomes a LoadError naming file:line."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise LoadError(f"syntax error in {path}:{exc.lineno}:{exc.offset or 0}: {exc.msg}") from exc
    except ValueError as exc:  # null bytes
        raise LoadError(f"cannot parse {path}: {exc}") from exc
    scan = SourceScan(path)
    _scan_block(tree.body, scan)
    scan.factories = [name for name in FACTORY_NAMES if name in scan.names]
    scan.has_model_attribute = MODEL_ATTRIBUTE in scan.names
    return scan
