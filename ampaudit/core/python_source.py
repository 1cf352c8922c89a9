"""Python source as the interpreter sees it, and room to analyse it.

``read_python`` honours a PEP 263 coding cookie and a UTF-8 BOM exactly as Python does, so a file
Python runs is a file ampaudit reads. ``run_deep`` gives the recursive passes over a syntax
tree (the lint's visit, the import guard's walk) a large stack and recursion limit, so valid
code nested a thousand levels deep (a long sum, a long attribute chain) is analysed instead
of ending in RecursionError.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import io
import re
import sys
import threading
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ampaudit.core.errors import LoadError

T = TypeVar("T")
_STACK = 256 * 1024 * 1024  # bytes of address space for the worker thread (reserved, not used)
_LIMIT = 50_000
TOO_DEEP = "nested too deeply to parse (more than Python's own parser allows)"


def read_python(path: Path) -> tuple[str, str]:
    """A Python file's text and the encoding it is written in (``utf-8-sig`` for a BOM, so a
    rewrite can keep it); a LoadError when it cannot be read or decoded, or when Python refuses
    it before parsing (a coding cookie it does not know, a null byte, a second BOM)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise LoadError(f"cannot read {path}: {exc.strerror}") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as exc:
        encoding = "utf-8"  # first lines that are not UTF-8: said by the decode below
        with contextlib.suppress(UnicodeDecodeError):
            raw.decode("utf-8")  # UTF-8 text, so the cookie is what Python refuses: unknown, or after a BOM
            reason = "a UTF-8 BOM and a coding cookie for another encoding" if raw.startswith(codecs.BOM_UTF8) \
                else f"a coding cookie Python refuses ({exc.msg})"
            raise LoadError(f"{path} has {reason}") from None
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        raise LoadError(f"{path} is not {encoding} text") from None
    except (UnicodeError, LookupError):  # a codec that never decodes ('undefined')
        raise LoadError(f"{path} declares the encoding {encoding!r}, which cannot decode text") from None
    if "\x00" in text:  # Python refuses the file, even with the null byte in a comment or a string
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise LoadError(f"{path} has a null byte on line {line}, which Python refuses")
    if text.startswith("\ufeff"):  # a second BOM: Python drops only the first, then refuses the file
        raise LoadError(f"{path} starts with two byte order marks, which Python refuses")
    return text, encoding


def display_lines(path: Path | str) -> list[str]:
    """A Python file's lines to show (a finding's snippet, its inline suppression), numbered as
    Python numbers them: decoded in the file's own encoding (a PEP 263 coding cookie, a BOM),
    bytes that do not decode replaced, and split at ``\\n``, ``\\r\\n`` and ``\\r`` only -
    ``str.splitlines`` also splits at a form feed, and at the U+0085 a latin-1 byte 0x85 decodes
    to. Raises OSError when the file cannot be read."""
    raw = Path(path).read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        text = raw.decode(encoding, errors="replace")
    except (SyntaxError, LookupError, UnicodeError):  # a cookie Python refuses: shown as UTF-8
        text = raw.decode("utf-8", errors="replace")
    lines = _LINE_BREAK.split(text)
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    return lines


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def syntax_reason(exc: SyntaxError) -> str:
    """A SyntaxError's reason, naming the grammar that refused it: code written for a newer
    Python (3.12's nested f-string quotes) is valid there, and the reader should know why not here."""
    return f"{exc.msg} (Python {sys.version_info.major}.{sys.version_info.minor}'s grammar)"


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source)``; code nested past the parser's own stack raises RecursionError, as
    code nested past the recursion limit does: CPython 3.11 says MemoryError for the first
    (``x = - - - ... 1``, 100,000 deep), which is no shortage of memory a user could fix."""
    try:
        return ast.parse(source, filename=filename)
    except MemoryError:
        raise RecursionError(TOO_DEEP) from None


def run_deep(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread with a large stack and a high recursion limit."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    old_limit, old_stack = sys.getrecursionlimit(), threading.stack_size()
    try:
        threading.stack_size(_STACK)
        sys.setrecursionlimit(max(old_limit, _LIMIT))
        worker = threading.Thread(target=target, name="ampaudit-deep")
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old_stack)
        sys.setrecursionlimit(old_limit)
    if error:
        raise error[0]
    return result[0]
