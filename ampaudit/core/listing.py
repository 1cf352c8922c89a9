"""Names in one line of text: the first few, and how many more (a note, a message)."""

from __future__ import annotations

from collections.abc import Sequence


def listed(items: Sequence[str], most: int) -> str:
    """``"a, b, c and 4 more"``: the first ``most`` of ``items``, then how many are left out."""
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
