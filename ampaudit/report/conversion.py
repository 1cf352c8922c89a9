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


def render_conversion(summary: dict[str, Any], target: Target, files: list[str], console: Console, *,
                      export_ran: bool | None = None) -> None:
    """``export_ran``: whether the export was loaded back and run before it was written (None:
    not said)."""
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
        _training_rows(grid, train)
    for item in summary["promoted"]:
        grid.add_row("promoted", f"{item['node']}: {item['reason']}")
    for note in summary["notes"]:
        grid.add_row("note", note)
    if export_ran is not None:
        grid.add_row("export run", "loaded back with ampaudit.apply and run on the example inputs" if export_ran
                     else "NOT RUN: no example inputs (define example_inputs() or give --input-shape to run "
                          "the export before it is written)")
    grid.add_row("written", ", ".join(files))
    console.print(Panel(grid, title="ampaudit convert", title_align="left", expand=False))


def _training_rows(grid: Table, train: dict[str, Any]) -> None:
    """The training check in one row; on failure both loss curves, update by update."""
    verdict = "within" if train["passed"] else "OUTSIDE"
    steps = train.get("reduced") or f"{train['steps']} steps"
    skipped = train["skipped"]
    if not train["converted"]:  # the scale never let one through: nothing to compare
        grid.add_row("training check", f"FAILED: no update applied - the loss scale skipped all {skipped} steps "
                                       "tried (inf/NaN gradients at every scale); fp32's loss started at "
                                       f"{train['fp32'][0]:.4g}" if train["fp32"] else "FAILED: no update applied")
        return
    grid.add_row("training check", f"{steps}: loss {train['converted'][-1]:.4g} vs {train['fp32'][-1]:.4g} in fp32, "
                                   f"{train['worst']:.1%} apart over the last {train.get('window', 1)} "
                                   f"({verdict} {train['tolerance']:.0%})"
                                   + (f"; {skipped} step{'s' if skipped != 1 else ''} skipped by the loss scale, "
                                      "compared by applied update" if skipped else ""))
    if not train["passed"]:
        grid.add_row("fp32 losses", " ".join(f"{v:.4g}" for v in train["fp32"]))
        grid.add_row("converted losses", " ".join(f"{v:.4g}" for v in train["converted"]))
