"""Names in one line of text: the first few, and how many more (a note, a message)."""

from __future__ import annotations

from collections.abc import Sequence

# the most items a finding's message or fix names (the lines of a name's other uses, the
# modules a model declares): a generated file's thousands would make one message megabytes
IN_A_MESSAGE = 10


def listed(items: Sequence[str], most: int) -> str:
    """``"a, b, c and 4 more"``: the first ``most`` of ``items``, then how many are left out."""
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
