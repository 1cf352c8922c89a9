"""``PATH[:NAME]`` target specs and reading the file - no torch needed, so the lint can use it."""

from __future__ import annotations

import re
from pathlib import Path

from ampaudit.core.errors import LoadError

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_target(spec: str) -> tuple[Path, str | None]:
    """``model.py:Net`` -> (Path("model.py"), "Net"); a bare path -> (path, None)."""
    path_text, sep, name = spec.rpartition(":")
    if sep and NAME_RE.match(name) and path_text:
        return Path(path_text), name
    return Path(spec), None


def read_source(path: Path) -> str:
    if not path.exists():
        raise LoadError(f"no such file: {path}")
    if path.is_dir():
        raise LoadError(f"{path} is a directory: give a Python file that defines the model")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LoadError(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise LoadError(f"cannot read {path}: {exc.strerror}") from None
