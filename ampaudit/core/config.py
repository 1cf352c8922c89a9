"""Settings from ``[tool.ampaudit]`` in pyproject.toml, merged with the command line.

Which findings are kept (``select`` / ``ignore`` by code prefix, inline
``# ampaudit: ignore[CODE]``) is decided here, once, for every pillar.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampaudit.core.errors import UsageError
from ampaudit.core.findings import Finding, Report, Severity
from ampaudit.core.resources import load_toml

DTYPES = ("float16", "bfloat16")
FAIL_ON = ("error", "warning", "info", "never")
_KEYS = {"select", "ignore", "fail-on", "dtype", "policy"}
_PREFIX = re.compile(r"^AMP\d{0,3}$")


@dataclass
class Config:
    select: list[str] = field(default_factory=list)  # code prefixes; empty selects every rule
    ignore: list[str] = field(default_factory=list)
    fail_on: str = "warning"
    dtype: str = "float16"
    policy: dict[str, Any] = field(default_factory=dict)  # [tool.ampaudit.policy], ops.toml schema
    source: Path | None = None  # the pyproject.toml it came from

    def enabled(self, code: str) -> bool:
        if self.select and not any(code.startswith(p) for p in self.select):
            return False
        return not any(code.startswith(p) for p in self.ignore)

    def fails(self, report: Report) -> bool:
        if self.fail_on == "never":
            return False
        threshold = Severity(self.fail_on).rank
        return any(f.severity.rank >= threshold for f in report.findings)


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
    """The nearest pyproject.toml with a [tool.ampaudit] table, from ``start`` upwards."""
    folder = start.resolve()
    if folder.is_file():
        folder = folder.parent
    for candidate in (folder, *folder.parents):
        path = candidate / "pyproject.toml"
        if path.is_file():
            try:
                data = load_toml(path)
            except Exception as exc:
                raise UsageError(f"cannot read {path}: {exc}") from None
            if "ampaudit" in data.get("tool", {}):
                return path
    return None


def load_config(start: Path | None) -> Config:
    path = find_pyproject(start) if start is not None else None
    if path is None:
        return Config()
    table = load_toml(path)["tool"]["ampaudit"]
    unknown = set(table) - _KEYS
    if unknown:
        raise UsageError(f"{path} [tool.ampaudit]: unknown key(s) {', '.join(sorted(unknown))}")
    config = Config(source=path)
    config.select = check_prefixes(table.get("select", []), f"{path} select")
    config.ignore = check_prefixes(table.get("ignore", []), f"{path} ignore")
    config.fail_on = validate_choice(table.get("fail-on", "warning"), FAIL_ON, f"{path} fail-on")
    config.dtype = validate_choice(table.get("dtype", "float16"), DTYPES, f"{path} dtype")
    policy = table.get("policy", {})
    if not isinstance(policy, dict):
        raise UsageError(f"{path} [tool.ampaudit.policy] must be a table")
    config.policy = policy
    return config


def validate_choice(value: Any, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise UsageError(f"{what} must be one of {', '.join(choices)} (got {value!r})")
    return value


_SUPPRESS = re.compile(r"#\s*ampaudit:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.IGNORECASE)


def suppressed_codes(source_line: str) -> list[str] | None:
    """Codes an inline comment silences: None if no comment, [] meaning all."""
    match = _SUPPRESS.search(source_line)
    if match is None:
        return None
    codes = match.group("codes")
    return [c.strip().upper() for c in codes.split(",") if c.strip()] if codes else []


class _Lines:
    def __init__(self) -> None:
        self._cache: dict[str, list[str]] = {}

    def get(self, file: str, line: int) -> str:
        if file not in self._cache:
            try:
                self._cache[file] = Path(file).read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                self._cache[file] = []
        lines = self._cache[file]
        return lines[line - 1] if 0 < line <= len(lines) else ""


def is_suppressed(finding: Finding, lines: _Lines) -> bool:
    codes = suppressed_codes(lines.get(finding.file, finding.line))
    return codes is not None and (not codes or any(finding.rule.startswith(c) for c in codes))


def drop_superseded(findings: list[Finding]) -> list[Finding]:
    """One cause, one finding: drop those another finding on the same line supersedes (a
    measured overflow, or the source lint's twin, where the graph rule already named the
    out-of-range constant)."""
    from ampaudit.core.rulebook import rulebook

    rules = rulebook()
    covered = {(f.file, f.line, code) for f in findings if f.rule in rules for code in rules[f.rule].supersedes}
    return [f for f in findings if (f.file, f.line, f.rule) not in covered]


def finalize(report: Report, config: Config) -> Report:
    """Drop deselected, superseded and inline-suppressed findings, sort, attach codes to nodes."""
    lines = _Lines()
    kept = [f for f in report.findings if config.enabled(f.rule) and not is_suppressed(f, lines)]
    report.findings = drop_superseded(kept)
    report.sort()
    worst: dict[str, Finding] = {}
    for finding in report.findings:
        if finding.node is not None:
            best = worst.get(finding.node)
            if best is None or finding.severity.rank > best.severity.rank:
                worst[finding.node] = finding
    for node in report.nodes:
        hit = worst.get(node.name)
        node.rule = hit.rule if hit else None
    return report
