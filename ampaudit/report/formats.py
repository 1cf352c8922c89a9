"""Machine-readable renderings of a Report: JSON (the schema in docs/check.md), SARIF, GitHub."""

from __future__ import annotations

import json

from ampaudit.core.findings import Report


def render_machine(report: Report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if fmt == "sarif":
        from ampaudit.report.sarif import to_sarif

        return json.dumps(to_sarif(report), indent=2) + "\n"
    if fmt == "github":
        from ampaudit.report.github import to_github

        return to_github(report)
    raise ValueError(f"unknown format {fmt!r}")
