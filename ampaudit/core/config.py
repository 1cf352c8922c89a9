"""Settings from ``[tool.ampaudit]`` in pyproject.toml, merged with the command line.

Which findings they keep is applied by ``core/finalize.py``."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.core.dtypes import FLOAT16, LOW_DTYPES, LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.core.findings import FAIL_ON, Report
from ampaudit.core.resources import load_toml

_KEYS = {"select", "ignore", "fail-on", "dtype", "policy"}
_PREFIX = re.compile(r"^AMP\d{0,3}$")


@dataclass
class Config:
    select: list[str] = field(default_factory=list)  # code prefixes; empty selects every rule
    ignore: list[str] = field(default_factory=list)
    fail_on: str = "warning"
    dtype: LowDtype = FLOAT16
    policy: dict[str, Any] = field(default_factory=dict)  # [tool.ampaudit.policy], ops.toml schema
    source: Path | None = None  # the pyproject.toml it came from

    def enabled(self, code: str) -> bool:
        if self.select and not any(code.startswith(p) for p in self.select):
            return False
        return not any(code.startswith(p) for p in self.ignore)

    def fails(self, report: Report) -> bool:
        """Whether ``report`` has a finding at or above this config's ``fail_on``."""
        return report.fails(self.fail_on)


def check_prefixes(values: Iterable[str], what: str) -> list[str]:
    out = []
    for value in values:
        for part in str(value).split(","):
            part = part.strip().upper()
            if not part:
                continue
            if not _PREFIX.match(part):
                raise UsageError(f"{what}: {part!r} is not a rule code or prefix (e.g. AMP101, AMP1)")
            out.append(part)
    return out


def find_pyproject(start: Path) -> Path | None:
    """The pyproject.toml whose [tool.ampaudit] table applies to ``start``: the search goes up
    to the project root - the first folder holding a pyproject.toml or .git - and no further
    (a broken or foreign pyproject.toml above the project is never read). A pyproject.toml in
    a folder others may write and the user does not own (``/tmp``) is never read: anyone could
    have put an ``ignore = ["AMP"]`` there."""
    root = project_root(start)
    path = root / "pyproject.toml" if root is not None else None
    if path is None or not path.is_file() or _shared_by_others(root):
        return None
    return path if _has_table(path) else None


def project_root(start: Path) -> Path | None:
    """The root of the project ``start`` (a file or folder) lies in: the first folder from it up
    holding a pyproject.toml or a .git; None when none does."""
    folder = start.resolve()
    if folder.is_file():
        folder = folder.parent
    for candidate in (folder, *folder.parents):
        if (candidate / "pyproject.toml").is_file() or (candidate / ".git").exists():
            return candidate
    return None


def _shared_by_others(folder: Path) -> bool:
    try:
        info = folder.stat()
    except OSError:
        return True
    return bool(info.st_mode & stat.S_IWOTH) and info.st_uid != os.geteuid()


def _has_table(path: Path) -> bool:
    try:
        data = load_toml(path)
    except Exception as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise UsageError(f"{path}: [tool] must be a table, not {type(tool).__name__}")
    if "ampaudit" not in tool:
        return False
    if not isinstance(tool["ampaudit"], dict):
        raise UsageError(f"{path}: [tool.ampaudit] must be a table, not {type(tool['ampaudit']).__name__}")
    return True


def load_config(start: Path | None) -> Config:
    path = find_pyproject(start) if start is not None else None
    if path is None:
        return Config()
    table = load_toml(path)["tool"]["ampaudit"]
    unknown = set(table) - _KEYS
    if unknown:
        raise UsageError(f"{path} [tool.ampaudit]: unknown key(s) {', '.join(sorted(unknown))}")
    config = Config(source=path)
    config.select = check_prefixes(_codes(table, "select", path), f"{path} select")
    config.ignore = check_prefixes(_codes(table, "ignore", path), f"{path} ignore")
    config.fail_on = validate_choice(table.get("fail-on", "warning"), FAIL_ON, f"{path} fail-on")
    config.dtype = LowDtype.parse(validate_choice(table.get("dtype", "float16"), LOW_DTYPES, f"{path} dtype"))
    policy = table.get("policy", {})
    if not isinstance(policy, dict):
        raise UsageError(f"{path} [tool.ampaudit.policy] must be a table")
    config.policy = policy
    return config


def _codes(table: dict[str, Any], key: str, path: Path) -> list[str]:
    """``select = ["AMP1", "AMP203"]``; one string (``"AMP1,AMP203"``) is accepted too."""
    value = table.get(key, [])
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{path} {key} must be a list of rule codes or prefixes such as [\"AMP1\"], "
                         f"not {value!r}")
    return value


def validate_choice(value: Any, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise UsageError(f"{what} must be one of {', '.join(choices)} (got {value!r})")
    return value
