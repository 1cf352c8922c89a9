"""The rich console every command prints through: colour follows NO_COLOR and the
terminal, and pipes get 120 columns."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from rich.console import Console


def make_console(file=None, *, width: int | None = None) -> Console:
    console = Console(file=file, highlight=False, soft_wrap=False, width=width)
    if width is None and not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 120  # logs and pipes: rich's 80 columns would wrap code lines
    return console


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
