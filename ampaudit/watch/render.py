"""The rich terminal view of a watch summary: a panel with the verdict, a row per module
and phase, the parameter gradients, and the findings (AMP6xx) in check's format."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ampaudit.core.finding_text import render_findings
from ampaudit.core.findings import Finding
from ampaudit.watch.summary import describe_first

_BARS = " ▁▂▃▄▅▆▇█"


def _sparkline(hist: list[list[int]], width: int = 16) -> str:
    """Magnitudes at a glance: one character per log2 bin, from the smallest exponent seen - or
    per group of neighbouring bins, so that a range from subnormals to overflow (150 exponents)
    still takes ``width`` characters and leaves the table its columns."""
    if not hist:
        return ""
    low, high = hist[0][0], hist[-1][0]
    group = -(-(high - low + 1) // width)  # exponents per character
    counts = [0] * -(-(high - low + 1) // group)
    for exponent, count in hist:
        counts[(exponent - low) // group] += count
    peak = max(counts)
    return "".join(_BARS[round(c / peak * (len(_BARS) - 1))] for c in counts)


def render_summary(summary: dict[str, Any], console: Console) -> None:
    """Names from the user's model (an ``nn.ModuleDict`` key may read ``[/bold]``) go in as
    ``Text``, never as markup."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    # with every=N the verdicts below are of the logged steps only: say so where they say "none"
    # a log cut short (the run killed, a full disk) says nothing of the steps after it either
    cut = summary.get("cut_short", False)
    partly = cut or summary.get("logged_steps", summary["steps"]) < summary["steps"]
    none = "none in the logged steps" if partly else "none"
    logged = f" ({summary['logged_steps']} logged)" if partly and not cut else ""
    grid.add_row("steps", f"{summary['steps']}{logged}")
    if cut:
        grid.add_row("log", Text("cut short: no end line (the run was stopped, or its disk full): later steps are not "
                                 "in it", style="bold yellow"))
    source = summary.get("dtype_source")
    grid.add_row("audited for", summary["dtype"] + (f" ({source})" if source and source != "given" else ""))
    first = summary["first_nonfinite"]
    grid.add_row("first non-finite", Text(
        describe_first(first).removeprefix("first in "), style="bold red") if first else Text(none, style="green"))
    if first and first.get("note"):
        grid.add_row("", Text(first["note"]))
    scaler = summary.get("scaler")
    if scaler:
        grid.add_row("loss scale", f"{scaler['scale']:g}; skipped steps: "
                     f"{scaler['skipped_steps'] or ('none logged' if partly else 'none')}")
    guard = summary.get("guard")
    if guard:
        grid.add_row("step guard", f"{len(guard['skipped_steps'])} skipped steps: held {guard['scheduler_steps_held']} "
                                   f"scheduler steps and {guard['ema_updates_held']} EMA updates, restored BatchNorm "
                                   f"{guard['batchnorm_restores']} times")
    evals = summary.get("eval_forwards") or {}
    if evals.get("count"):
        grid.add_row("eval forwards", f"{evals['count']} with grad disabled: "
                                      + ("recorded as phase eval" if evals["recorded"] else "not in the statistics"))
    if summary.get("forks"):
        n = summary["forks"]
        grid.add_row("forked", f"{n} process{'es' if n != 1 else ''} forked while watching (fork pools, DataLoader "
                               "workers): what they ran is not watched")
    if summary.get("unmeasured"):
        grid.add_row("not measured", ", ".join(f"{n} {kind} tensor{'s' if n != 1 else ''}"
                                               for kind, n in summary["unmeasured"].items()))
    console.print(Panel(grid, title="ampaudit watch", title_align="left", expand=False))
    wide = console.width >= 110  # the sparkline goes first when the terminal is narrow
    rows = []
    for module, phases in summary["layers"].items():
        for phase, s in phases.items():
            # in a forward output -inf is what a mask writes: not an overflow (as AMP605 counts)
            masked = s.get("neginf", 0) if phase in ("forward", "eval", "input") else 0
            inf, overflow = s["inf"] - masked, s["overflow"] - masked
            nan_inf = f"{s['nan']}/{inf}" + (f" ({masked} -inf)" if masked else "")
            cells = [phase, nan_inf, _percent(overflow, s["numel"]), _percent(s["underflow"], s["numel"]),
                     _percent(s["zero"], s["numel"]), f"{s['absmax']:.3g}"]
            rows.append((_one_line(module), cells, s["hist"], bool(s["nan"] or inf or overflow)))
    headers = ("phase", "nan/inf", "overflow %", "underflow %", "zero %", "absmax") if wide else (
        "phase", "nan/inf", "over %", "under %", "zero %", "absmax")
    title = "Per module (summed over logged steps; % of elements)"
    if wide:
        table = Table(title=title, title_justify="left")
    else:  # 80 columns: light borders, short headers, and names broken only after a dot
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                      pad_edge=False, show_edge=False)
    cells = [[*c, _sparkline(hist)] if wide else c for _, c, hist, _ in rows]
    name_width = _name_width(console.width, headers + (("log2 |x|",) if wide else ()), cells, wide)
    if wide:
        table.add_column("module", overflow="fold", ratio=1)
    else:
        table.add_column("module", overflow="fold", width=min(name_width, max([6] + [len(r[0]) for r in rows])))
    for col in headers:
        table.add_column(col, justify="right", no_wrap=True)
    if wide:
        table.add_column("log2 |x|", no_wrap=True)
    for (module, _, _, bad), row in zip(rows, cells, strict=True):
        table.add_row(Text(_break_at_dots(module, name_width)), *row, style="red" if bad else None)
    console.print(table)
    if summary["params"]:
        scaled = any("overflow_at_scale" in s for s in summary["params"].values())
        params = Table(title="Parameter gradients", title_justify="left")
        params.add_column("parameter", overflow="fold", ratio=1)
        for col in ["last norm", "nan/inf", "underflow %", "absmax"] + (["over at scale"] if scaled else []):
            params.add_column(col, justify="right", no_wrap=True)
        for name, s in summary["params"].items():
            cells = [Text(_one_line(name)), f"{s['norm']:.3g}" if s["norm"] is not None else "",
                     f"{s['nan']}/{s['inf']}", _percent(s["underflow"], s["numel"]), f"{s['absmax']:.3g}"]
            params.add_row(*cells, *([str(s.get("overflow_at_scale", ""))] if scaled else []))
        console.print(params)
    if summary.get("fp8"):
        console.print(_fp8_table(summary["fp8"]))
    render_findings([Finding.from_dict(f) for f in summary.get("findings", [])], console)


def _one_line(name: str) -> str:
    """A module or parameter name on one table row: an ``nn.ModuleDict`` key may hold a newline
    or a tab (the console shows other control characters as escapes already)."""
    return name.replace("\n", "\\n").replace("\t", "\\t")


def _fp8_table(fp8: dict[str, Any]) -> Table:
    """``fp8=True``: per Linear and operand, what a tensorwise (current) and a delayed float8
    recipe do to it over the logged steps (docs/watch.md, "fp8 statistics")."""
    table = Table(title="fp8 (per Linear operand, over logged steps; current = tensorwise scale from the step's "
                        "amax, delayed = from the amax history; % of elements)", title_justify="left")
    table.add_column("module", overflow="fold", ratio=1)
    table.add_column("operand", no_wrap=True)
    for col in ("fmt", "amax", "max jump", "scale", "flush %", "delayed scale", "d.sat %", "d.flush %"):
        table.add_column(col, justify="right", no_wrap=True)
    for module, entry in fp8.items():
        first = True
        for operand, r in entry.items():
            if not isinstance(r, dict):
                continue
            n = r.get("numel", 0)
            bad = r.get("delayed_saturated") or r.get("underflow")
            name = Text(_one_line(module)) + Text(f"\n{entry.get('kind') or ''}", style="dim") if first else Text("")
            first = False
            table.add_row(name, operand, str(r.get("format", "")), f"{r.get('amax', 0):.3g}",
                          f"{r.get('jump', 0):.3g}", f"{r.get('scale', 0):.3g}", _percent(r.get("underflow", 0), n),
                          f"{r.get('delayed_scale', 0):.3g}", _percent(r.get("delayed_saturated", 0), n),
                          _percent(r.get("delayed_underflow", 0), n), style="yellow" if bad else None)
    return table


def _percent(count: int, total: int) -> str:
    """A share of elements: "0", "<0.1" for a few, else one decimal."""
    if not count or not total:
        return "0"
    share = 100 * count / total
    return "<0.1" if share < 0.1 else f"{share:.1f}"


def _name_width(width: int, headers: tuple[str, ...], rows: list[list[str]], wide: bool) -> int:
    """What the module column gets at ``width``: the rest after the other columns, each its
    widest cell and three characters of padding and border (light borders: no outer edges;
    heavy: a left edge, and the module column's own three)."""
    others = sum(max([len(h)] + [len(r[i]) for r in rows]) + 3 for i, h in enumerate(headers))
    return max(12, width - others - (4 if wide else 1))


def _break_at_dots(name: str, width: int) -> str:
    """A dotted module name in lines of at most ``width``, broken after a dot where it can be."""
    parts = name.split(".")
    lines, line = [], ""
    for piece in [p + "." for p in parts[:-1]] + parts[-1:]:
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    lines.append(line)
    return "\n".join(lines)
