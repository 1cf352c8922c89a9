"""GitHub Actions workflow commands: one ``::error``/``::warning``/``::notice`` per finding."""

from __future__ import annotations

from ampaudit.core.findings import Report, Severity

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def to_github(report: Report) -> str:
    lines = []
    for f in report.findings:
        props = [f"file={_escape_property(f.file)}"]
        if f.line > 0:  # 0: the whole file (a runtime finding of `ampaudit run`'s script)
            props.append(f"line={f.line}")
        if f.column:
            props.append(f"col={f.column}")
        props.append(f"title={_escape_property(f'ampaudit {f.rule}')}")
        lines.append(f"::{_COMMAND[f.severity]} {','.join(props)}::{_escape_data(f.message)}")
    return "\n".join(lines) + ("\n" if lines else "")
