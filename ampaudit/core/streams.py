"""Keep stdout for ampaudit's report while the user's code runs: whatever that code prints -
through ``print``, ``sys.__stdout__`` or the file descriptor itself - goes to stderr, so
``--format json`` output stays parseable."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def user_output_to_stderr() -> Iterator[None]:
    with contextlib.redirect_stdout(sys.stderr):
        saved = _redirect_fd()
        try:
            yield
        finally:
            if saved is not None:
                with contextlib.suppress(Exception):
                    sys.__stdout__.flush()  # buffered text written during the block belongs to stderr
                os.dup2(saved, 1)
                os.close(saved)


def _redirect_fd() -> int | None:
    """Point file descriptor 1 at stderr's; returns a copy of the old one (None: not possible,
    e.g. no real stdout)."""
    try:
        if sys.__stdout__ is not None:
            sys.__stdout__.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        return None
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        return None
    return saved
