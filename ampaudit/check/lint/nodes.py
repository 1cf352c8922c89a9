"""Reading ``ast`` expressions the way the lint rules need them: dotted names, the
arguments of a call in the order they are written, the value inside a ``typing.cast``."""

from __future__ import annotations

import ast
from typing import NamedTuple


class Arg(NamedTuple):
    """One argument of a call as written, in source order: ``x``, ``*xs``, ``key=x``, ``**kw``."""

    keyword: str | None  # None for `x`, `*xs` and `**kw`
    value: ast.expr  # `xs` for `*xs`, `kw` for `**kw`
    node: ast.AST  # the whole argument (the value, an ast.Starred or an ast.keyword)


def arguments(call: ast.Call) -> list[Arg]:
    """The arguments of ``call`` in the order they are written (``ast`` keeps positional and
    keyword arguments apart)."""
    out = [Arg(None, unstarred(a), a) for a in call.args]
    if call.keywords:
        out += [Arg(k.arg, k.value, k) for k in call.keywords]
        if call.args and _where(call.args[-1]) > _where(call.keywords[0]):  # f(key=1, *rest)
            out.sort(key=lambda a: _where(a.node))
    return out


def _where(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def unwrap_cast(node: ast.expr) -> ast.expr:
    """The value inside ``typing.cast(T, value)`` (a type checker's wrapper), else ``node``."""
    if node.__class__ is ast.Call and len(node.args) + len(node.keywords) == 2 \
            and (dotted(node.func) or "").rsplit(".", 1)[-1] == "cast":
        return arguments(node)[1].value
    return node


def dotted(node: ast.AST | None) -> str | None:
    """``a.b.c`` for a chain of names; ``True``, ``False`` and ``None`` count as names."""
    parts = []
    while node.__class__ is ast.Attribute:
        parts.append(node.attr)
        node = node.value
    if node.__class__ is ast.Name:
        parts.append(node.id)
    elif node.__class__ is ast.Constant and (node.value is None or node.value is True or node.value is False):
        parts.append(str(node.value))  # `enabled=True` reads as the flag "True", as it always has
    else:
        return None
    return ".".join(reversed(parts)) if len(parts) > 1 else parts[0]


def unstarred(node: ast.expr) -> ast.expr:
    """``x`` for ``*x`` (an unpacked element or base), else the node itself."""
    return node.value if node.__class__ is ast.Starred else node
