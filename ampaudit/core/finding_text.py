"""Findings as rich text - ``file:line CODE [severity] message``, the source line, the fix -
the one format every command prints them in: ``check``'s report (``report/terminal.py``) and
the runtime verdicts that end ``ampaudit.watch``'s summary (``watch/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console, Group
from rich.syntax import Syntax
from rich.text import Text

from ampaudit.core.console import printable
from ampaudit.core.findings import Finding, Severity
from ampaudit.core.listing import listed
from ampaudit.core.python_source import display_lines

SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def snippet(finding: Finding, color: bool) -> Syntax | Text | None:
    """The finding's line with one line either side, or None (no file, no line: line 0)."""
    try:
        lines = [printable(line) for line in display_lines(finding.file)]
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


MODULES_SHOWN = 6  # a finding repeated in more modules than this names the first ones and counts the rest


def finding_block(finding: Finding, color: bool, modules: Sequence[str] = ()) -> Group:
    """``modules``: every module the same finding was made in (a model's repeated blocks), shown once."""
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
    if len(modules) > 1:
        parts.append(Text(f"  in {len(modules)} modules: {listed(modules, MODULES_SHOWN)}", style="dim"))
    elif finding.module:
        parts.append(Text(f"  in module {finding.module}", style="dim"))
    lines = snippet(finding, color)
    if lines is not None:
        parts.append(lines)
    if finding.fix:
        parts.append(Text(f"  fix: {finding.fix}", style="green"))
    return Group(*parts)


def _same_place(findings: Sequence[Finding]) -> list[tuple[Finding, list[str]]]:
    """The findings, one per place and words: a rule that fires on one source line in each of a
    model's 24 blocks is one block naming the modules, not 24 identical ones (the machine
    formats keep every finding)."""
    groups: dict[tuple, tuple[Finding, list[str]]] = {}
    for finding in findings:
        key = (finding.file, finding.line, finding.column, finding.rule, finding.message, finding.fix,
               finding.autofix is None)
        if finding.module is None or finding.autofix is not None:
            key = (*key, id(finding))  # a fix edits its own place: never merged
        modules = groups.setdefault(key, (finding, []))[1]
        if finding.module is not None:
            modules.append(finding.module)
    return list(groups.values())


def render_findings(findings: Sequence[Finding], console: Console) -> None:
    """Each finding (those alike but for their module, once), then the count by severity - or
    "No findings."."""
    color = console.color_system is not None
    for finding, modules in _same_place(findings):
        console.print()
        console.print(finding_block(finding, color, modules))
    console.print()
    if findings:
        counts = {s: sum(f.severity is s for f in findings) for s in Severity}
        codes = sorted({f.rule for f in findings})
        console.print(f"Found {counts[Severity.ERROR]} errors, {counts[Severity.WARNING]} warnings, "
                      f"{counts[Severity.INFO]} infos. `ampaudit explain {codes[0]}` tells more about a rule.")
    else:
        console.print("No findings.", style="green")
