"""Findings as rich text - ``file:line CODE [severity] message``, the source line, the fix -
the one format every command prints them in: ``check``'s report (``report/terminal.py``) and
the runtime verdicts that end ``ampaudit.watch``'s summary (``watch/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console, Group
from rich.syntax import Syntax
from rich.text import Text

from ampaudit.core.console import printable
from ampaudit.core.findings import Finding, Severity

SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def snippet(finding: Finding, color: bool) -> Syntax | Text | None:
    """The finding's line with one line either side, or None (no file, no line: line 0)."""
    try:
        lines = [printable(line) for line in Path(finding.file).read_text(encoding="utf-8", errors="replace")
                 .splitlines()]
    except OSError:
        return None
    if not 0 < finding.line <= len(lines):
        return None
    first, last = max(1, finding.line - 1), min(len(lines), finding.line + 1)
    if color:
        return Syntax("\n".join(lines), "python", line_numbers=True, line_range=(first, last),
                      highlight_lines={finding.line}, word_wrap=False, theme="ansi_dark")
    width = len(str(last))
    text = Text(no_wrap=True, overflow="ellipsis")
    for number in range(first, last + 1):
        marker = ">" if number == finding.line else " "
        text.append(f"{marker} {number:>{width}} | {lines[number - 1]}\n")
        if number == finding.line and finding.column:
            text.append(" " * (width + 5 + finding.column - 1) + "^\n")
    return text


def finding_block(finding: Finding, color: bool) -> Group:
    head = Text()
    file = printable(finding.file)
    head.append(f"{file}:{finding.line}" if finding.line > 0 else file, style="bold")
    if finding.column:
        head.append(f":{finding.column}", style="bold")
    head.append(" ")
    head.append(finding.rule, style=SEVERITY_STYLE[finding.severity])
    head.append(f" [{finding.severity.value}] ", style=SEVERITY_STYLE[finding.severity])
    if finding.autofix is not None:
        head.append("[fix] " if finding.autofix.safe else "[unsafe fix] ", style="green")
    head.append(finding.message)
    parts: list = [head]
    if finding.module:
        parts.append(Text(f"  in module {finding.module}", style="dim"))
    lines = snippet(finding, color)
    if lines is not None:
        parts.append(lines)
    if finding.fix:
        parts.append(Text(f"  fix: {finding.fix}", style="green"))
    return Group(*parts)


def render_findings(findings: Sequence[Finding], console: Console) -> None:
    """Each finding, then the count by severity - or "No findings."."""
    color = console.color_system is not None
    for finding in findings:
        console.print()
        console.print(finding_block(finding, color))
    console.print()
    if findings:
        counts = {s: sum(f.severity is s for f in findings) for s in Severity}
        codes = sorted({f.rule for f in findings})
        console.print(f"Found {counts[Severity.ERROR]} errors, {counts[Severity.WARNING]} warnings, "
                      f"{counts[Severity.INFO]} infos. `ampaudit explain {codes[0]}` tells more about a rule.")
    else:
        console.print("No findings.", style="green")
