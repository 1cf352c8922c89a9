"""Writing files without ever leaving a half-written one behind."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from ampaudit.core.errors import UsageError


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename it over ``path``.

    The text is written as is (no newline translation) and an existing file keeps its
    permission bits, so a rewrite changes exactly the characters that were edited.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
