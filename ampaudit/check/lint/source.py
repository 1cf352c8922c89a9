"""A Python file's text as ``ast`` positions point into it.

``ast`` counts lines at ``\n``, ``\r\n`` and ``\r`` and columns in UTF-8 bytes; findings
count characters, and fix edits are character offsets into the text. ``SourceText`` turns
one into the other (a no-op on ASCII text, the common case) and answers what ``ast``
leaves out: the parentheses around an expression, the ``@`` of a decorator, whether a
block's statements follow its header's colon on the same line.
"""

from __future__ import annotations

import ast
import keyword
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate


@dataclass(frozen=True, eq=False)
class SourceText:
    """Positions in ``source``; read-only, its line index built once when it is made."""

    source: str
    newline: str = field(init=False, repr=False)  # the file's line break, for the lines a fix inserts
    _starts: tuple[int, ...] = field(init=False, repr=False)  # each line's start offset, then one past the end
    _ascii: bool = field(init=False, repr=False)  # byte columns are character columns

    def __post_init__(self) -> None:
        source = self.source
        newline = "\r\n" if "\r\n" in source else "\r" if "\r" in source else "\n"
        self._set_index(_line_starts(source), source.isascii(), newline)

    def _set_index(self, starts: tuple[int, ...], ascii_only: bool, newline: str) -> None:
        """The fields derived from the text, set once while the object is made (a subclass
        built over the same text takes them from a ``SourceText`` instead of computing them)."""
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_ascii", ascii_only)
        object.__setattr__(self, "newline", newline)

    def offset(self, line: int, column: int) -> int:
        """Character offset in the source of an ``ast`` position (1-based line, byte column)."""
        return self._starts[line - 1] + self._column(line, column)

    def position(self, node: ast.AST) -> tuple[int, int]:
        """1-based line and character column where ``node`` starts."""
        line = node.lineno
        return line, self._column(line, node.col_offset) + 1

    def location(self, offset: int) -> tuple[int, int]:
        """1-based line and column of a character offset."""
        line = bisect_right(self._starts, offset)
        return line, offset - self._starts[line - 1] + 1

    def decorator_position(self, node: ast.expr) -> tuple[int, int]:
        """1-based line and column of the ``@`` before a decorator's expression."""
        at = self.offset(node.lineno, node.col_offset) - 1
        while self.source[at] != "@":  # `@ name`, `@(name)`
            at -= 1
        return self.location(at)

    def line_start(self, line: int) -> int:
        """Character offset where a (1-based) line starts."""
        return self._starts[line - 1]

    def line_end(self, line: int) -> int:
        """Character offset where a line's text ends, before its line break."""
        end = self._starts[line]
        if end > len(self.source):  # the last line, without a line break
            return len(self.source)
        return end - 2 if self.source.startswith("\r\n", end - 2) else end - 1

    def lines(self, node: ast.AST) -> tuple[int, int]:
        """First and last line of a node."""
        return node.lineno, node.end_lineno

    def span(self, node: ast.AST) -> tuple[int, int]:
        """Character offsets where ``node`` starts and ends (without parentheses around it)."""
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> str:
        """The node as written, without parentheses around it."""
        start, end = self.span(node)
        return self.source[start:end]

    def outer_span(self, node: ast.AST) -> tuple[int, int]:
        """``span`` widened to the parentheses that are the node's own: ``(a and b)`` in
        ``if (a and b):``, not a call's ``(`` ``)`` around its one argument. (A comment
        between an opening parenthesis and the node stops the widening.)"""
        start, end = self.span(node)
        source = self.source
        while True:
            before, after = _skip_back(source, start), _skip_forward(source, end)
            if before < 0 or after >= len(source) or source[before] != "(" or source[after] != ")" \
                    or _calls_with(source, before):
                return start, end
            start, end = before, after + 1

    def code(self, node: ast.AST) -> str:
        """The node as written, with its own parentheses (how a message quotes it)."""
        start, end = self.outer_span(node)
        return self.source[start:end]

    def on_header_line(self, statement: ast.stmt) -> bool:
        """Whether ``statement`` follows a compound statement's colon on its line (``if x:
        return``) instead of starting a line of an indented block."""
        start = self._starts[statement.lineno - 1]
        # indentation is ASCII, so its byte length is its character length
        prefix = self.source[start:start + statement.col_offset]
        return bool(prefix) and not prefix.isspace()

    def _column(self, line: int, column: int) -> int:
        if self._ascii:
            return column
        start = self._starts[line - 1]
        if self.source[start:start + column].isascii():  # ASCII up to there: bytes are characters
            return column
        return len(self.source[start:self._starts[line]].encode()[:column].decode())


def _line_starts(source: str) -> tuple[int, ...]:
    """Character offset of each line's start, as ``ast`` numbers lines (``\\n``, ``\\r\\n``,
    ``\\r`` - not the form feeds and other separators ``str.splitlines`` also breaks at)."""
    if "\r" not in source:
        return tuple(accumulate([len(line) + 1 for line in source.split("\n")], initial=0))
    return (0, *(m.end() for m in _NEWLINE.finditer(source)), len(source) + 1)


_NEWLINE = re.compile(r"\r\n?|\n")
_SPACE = " \t\f\r\n\\"


def _skip_back(source: str, index: int) -> int:
    """The index of the last character before ``index`` that is not white space."""
    index -= 1
    while index >= 0 and source[index] in _SPACE:
        index -= 1
    return index


def _skip_forward(source: str, index: int) -> int:
    """The index of the first character from ``index`` on that is neither white space nor
    in a comment."""
    while index < len(source):
        char = source[index]
        if char == "#":
            index = source.find("\n", index)
            if index < 0:
                return len(source)
        elif char not in _SPACE:
            return index
        index += 1
    return index


def _calls_with(source: str, paren: int) -> bool:
    """Whether the ``(`` at ``paren`` opens a call's arguments (``f(``, ``x[0](``,
    ``g()(``) rather than a parenthesised expression (``if (``, ``= (``, ``not (``)."""
    end = _skip_back(source, paren)
    if end < 0:
        return False
    char = source[end]
    if char in ")]'\"":
        return True
    if not (char.isalnum() or char == "_"):
        return False
    start = end
    while start > 0 and (source[start - 1].isalnum() or source[start - 1] == "_"):
        start -= 1
    return not keyword.iskeyword(source[start:end + 1])
