"""Running totals of log rows as ``line_shape`` proved them (lists: the log row's fields, then
the counts from hist_from), added up step after step without a Stats dict a row: the fields
in a list per tensor, the histogram in a dense list of counts by exponent. ``stats`` gives
each total as the Stats dict ``stats_merge.add_stats`` would have summed from the same rows in
the same order - a sum is taken in the same order, a maximum kept as ``max`` keeps it, and an
exponent is in the histogram where a count was nonzero (the counts are whole numbers >= 0, so
where the total is). Torch-free.
"""

from __future__ import annotations

from operator import add
from typing import Any

from ampaudit.watch.layout import LAYOUT, MAX
from ampaudit.watch.line_shape import Shape
from ampaudit.watch.stats_merge import FIELDS, LOG_ROW

_SUMS = tuple(i for i, name in enumerate(FIELDS) if LAYOUT.reduce[name] != MAX)
_MAXES = tuple(i for i, name in enumerate(FIELDS) if LAYOUT.reduce[name] == MAX)
# the summed fields first (layout.FIELDS: the counts, then absmax): one slice of them adds them all
_LEADING = len(_SUMS) if tuple(range(len(_SUMS))) == _SUMS else 0
_FROM = LOG_ROW.index("hist_from")
_COUNTS = len(LOG_ROW)


class _Total:
    __slots__ = ("fields", "hist", "low")

    def __init__(self, row: list) -> None:
        self.fields = row[:_FROM]  # the first row's values as they are, as add_stats({}, row) takes them
        self.low = row[_FROM]  # the exponent of hist[0]: the histogram spans what the rows held
        self.hist = row[_COUNTS:]

    def add(self, row: list) -> None:
        fields = self.fields
        if _LEADING:
            fields[:_LEADING] = map(add, fields[:_LEADING], row[:_LEADING])
        else:
            for i in _SUMS:
                fields[i] = fields[i] + row[i]
        for i in _MAXES:
            if row[i] > fields[i]:  # max(total, row): the total unless the row's is larger
                fields[i] = row[i]
        hist = self.hist
        start = row[_FROM] - self.low
        if start < 0:  # counts below the lowest so far
            hist[0:0] = [0] * -start
            self.low, start = row[_FROM], 0
        end = start + len(row) - _COUNTS
        if end > len(hist):
            hist.extend([0] * (end - len(hist)))
        hist[start:end] = map(add, hist[start:end], row[_COUNTS:])

    def stats(self) -> dict[str, Any]:
        stats = dict(zip(FIELDS, self.fields, strict=True))
        stats["hist"] = [[self.low + e, c] for e, c in enumerate(self.hist) if c]
        return stats


class RowTotals:
    """Per (module, phase) and per parameter, the total of its rows so far (``add``), in the
    order each was first seen."""

    def __init__(self) -> None:
        self.layers: dict[tuple[str, str], _Total] = {}
        self.params: dict[str, _Total] = {}
        self._slots: dict[Shape, list[_Total | None]] = {}  # per shape, each row's total

    def __bool__(self) -> bool:
        return bool(self.layers or self.params)

    def add(self, shape: Shape, rows: list[list]) -> None:
        """One step's rows, in ``shape``'s order (``line_shape.Matched``)."""
        slots = self._slots.get(shape)
        if slots is None:
            if len(self._slots) > 64:  # shapes come and go: keep a few
                self._slots.clear()
            slots = self._slots[shape] = [self.layers.get(key) for key in shape.keys] + \
                [self.params.get(name) for name in shape.params]
        for i, row in enumerate(rows):
            total = slots[i]
            if total is not None:
                total.add(row)
                continue
            # a row this shape has not held yet; another shape may have started its total
            held, key = (self.layers, shape.keys[i]) if i < len(shape.keys) else \
                (self.params, shape.params[i - len(shape.keys)])
            total = held.get(key)
            if total is None:
                held[key] = _Total(row)
            else:
                total.add(row)
            slots[i] = held[key]

    def clear(self) -> None:
        self.layers.clear()
        self.params.clear()
        self._slots.clear()
