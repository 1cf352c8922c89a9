"""Parse a training script once and collect its facts in one visit (visit.py): the lint's
way in. Top-level functions and classes that mention nothing any rule reads are not
visited at all."""

from __future__ import annotations

import ast
import gc
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.imports import ImportMap
from ampaudit.check.lint.source import SourceText
from ampaudit.check.lint.visit import Visitor
from ampaudit.core.python_source import parse_python


def collect(path: str, source: str, relevant: re.Pattern[str] | None = None) -> ScriptFacts:
    """Parse ``source`` once and gather its facts; raises SyntaxError.

    ``relevant``: what the rules read (``RuleRegistry.read_pattern``); top-level functions
    and classes it does not match are not visited. None visits everything."""
    with _no_collection():
        tree = _parse(source)
        text = SourceText(source)
        # the names' dtypes (inference.py) matter only where autocast is turned off in a region
        infer = _DISABLED.search(source) is not None
        defined = frozenset(n.name for n in tree.body if n.__class__ in _FUNCTIONS) if infer else frozenset()
        imports = ImportMap.of(tree)
        visitor = Visitor(text, imports, defined, infer_dtypes=infer)
        if relevant is not None:
            relevant = with_aliases(relevant, imports)
        visitor.module(relevant_statements(text, tree, relevant) if relevant is not None else tree.body)
        return visitor.facts(path)


def with_aliases(relevant: re.Pattern[str], imports: ImportMap) -> re.Pattern[str]:
    """``relevant`` and the names the file binds to what it matches: after ``from
    torch.cuda.amp import autocast as ac`` a function that only says ``ac()`` is read too
    (its use is one AMP401's fix must rewrite, or withhold the fix for)."""
    aliases = sorted(name for name, target in imports.bound.items()
                     if relevant.search(target) is not None and relevant.search(name) is None)
    if not aliases:
        return relevant
    return re.compile(f"{relevant.pattern}|\\b(?:{'|'.join(map(re.escape, aliases))})\\b", relevant.flags)


def relevant_statements(text: SourceText, tree: ast.Module, relevant: re.Pattern[str]) -> list[ast.stmt]:
    """The module's statements, less the top-level functions and classes whose text
    ``relevant`` (what the rules read) does not match: model code (layers, datasets,
    configs) holds nothing the protocol rules read, so it is not visited."""
    kept = []
    for node in tree.body:
        if node.__class__ in _DEFINITIONS:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if not relevant.search(text.source, text.line_start(first), text.line_start(node.end_lineno + 1)):
                continue
        kept.append(node)
    return kept


def _parse(source: str) -> ast.Module:
    """The syntax tree of ``source``, without the warnings Python's compiler gives about the
    code (``"\\."``, an invalid escape): the user asked for the lint's findings, not those."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_python(source)  # too deep for the parser: RecursionError, the lint's AMP004


@contextmanager
def _no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused: a syntax tree and its facts hold no cycles, yet
    the millions of nodes of a large file set the collector off again and again (half the
    time of a parse, and more than linear in the file's size)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_DEFINITIONS = frozenset({ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef})
_FUNCTIONS = frozenset({ast.FunctionDef, ast.AsyncFunctionDef})
_DISABLED = re.compile(r"enabled\s*=\s*False")  # autocast(enabled=False): what AMP422 looks into
