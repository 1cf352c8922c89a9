"""Machine-readable renderings of a Report: JSON (the schema in docs/check.md), SARIF, GitHub."""

from __future__ import annotations

import json
import math
from typing import Any

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


def strict_json(value: Any) -> str:
    """JSON that every parser accepts: a non-finite number (an inf gradient norm, a NaN loss)
    becomes the string "inf", "-inf" or "nan" instead of the non-standard Infinity/NaN."""
    return json.dumps(_finite(value), indent=2, allow_nan=False) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
