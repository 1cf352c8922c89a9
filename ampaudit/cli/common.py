"""What every command shares: exit codes, argument types, and where a rendering goes."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampaudit.load.time_limit import MAX_SECONDS, MIN_SECONDS  # torch-free

if TYPE_CHECKING:
    from ampaudit.core.outputs import Output

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def number_type(kind: type, *, least: float, what: str, most: float = math.inf,
                smallest_positive: float = 0.0) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``kind`` from ``least`` to ``most``; when
    ``smallest_positive`` is set, 0 or at least that (a timer of 1e-9 s fires before its handler)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or not least <= value <= most or 0 < value < smallest_positive:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def path_type(text: str) -> Path:
    """A path argument; an empty one would silently mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or folder")
    return Path(text)


SECONDS = number_type(float, least=0, most=MAX_SECONDS, smallest_positive=MIN_SECONDS,
                      what=f"a number of seconds from {MIN_SECONDS:g} to {MAX_SECONDS:g} (a day), or 0 for no limit")


def emit(text: str, output: Output | None) -> None:
    """``text`` to stdout, or to a resolved ``output`` (core/outputs.py: atomically, or in
    place for a device or a FIFO)."""
    if output is None:
        sys.stdout.write(text)
        return
    from ampaudit.core.outputs import write_output

    write_output(output, text)


def show(rendered: Any) -> None:
    """A renderer's result on stdout: text as it is, anything else (a rich table) on a console."""
    if isinstance(rendered, str):
        sys.stdout.write(rendered)
        return
    from ampaudit.core.console import make_console

    make_console().print(rendered)
