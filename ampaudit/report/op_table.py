"""``ampaudit ops``: the catalog entries a search found (``Catalog.search``), as a table or JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time neither is needed: --help, which lists the formats, stays fast
    from rich.table import Table

    from ampaudit.core.catalog import OpMatch


def ops_json(matches: Sequence[OpMatch], total: int) -> str:
    data = [{"kind": m.kind, "precision": m.policy.precision.value, "autocast": m.policy.autocast,
             "reason": m.policy.reason, "source": m.policy.source, "also": list(m.also)} for m in matches]
    return json.dumps(data, indent=2) + "\n"


def ops_table(matches: Sequence[OpMatch], total: int) -> Table:
    """A rich table of ``matches``, titled with how many of the catalog's ``total`` kinds they are."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"op catalog: {len(matches)} of {total} kinds", title_justify="left")
    for col in ("kind", "precision", "autocast"):
        table.add_column(col, no_wrap=True)
    table.add_column("reason / source / also matched by", overflow="fold", ratio=1)
    for m in matches:
        also = ", ".join(m.also)
        detail = Text(m.policy.reason + "\n")
        detail.append(m.policy.source + (f"; {also}" if also else ""), style="dim")
        table.add_row(m.kind, m.policy.precision.value, m.policy.autocast, detail)
    return table


# ``ampaudit ops --format``: text to print as it is, or a rich renderable for a console
OPS_FORMATS: dict[str, Callable[[Sequence[OpMatch], int], Any]] = {"text": ops_table, "json": ops_json}
