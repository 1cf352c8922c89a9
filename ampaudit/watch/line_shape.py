"""A step line's rows checked in one regular-expression match per line, where
``log_schema.step_problem`` checks each of its thousands of numbers in Python.

The step lines of a run share a shape - the same modules, phases and parameters, written in
the same order, step after step - so the text of a line's ``"layers": {...}, "params": {...}``
is fixed but for the numbers. ``LineShapes`` compiles that text once per shape into a pattern
whose rows admit only what the fast readers (``row_totals``, ``verdicts.ColumnView``) take
exactly as the slow path does: the integer fields as whole numbers of at most 19 digits (below
2**64, ``log_schema.MAX_INT``), the float fields as numbers >= 0, infinite included (no NaN: a
NaN maximum depends on the order it is taken in), ``hist_from`` of at most 3 digits, and the counts
as whole numbers >= 0 (a count of 20 digits or more is caught by ``too_large``). A line that
does not match - another spacing, a float count, a module not seen before - is not an error:
it takes the slow path (``step_problem``, the Stats dicts), which says what is wrong if anything
is. At most ``COMPILED`` shapes are compiled for a log (one whose modules change every step
soon stops compiling: its lines take the slow path), and the last ``KEPT`` kept.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from ampaudit.watch.layout import LAYOUT
from ampaudit.watch.stats_merge import LOG_ROW

KEPT = 8  # shapes kept (a run's lines have one; a model whose modules vary, a few)
COMPILED = 8  # shapes compiled for one log, at most (about 40 ms each for 28 modules)

_INT = r"\d{1,19}"  # a whole number below 2**64: its ", " after it ends it
_FLOAT = r"(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d{1,19}|Infinity)"
_FIELD = {name: _INT if LAYOUT.integer[name] else _FLOAT for name in LAYOUT.fields}
# a row: its fields, hist_from (the first exponent: -127 to 128 in any log watch writes), its counts
ROW = r"\[" + "".join(_FIELD[name] + ", " for name in LOG_ROW[:-1]) + r"-?\d{1,3}(?:, [0-9, ]*)?\]"
# before "layers": top-level keys whose values are numbers, true/false/null (nothing nested)
_PREFIX = r'\{(?:"[a-z_]+": [-+.0-9a-zA-Z]*, )*'
MAX_COUNT = 2**64  # log_schema.MAX_INT: a row's numbers stay within it


class Shape:
    """One set of layer and parameter keys: the pattern of its lines' rows, and its row keys
    in the line's order."""

    def __init__(self, layers: list[tuple[str, list[str]]], params: list[str]) -> None:
        self.keys = [(module, phase) for module, phases in layers for phase in phases]
        self.params = params
        text = ", ".join(_text(module) + r": \{" + ", ".join(_text(p) + ": " + ROW for p in phases) + r"\}"
                         for module, phases in layers)
        rows = ", ".join(_text(name) + ": " + ROW for name in params)
        self.pattern = re.compile(_PREFIX + r'"layers": \{' + text + r'\}, "params": \{' + rows + r"\}(?=[,}])")


def _text(key: str) -> str:
    return re.escape(json.dumps(key))


def _key(record: dict[str, Any]) -> tuple | None:
    layers, params = record.get("layers"), record.get("params")
    if not (isinstance(layers, dict) and isinstance(params, dict)
            and all(isinstance(phases, dict) for phases in layers.values())):
        return None
    return tuple((module, tuple(phases)) for module, phases in layers.items()), tuple(params)


Matched = tuple[Shape, list[list]]  # a line's shape and its rows, in its keys' order


class LineShapes:
    """The shapes of one log's step lines (``match``)."""

    def __init__(self, names: Any) -> None:
        self.on = names == list(LOG_ROW)  # a log of another row (older: no neginf) takes the slow path
        self._last: Shape | None = None
        self._shapes: OrderedDict[tuple, Shape] = OrderedDict()
        self._compiled = 0

    def match(self, line: str, record: dict[str, Any]) -> Matched | None:
        """The shape whose pattern proves ``record``'s (parsed from ``line``) layers and params
        rows are what the fast readers take, and those rows in its keys' order - or None: the
        slow path checks them."""
        if not self.on:
            return None
        shape = self._last
        if shape is None or not self._fits(shape, line):
            key = _key(record)
            if key is None:
                return None
            shape = self._shapes.get(key)
            if shape is None:
                if self._compiled >= COMPILED:
                    return None
                self._compiled += 1
                shape = self._shapes[key] = Shape([(m, list(p)) for m, p in key[0]], list(key[1]))
                if len(self._shapes) > KEPT:
                    self._shapes.popitem(last=False)
            if not self._fits(shape, line):
                return None
            self._last = shape
        rows = rows_of(record)
        if too_large(rows):
            return None
        return shape, rows

    @staticmethod
    def _fits(shape: Shape, line: str) -> bool:
        found = shape.pattern.match(line)
        # the rows matched are the record's own: no "layers" or "params" later in the line
        # (a repeated key, which JSON reads as the last one)
        return found is not None and line.find('"layers": ', found.end()) < 0 \
            and line.find('"params": ', found.end()) < 0


def rows_of(record: dict[str, Any]) -> list[list]:
    """A step record's rows: its layers' (module, then phase), then its parameters'."""
    rows = [row for phases in record["layers"].values() for row in phases.values()]
    rows.extend(record["params"].values())
    return rows


def too_large(rows: list[list]) -> bool:
    """Whether a count of the rows reaches 2**64 (20 digits or more, which ``ROW`` lets
    through): the sum of a row's numbers - all >= 0 but hist_from, > -1000 - does then, even
    in floats (2**64 - 2048 is one: rounding keeps the sum above it). A false alarm (a sum
    past it of smaller numbers) only sends the line the slow way."""
    top = MAX_COUNT - 2048
    return bool(rows) and max(map(sum, rows)) >= top
