"""Text edits for autofixes: computed from ``ast`` positions, applied to the original text,
so everything outside the edited spans - formatting, comments - stays byte for byte."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable

from ampaudit.check.lint.facts import Line, ScriptFacts
from ampaudit.check.lint.nodes import arguments
from ampaudit.core.findings import Edit


def replace(facts: ScriptFacts, node: ast.AST, text: str) -> Edit:
    start, end = facts.span(node)
    return Edit(start, end, text)


def insert_at(offset: int, text: str) -> Edit:
    return Edit(offset, offset, text)


def _indent_of(facts: ScriptFacts, statement: ast.stmt) -> tuple[int, str]:
    """Where the statement's line starts, and the white space before the statement."""
    line_start = facts.line_start(statement.lineno)
    line = facts.source[line_start:facts.span(statement)[0]]
    return line_start, line[: len(line) - len(line.lstrip())]


def _break_of(facts: ScriptFacts, line: int) -> str:
    """The line break that ends ``line`` - a file may mix them: an inserted line takes its
    neighbour's -, or the file's for a last line without one."""
    end = facts.line_end(line)
    found = facts.source[end:end + 2]
    return "\r\n" if found == "\r\n" else found[:1] if found[:1] in ("\r", "\n") else facts.newline


def insert_line_before(facts: ScriptFacts, statement: Line, code: str) -> Edit:
    """A new line with ``code`` just above ``statement``, at the same indentation."""
    line_start, indent = _indent_of(facts, statement[0])
    return insert_at(line_start, f"{indent}{code}{_break_of(facts, statement[0].lineno)}")


def insert_line_after(facts: ScriptFacts, statement: Line, code: str) -> Edit:
    """A new line with ``code`` just below ``statement`` (and a comment that ends its line)."""
    _, indent = _indent_of(facts, statement[0])
    last = statement[1].end_lineno
    return insert_at(facts.line_end(last), f"{_break_of(facts, last)}{indent}{code}")


def first_argument_insertion(facts: ScriptFacts, call: ast.Call, text: str) -> Edit:
    """Insert ``text`` as the call's first argument (adding ", " when others follow)."""
    written = arguments(call)
    if written:
        first = written[0]
        # before the argument's own parentheses, or its `*` or `key=`
        start, _ = facts.outer_span(first.value) if first.node is first.value else facts.span(first.node)
        return insert_at(start, f"{text}, ")
    _, end = facts.span(call)
    return insert_at(end - 1, text)  # just before ")"


def _argument_start(facts: ScriptFacts, arg) -> int:
    """Where an argument starts: before its own parentheses, or its `*` or `key=`."""
    start, _ = facts.outer_span(arg.value) if arg.node is arg.value else facts.span(arg.node)
    return start


def keyword_insertion(facts: ScriptFacts, call: ast.Call, text: str) -> Edit:
    """Insert the keyword argument ``text`` (``key=value``) after the call's positional
    arguments: ``f(fn)`` -> ``f(fn, key=value)``, never ``f(key=value, fn)``, which Python
    refuses (a positional argument after a keyword one)."""
    written = arguments(call)
    positional = [a for a in written if not isinstance(a.node, ast.keyword)]
    if not positional:
        return first_argument_insertion(facts, call, text)
    last = positional[-1]
    end = facts.outer_span(last.value)[1] if last.node is last.value else facts.span(last.node)[1]
    return insert_at(end, f", {text}")


def positional_as_keywords(facts: ScriptFacts, call: ast.Call, names: tuple[str, ...],
                           first: str = "") -> tuple[Edit, ...] | None:
    """Name the call's positional arguments ``names[i]=`` (``f(x, y)`` -> ``f(a=x, b=y)``),
    ``first`` inserted before the first argument in the same edit (two insertions at one
    offset would come out in either order). None when a positional argument is starred or
    there are more than ``names``: which parameter gets what is then unknown."""
    written = arguments(call)
    positional = [a for a in written if not isinstance(a.node, ast.keyword)]
    if len(positional) > len(names) or any(isinstance(a.node, ast.Starred) for a in positional):
        return None
    out = [insert_at(_argument_start(facts, a), f"{first if i == 0 else ''}{name}=")
           for i, (a, name) in enumerate(zip(positional, names[:len(positional)], strict=True))]
    if first and not positional:
        out.append(first_argument_insertion(facts, call, first.removesuffix(", ")))
    return tuple(out)


def rename_module(facts: ScriptFacts, node: ast.Import | ast.ImportFrom, text: str,
                  alias: ast.alias | None = None) -> Edit:
    """Replace the module an import names - ``torch.cuda`` in ``from torch.cuda import amp``,
    or ``alias``'s ``torch.cuda.amp`` in ``import torch.cuda.amp as amp`` - with ``text``.
    ``ast`` keeps the name as a string: it is found in the text (spaces around dots too)."""
    if alias is None:
        name, start = node.module or "", facts.offset(node.lineno, node.col_offset) + len("from")
    else:
        name, start = alias.name, facts.offset(alias.lineno, alias.col_offset)
    written = re.compile(r"[ \t]*\.[ \t]*".join(map(re.escape, name.split(".")))).search(facts.source, start)
    return Edit(written.start(), written.end(), text)


def apply(source: str, edits: Iterable[Edit]) -> tuple[str, list[Edit]]:
    """Apply non-overlapping edits (identical ones once); returns the text and what was applied.

    An edit that overlaps one already taken is skipped: it belongs to a fix that the next
    run will offer again on the updated text.
    """
    unique = sorted(set(edits), key=lambda e: (e.start, e.end))
    taken: list[Edit] = []
    for edit in unique:
        if taken and edit.start < taken[-1].end:
            continue
        taken.append(edit)
    out = source
    for edit in reversed(taken):
        out = out[: edit.start] + edit.replacement + out[edit.end:]
    return out, taken
