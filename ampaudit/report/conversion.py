"""The terminal summary of ``ampaudit convert``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ampaudit.core.findings import Target


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_conversion(summary: dict[str, Any], target: Target, files: list[str], console: Console) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", f"{target.file} ({target.entry})")
    grid.add_row("dtype", summary["dtype"])
    grid.add_row("casts inserted", str(summary["casts"]))
    grid.add_row("ops", f"{summary['ops_low']} in {summary['dtype']} · {summary['ops_fp32']} in float32 "
                        "· the rest follow their inputs")
    grid.add_row("parameters", " · ".join(f"{_bytes(b)} {d}" for d, b in sorted(summary["param_bytes"].items())))
    if summary["error_before"] is not None:
        grid.add_row("error vs fp32", f"{summary['error_before']:.2e} before promotion, "
                                       f"{summary['error_after']:.2e} after")
    train = summary.get("train")
    if train is not None:
        verdict = "within" if train["passed"] else "OUTSIDE"
        grid.add_row("training check", f"{train['steps']} steps: loss {train['converted'][-1]:.4g} vs "
                                       f"{train['fp32'][-1]:.4g} in fp32, at most {train['worst']:.1%} apart "
                                       f"({verdict} {train['tolerance']:.0%})"
                                       + (f", {train['skipped']} steps skipped by the loss scale"
                                          if train["skipped"] else ""))
    for item in summary["promoted"]:
        grid.add_row("promoted", f"{item['node']}: {item['reason']}")
    for note in summary["notes"]:
        grid.add_row("note", note)
    grid.add_row("written", ", ".join(files))
    console.print(Panel(grid, title="ampaudit convert", title_align="left", expand=False))
