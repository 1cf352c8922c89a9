"""The last step of every report: which findings are kept, once, for every pillar.

Deselected codes (``select`` / ``ignore`` by prefix), inline ``# ampaudit: ignore[CODE]``
comments and findings another one supersedes are dropped; the rest are sorted, and each
graph node learns the code of its most severe finding.
"""

from __future__ import annotations

import re

from ampaudit.core.config import Config
from ampaudit.core.findings import Finding, Report
from ampaudit.core.python_source import display_lines
from ampaudit.core.rulebook import rulebook

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
                self._cache[file] = display_lines(file)
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
    rules = rulebook()
    covered = {(f.file, f.line, code) for f in findings if f.rule in rules for code in rules[f.rule].supersedes}
    return [f for f in findings if (f.file, f.line, f.rule) not in covered]


def drop_repeated(findings: list[Finding]) -> list[Finding]:
    """One finding where two passes made the same one: the lint and the model audit both judge
    a Function class in the model file (AMP415)."""
    seen: set[tuple] = set()
    kept = []
    for f in findings:
        key = (f.rule, f.file, f.line, f.column, f.module, f.node, f.message)
        if key not in seen:
            seen.add(key)
            kept.append(f)
    return kept


def finalize(report: Report, config: Config) -> Report:
    """Drop deselected, superseded, repeated and inline-suppressed findings, sort, attach codes
    to nodes."""
    lines = _Lines()
    kept = [f for f in report.findings if config.enabled(f.rule) and not is_suppressed(f, lines)]
    report.findings = drop_superseded(drop_repeated(kept))
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
