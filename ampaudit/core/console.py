"""The rich console every command prints through: colour follows NO_COLOR and the
terminal, and pipes get 120 columns."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

from rich.console import Console

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
MIN_COLUMNS = 20  # a COLUMNS below this (0, garbage) is ignored: rich would print nothing


class _PrintableConsole(Console):
    """Every string printed, a table's cells included, shown ``printable``: module and
    parameter names come from the user's model or from a log that may be anyone's (``report``),
    and an ESC in one drove the terminal (a window title, a cleared screen)."""

    def render_str(self, text: str, **kwargs):  # type: ignore[override]
        return super().render_str(printable(text), **kwargs)

    def _render_buffer(self, buffer):  # type: ignore[override]
        # the last step before the text is written: Text built directly skips render_str; rich's
        # own control segments (cursor moves) and its styles' codes are left as they are
        return super()._render_buffer(segment if segment.control else segment._replace(text=printable(segment.text))
                                      for segment in buffer)


def make_console(file=None, *, width: int | None = None) -> Console:
    if width is None and not _usable_columns():
        width = 120
    console = _PrintableConsole(file=file, highlight=False, soft_wrap=False, width=width)
    if width is None and not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 120  # logs and pipes: rich's 80 columns would wrap code lines
    return console


def _usable_columns() -> bool:
    """Whether COLUMNS is absent or a width rich can print in."""
    text = os.environ.get("COLUMNS")
    return text is None or (text.strip().isdigit() and int(text) >= MIN_COLUMNS)


def printable(text: str) -> str:
    """``text`` with terminal control characters (ESC, BEL, ...) shown as ``\\xNN``: a file name
    or a source line must not drive the user's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


@contextlib.contextmanager
def slow_status(text: str, *, after: float = 2.0) -> Iterator[None]:
    """A spinner with ``text`` on a terminal's stderr, shown only once the block has taken
    ``after`` seconds (quick runs print nothing extra; pipes and logs never see it)."""
    console = make_console(sys.stderr)
    if not console.is_terminal:
        yield
        return
    status = console.status(text)
    timer = threading.Timer(after, status.start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        status.stop()
