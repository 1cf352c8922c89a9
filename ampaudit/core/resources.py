"""Locate the declarative catalog (``rules/``) in a wheel or in a source checkout."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_PACKAGE = Path(__file__).resolve().parent.parent


@cache
def rules_dir() -> Path:
    """The folder holding ops.toml and rules.toml.

    Wheels carry it as ``ampaudit/_rules`` (see pyproject's force-include); an editable
    install or a checkout reads the top-level ``rules/`` next to the package.
    """
    for candidate in (_PACKAGE / "_rules", _PACKAGE.parent / "rules"):
        if (candidate / "ops.toml").is_file():
            return candidate
    raise FileNotFoundError(f"ampaudit's catalog (rules/ops.toml) is missing from {_PACKAGE}")


def load_toml(path: Path) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)
