"""Reading literal values out of ``ast`` expressions."""

from __future__ import annotations

import ast


def literal_number(node: ast.expr | None) -> float | None:
    """The value of ``1e-8``, ``-1e9``, ``65504``, ``+3``; None for anything computed."""
    sign = 1.0
    while node.__class__ is ast.UnaryOp and node.op.__class__ in (ast.USub, ast.UAdd):
        if node.op.__class__ is ast.USub:
            sign = -sign
        node = node.operand
    if node.__class__ is ast.Constant and node.value.__class__ in (int, float):  # not True, not 1j
        return sign * float(node.value)
    return None


def string_value(node: ast.expr | None) -> str | bytes | None:
    """The value of a string literal (``"fp16"``, ``b"cuda"``); None for anything else."""
    if node.__class__ is ast.Constant and node.value.__class__ in (str, bytes):
        return node.value
    return None


def literal_integer(node: ast.expr | None) -> bool:
    """Whether ``node`` is an integer literal (``16``; not ``True``)."""
    return node.__class__ is ast.Constant and node.value.__class__ is int


def is_false(node: ast.expr | None) -> bool:
    """Whether ``node`` is the literal ``False`` (``enabled=False``)."""
    return node.__class__ is ast.Constant and node.value is False
