"""The rich terminal report: summary panel, fp32 ops by module, findings with their code.

Colour follows rich's rules: off when NO_COLOR is set or output is not a terminal.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ampaudit.core.console import printable
from ampaudit.core.finding_text import SEVERITY_STYLE as _STYLE
from ampaudit.core.finding_text import render_findings
from ampaudit.core.findings import Precision, Report, Severity

_PRECISION_STYLE = {Precision.LOW: "green", Precision.FP32: "magenta", Precision.PROMOTE: "blue",
                    Precision.NEUTRAL: "dim"}


def _precision_label(precision: Precision, report: Report) -> str:
    """LOW is printed as the audited dtype (fp16 or bf16); the rest by name."""
    return report.dtype.short if precision is Precision.LOW else precision.value


def _summary_panel(report: Report) -> Panel:
    counts = Counter(n.precision for n in report.nodes)
    ops = Text()
    ops.append(f"{len(report.nodes)} nodes: ")
    parts = [(f"{counts.get(p, 0)} {_precision_label(p, report)}", _PRECISION_STYLE[p]) for p in Precision]
    for i, (label, style) in enumerate(parts):
        ops.append(label, style=style)
        if i < len(parts) - 1:
            ops.append(" · ")
    s = report.summary()
    findings = Text()
    for i, (label, count, sev) in enumerate(
        (("errors", s["errors"], Severity.ERROR), ("warnings", s["warnings"], Severity.WARNING),
         ("infos", s["infos"], Severity.INFO))):
        findings.append(f"{count} {label}", style=_STYLE[sev] if count else "dim")
        if i < 2:
            findings.append(" · ")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    entry = f" ({escape(report.target.entry)})" if report.target.entry else ""
    grid.add_row("target", f"{escape(printable(report.target.file))}{entry}")
    if report.fp8 is not None:
        layers = report.fp8["layers"]
        kept = sum(layer["verdict"] != "fp8" for layer in layers)
        grid.add_row("dtype", f"fp8 ({report.fp8['recipe']})")
        grid.add_row("layers", f"{len(layers)} nn.Linear: {len(layers) - kept} fp8 · {kept} kept in bf16")
    elif report.nodes or report.target.trace != "none":
        grid.add_row("trace", report.target.trace)
        grid.add_row("dtype", report.dtype.name)
        grid.add_row("ops", ops)
    grid.add_row("findings", findings)
    for note in report.target.notes:
        grid.add_row("note", Text(note, style="dim"))
    return Panel(grid, title="ampaudit check", title_align="left", expand=False)


def _fp32_table(report: Report) -> Table | None:
    groups: dict[str, list] = defaultdict(list)
    for node in report.nodes:
        if node.precision is Precision.FP32:
            groups[node.module or "(model)"].append(node)
    if not groups:
        return None
    measured = any(n.measured for nodes in groups.values() for n in nodes)
    table = Table(title="Ops that need fp32, by module", title_justify="left", show_lines=False)
    table.add_column("module", no_wrap=True)
    table.add_column("op", style="magenta", no_wrap=True)
    table.add_column("line", justify="right", no_wrap=True)
    if measured:  # what the range audit saw, had the op run in the low dtype
        for col in ("absmax", "flushed", f"{report.dtype} error"):
            table.add_column(col, justify="right", no_wrap=True)
    table.add_column("reason", overflow="fold", ratio=1)
    for module, nodes in groups.items():
        for i, node in enumerate(nodes):
            cells = [escape(module) if i == 0 else "", escape(node.kind), _where(node.file, node.line, report)]
            if measured:
                cells += _measured_cells(node.measured)
            table.add_row(*cells, escape(node.reason))
    return table


def _measured_cells(m: dict | None) -> list[str]:
    if not m:
        return ["", "", ""]
    error = "" if m["rel_error"] is None else f"{m['rel_error']:.1e} ({m['bits_lost']} bits)"
    return [f"{m['absmax']:.3g}", f"{m['flush'] * 100:.0f}%", error]


def _where(file: str, line: int, report: Report) -> str:
    """Just the line number in the target file; file:line elsewhere, and only the file's name
    for library code outside the working folder (``modeling_gpt2.py:254``)."""
    if file == report.target.file:
        return str(line)
    return f"{escape(printable(os.path.basename(file) if os.path.isabs(file) else file))}:{line}"


def _ops_table(report: Report) -> Table:
    measured = any(n.measured for n in report.nodes)
    table = Table(title="Every op", title_justify="left")
    for col in ("node", "kind", "module", "precision", "line"):
        table.add_column(col, no_wrap=True)
    if measured:
        for col in ("absmax", "flushed", f"{report.dtype} error"):
            table.add_column(col, justify="right", no_wrap=True)
    table.add_column("reason", overflow="fold", ratio=1)
    for node in report.nodes:
        cells = [escape(node.name), escape(node.kind), escape(node.module or ""),
                 Text(_precision_label(node.precision, report), style=_PRECISION_STYLE[node.precision]),
                 _where(node.file, node.line, report)]
        if measured:
            cells += _measured_cells(node.measured)
        table.add_row(*cells, escape(node.reason))
    return table


def render(report: Report, console: Console, *, show_ops: bool = False) -> None:
    console.print(_summary_panel(report))
    if report.fp8 is not None and report.fp8["layers"]:
        from ampaudit.report.fp8_table import fp8_table

        console.print(fp8_table(report.fp8))
    table = _fp32_table(report)
    if table is not None:
        console.print(table)
    if show_ops and report.nodes:
        console.print(_ops_table(report))
    render_findings(report.findings, console)
    if report.findings:
        safe = sum(f.autofix is not None and f.autofix.safe for f in report.findings)
        unsafe = sum(f.autofix is not None and not f.autofix.safe for f in report.findings)
        if safe or unsafe:
            console.print(f"{safe} fixable with --fix" + (f", {unsafe} more with --unsafe-fixes" if unsafe else "")
                          + " (--diff to preview).")
