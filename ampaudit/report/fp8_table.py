"""The fp8 audit's table (``check --dtype fp8``): each Linear, its shape, the SQNR its operands
keep under every recipe, the chosen recipe's GEMMs, and the verdict - fp8, or bf16 and why."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

RECIPE_COLUMNS = (("tensorwise", "tensorwise"), ("rowwise", "rowwise"), ("rowwise_with_gw_hp", "row+gw_hp"),
                  ("mxfp8", "mxfp8"))


def _db(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "" if value is None else f"{value:.1f}"


def worst_operand_db(operands: dict[str, dict[str, Any]]) -> float | str:
    """The lowest SQNR among a recipe's operands - the input's on its ordinary elements
    (outside outlier tokens and channels), the others' over the whole tensor."""
    values = [operands["input"]["sqnr_rest_db"]] + [s["sqnr_db"] for name, s in operands.items() if name != "input"]
    numbers = [v for v in values if not isinstance(v, str)]
    if len(numbers) < len(values) and any(v == "-inf" for v in values):
        return "-inf"
    return min(numbers) if numbers else "inf"


def fp8_table(fp8: dict[str, Any]) -> Table:
    recipe = fp8["recipe"]
    table = Table(title=f"fp8 by layer (recipe {recipe}; SQNR in dB of the worst operand, the input's on its "
                        "ordinary tokens and channels)", title_justify="left")
    table.add_column("layer", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    for name, label in RECIPE_COLUMNS:
        table.add_column(label + ("*" if name == recipe else ""), justify="right", no_wrap=True)
    table.add_column("out/gi/gw", justify="right", no_wrap=True)
    table.add_column("verdict", overflow="fold", ratio=1)
    for layer in fp8["layers"]:
        shape = f"{layer['in_features']}->{layer['out_features']}"
        name = layer["name"] or "(model)"
        if layer.get("sampled"):  # measured on a sample of its tokens and features (the note says how many)
            name += " (sampled)"
        cells = [escape(name), shape]
        cells += [_db(worst_operand_db(layer["operands"][name])) for name, _ in RECIPE_COLUMNS]
        gemms = layer["gemms"]
        cells.append("/".join(_db(gemms.get(k)) for k in ("output", "grad_input", "grad_weight") if k in gemms))
        if layer["verdict"] == "fp8":
            cells.append(Text("fp8", style="green"))
        else:
            cells.append(Text(f"bf16: {layer['reason']} ({', '.join(layer['rules'])})", style="magenta"))
        table.add_row(*cells)
    if fp8.get("output_sqnr_db") is not None:
        table.caption = f"model output with the fp8 layers emulated: {_db(fp8['output_sqnr_db'])} dB SQNR vs fp32"
        table.caption_justify = "left"
    return table


def render_fp8_conversion(summary: dict[str, Any], label: str, entry: str, files: list[str], console: Any) -> None:
    """``convert --dtype fp8``: the table, the layers kept in bf16 and why, the training check."""
    from rich.panel import Panel

    if summary["table"].get("layers"):
        console.print(fp8_table(summary["table"]))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", escape(f"{label} ({entry})"))
    grid.add_row("recipe", summary["recipe"])
    nothing = "" if summary["fp8"] else ": the file converts nothing, every Linear stays in bf16"
    grid.add_row("fp8", f"{len(summary['fp8'])} nn.Linear{nothing}")
    for fqn, reason in summary["keep"].items():
        grid.add_row("bf16", escape(f"{fqn}: {reason}"))
    train = summary["train"]
    if train is not None:
        verdict = "within" if train["passed"] else "OUTSIDE"
        grid.add_row("training check", f"{train['steps']} steps: loss {train['fp8'][-1]:.4g} in fp8 vs "
                                       f"{train['bf16'][-1]:.4g} in bf16 autocast, {train['worst']:.1%} apart over "
                                       f"the last {train['window']} ({verdict} {train['tolerance']:.0%})")
        if not train["passed"]:
            grid.add_row("bf16 losses", " ".join(f"{v:.4g}" for v in train["bf16"]))
            grid.add_row("fp8 losses", " ".join(f"{v:.4g}" for v in train["fp8"]))
    else:
        grid.add_row("training check", "not run (--train-steps 0 or --no-verify)")
    for note in summary.get("notes", ()):
        grid.add_row("note", escape(note))
    grid.add_row("written", escape(", ".join(files)))
    console.print(Panel(grid, title="ampaudit convert --dtype fp8", title_align="left", expand=False))
