"""How files are named in reports: relative to the working directory when inside it."""

from __future__ import annotations

import errno
import os
from functools import lru_cache


@lru_cache(maxsize=4096)
def display_path(file: str) -> str:
    if file.startswith("<"):
        return file
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive on Windows
        return file
    return file if rel.startswith(os.pardir + os.sep) or rel == os.pardir else rel


def missing(path: str | os.PathLike[str], what: str, shown: str | None = None) -> str:
    """Why ``path``, which does not exist as far as ``Path.exists`` says, cannot be read, in one
    line: "no such WHAT: SHOWN", or - where following its links never ends (ELOOP) - that it is
    a symlink loop, which a missing file is not."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{os.fspath(path)}: a symlink loop (too many levels of symbolic links)"
    except ValueError:  # a NUL in the name: no such file either
        pass
    return f"no such {what}: {shown if shown is not None else os.fspath(path)}"
