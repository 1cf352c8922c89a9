"""Writing files without ever leaving a half-written one behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ampaudit.core.errors import UsageError


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename it over ``path``."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
