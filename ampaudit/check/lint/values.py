"""Reading literal values out of libcst expressions."""

from __future__ import annotations

import libcst as cst


def literal_number(node: cst.BaseExpression | None) -> float | None:
    """The value of ``1e-8``, ``-1e9``, ``65504``, ``+3``; None for anything computed."""
    sign = 1.0
    while isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        if isinstance(node.operator, cst.Minus):
            sign = -sign
        node = node.expression
    if isinstance(node, (cst.Integer, cst.Float)):
        return sign * float(node.evaluated_value)
    return None
