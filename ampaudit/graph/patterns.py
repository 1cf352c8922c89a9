"""Small helpers for matching op patterns on fx graphs (shared by the hazard rules).

Which ops count as a maximum, as never negative, or as moving values unchanged is data: op
traits in rules/ops.toml, read through the view's catalog."""

from __future__ import annotations

import math
import numbers
from typing import Any

from torch import fx

from ampaudit.graph.view import GraphView


def arg(node: fx.Node, index: int, name: str | None = None, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def number(view: GraphView, value: Any) -> float | None:
    """A finite Python number, or the constant inside ``torch.tensor(c)``; else None."""
    if isinstance(value, fx.Node) and view.kind(value) in ("tensor", "scalar_tensor") and value.args:
        value = value.args[0]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def source(view: GraphView, value: Any) -> fx.Node | None:
    """The node that produced ``value``, looking through reshapes, indexing, casts and copies
    (the ``same_values`` and ``passes_values`` traits)."""
    through = view.catalog.trait("same_values", "passes_values")
    seen = 0
    while isinstance(value, fx.Node) and view.kind(value) in through and value.args and seen < 32:
        value = value.args[0]
        seen += 1
    return value if isinstance(value, fx.Node) else None


def source_kind(view: GraphView, value: Any) -> str | None:
    node = source(view, value)
    return view.kind(node) if node is not None else None


MAX_SAFE_EXPONENT = 11.0  # exp(11.09) is float16's max


def non_negative(view: GraphView, node: Any) -> bool:
    kind = source_kind(view, node)
    if kind == "pow":
        exponent = number(view, arg(source(view, node), 1, "exponent"))
        return exponent is not None and exponent % 2 == 0
    return kind in view.catalog.trait("non_negative")


def bounded_exponent(view: GraphView, exponent: fx.Node | None) -> bool:
    """Whether exp's argument is provably small: x - max(x), a log-probability, -|x|,
    -0.5 * x**2, or clamped from above."""
    if exponent is None:
        return False
    kind = view.kind(exponent)
    if kind == "sub":
        return source_kind(view, arg(exponent, 1, "other")) in view.catalog.trait("max_like")
    if kind == "neg":
        return non_negative(view, arg(exponent, 0))
    if kind == "mul":  # a negative constant times something non-negative
        a, b = arg(exponent, 0), arg(exponent, 1, "other")
        for scale, other in ((a, b), (b, a)):
            c = number(view, scale)
            if c is not None and c <= 0 and non_negative(view, other):
                return True
        return False
    if kind in ("clamp", "clamp_max"):
        upper = number(view, arg(exponent, 2, "max") if kind == "clamp" else arg(exponent, 1, "max"))
        return upper is not None and upper <= MAX_SAFE_EXPONENT
    return kind in view.catalog.trait("bounded_above")
