"""Small helpers for matching op patterns on fx graphs (shared by the hazard rules)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx

from ampaudit.check.graph_view import GraphView

# Ops that move or reshape values without changing them: looked through when asking
# "where does this value come from?".
TRANSPARENT = frozenset({
    "getitem", "getattr", "detach", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as",
    "contiguous", "clone", "flatten", "transpose", "permute", "to", "float", "type_as",
})


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
    """The node that produced ``value``, looking through reshapes, indexing and copies."""
    seen = 0
    while isinstance(value, fx.Node) and view.kind(value) in TRANSPARENT and value.args and seen < 32:
        value = value.args[0]
        seen += 1
    return value if isinstance(value, fx.Node) else None


def source_kind(view: GraphView, value: Any) -> str | None:
    node = source(view, value)
    return view.kind(node) if node is not None else None


def users(node: fx.Node) -> Iterator[fx.Node]:
    return iter(node.users)


def of_kind(view: GraphView, nodes: Iterable[fx.Node], kinds: Iterable[str]) -> list[fx.Node]:
    wanted = set(kinds)
    return [n for n in nodes if view.kind(n) in wanted]


def finfo(dtype: str) -> torch.finfo:
    return torch.finfo(getattr(torch, dtype))


def smallest_subnormal(dtype: str) -> float:
    info = finfo(dtype)
    return info.smallest_normal * info.eps  # eps = 2**-mantissa_bits


def mantissa_bits(dtype: str) -> int:
    return -int(math.log2(finfo(dtype).eps))
