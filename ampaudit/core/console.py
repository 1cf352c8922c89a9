"""The rich console every command prints through: colour follows NO_COLOR and the
terminal, and pipes get 120 columns."""

from __future__ import annotations

import os

from rich.console import Console


def make_console(file=None, *, width: int | None = None) -> Console:
    console = Console(file=file, highlight=False, soft_wrap=False, width=width)
    if width is None and not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 120  # logs and pipes: rich's 80 columns would wrap code lines
    return console
