"""Comments and docstrings describe the code as it is: none narrates its history, and a
``Class.attribute`` they name exists on that class (read with tokenize and ast)."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

# Phrases that only narrate a change (what the code did, what a fix changed): the history is
# in git; a comment says what the code does and why.
NARRATION = re.compile(r"\b(previously|formerly|until now|before (this|the) (fix|change|commit|refactor)"
                       r"|(it|this|that|we) used to|used to (be|say|raise|crash|land|return|count|remove))\b",
                       re.IGNORECASE)
# ``Monitor.step``, Monitor.step(): a class of the package and one of its attributes
DOTTED = re.compile(r"\b([A-Z]\w*)\.([A-Za-z_]\w*)\b")


def _files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@functools.cache
def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring in ``path``."""
    return list(_comments_and_docstrings(path))


def _comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def test_no_comment_narrates_history():
    found = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
             for path in _files("ampaudit", "tests", "bench") for line, text in _texts(path)
             for match in NARRATION.finditer(text)]
    assert not found, "say what the code does, not what it did:\n" + "\n".join(found)


@functools.cache
def _class_attributes() -> tuple[dict[str, set[str]], set[str]]:
    """Per class name in the package, the attributes its classes of that name define (methods,
    class-level names, ``self.x`` assignments, those of bases in the package); and the class
    names with a base from outside the package, whose attributes cannot be known here."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in _files("ampaudit"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1] for b in node.bases)
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(inner.name)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
                elif (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                      and inner.value.id == "self"):
                    names.add(inner.attr)
    foreign = {name for name, of in bases.items() if of - own.keys() - {"object"}}
    changed = True
    while changed:  # inherit from the package's own bases
        changed = False
        for name, of in bases.items():
            for base in of & own.keys():
                if not own[base] <= own[name] or (base in foreign and name not in foreign):
                    own[name] |= own[base]
                    foreign |= {name} if base in foreign else set()
                    changed = True
    return own, foreign


def test_a_class_attribute_a_comment_names_exists():
    attributes, foreign = _class_attributes()
    stale = [f"{path.relative_to(ROOT)}:{line}: {cls}.{attr}"
             for path in _files("ampaudit") for line, text in _texts(path)
             for cls, attr in DOTTED.findall(text)
             if cls in attributes and cls not in foreign and attr not in attributes[cls]]
    assert not stale, "comments naming attributes their class does not have:\n" + "\n".join(stale)


def test_the_checks_see_the_package():
    # not vacuous: the walk reads comments, and knows Monitor's public step
    attributes, foreign = _class_attributes()
    assert "step" in attributes["Monitor"] and "Monitor" not in foreign
    assert sum(1 for path in _files("ampaudit") for _ in _texts(path)) > 1000
