"""Text edits for autofixes: computed from libcst positions, applied to the original text,
so everything outside the edited spans - formatting, comments - stays byte for byte."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.core.findings import Edit


def replace(facts: ScriptFacts, node: cst.CSTNode, text: str) -> Edit:
    start, end = facts.span(node)
    return Edit(start, end, text)


def insert_at(offset: int, text: str) -> Edit:
    return Edit(offset, offset, text)


def _indent_of(facts: ScriptFacts, offset: int) -> tuple[int, str]:
    line_start = facts.source.rfind("\n", 0, offset) + 1
    line = facts.source[line_start:offset]
    return line_start, line[: len(line) - len(line.lstrip())]


def insert_line_before(facts: ScriptFacts, statement: cst.CSTNode, code: str) -> Edit:
    """A new line with ``code`` just above ``statement``, at the same indentation."""
    start, _ = facts.span(statement)
    line_start, indent = _indent_of(facts, start)
    return insert_at(line_start, f"{indent}{code}{_newline(facts)}")


def insert_line_after(facts: ScriptFacts, statement: cst.CSTNode, code: str) -> Edit:
    start, end = facts.span(statement)
    _, indent = _indent_of(facts, start)
    line_end = facts.source.find("\n", end)
    line_end = len(facts.source) if line_end < 0 else line_end
    return insert_at(line_end, f"{_newline(facts)}{indent}{code}")


def first_argument_insertion(facts: ScriptFacts, call: cst.Call, text: str) -> Edit:
    """Insert ``text`` as the call's first argument (adding ", " when others follow)."""
    if call.args:
        start, _ = facts.span(call.args[0])
        return insert_at(start, f"{text}, ")
    _, end = facts.span(call)
    return insert_at(end - 1, text)  # just before ")"


def _newline(facts: ScriptFacts) -> str:
    return "\r\n" if "\r\n" in facts.source else "\n"


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
