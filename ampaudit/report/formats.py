"""The formats a Report renders in: ``text``, the terminal view (report/terminal.py, drawn on
a console), and the machine-readable ones in ``MACHINE_FORMATS``: JSON (the schema in
docs/check.md), SARIF, GitHub. ``FORMATS`` is what ``--format`` offers: a format added to
``MACHINE_FORMATS`` is one ``ampaudit check`` and ``ampaudit report`` take."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from ampaudit.core.findings import Report


def _json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def _sarif(report: Report) -> str:
    from ampaudit.report.sarif import to_sarif

    return json.dumps(to_sarif(report), indent=2) + "\n"


def _github(report: Report) -> str:
    from ampaudit.report.github import to_github

    return to_github(report)


MACHINE_FORMATS: dict[str, Callable[[Report], str]] = {"json": _json, "sarif": _sarif, "github": _github}
FORMATS = ("text", *MACHINE_FORMATS)  # in the order --help lists them


def render_machine(report: Report, fmt: str) -> str:
    """``report`` in one of ``MACHINE_FORMATS``."""
    try:
        render = MACHINE_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}") from None
    return render(report)


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
