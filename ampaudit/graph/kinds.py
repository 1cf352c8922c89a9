"""Name every fx node by its catalog kind, and print its target the way a user writes it."""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from ampaudit.core.catalog import Catalog

_STRUCTURAL = ("placeholder", "get_attr", "output")


def _snake(name: str) -> str:
    """A kind-shaped name for things the catalog does not know: ``FancyNorm`` -> fancy_norm."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return re.sub(r"\W+", "_", name).strip("_").lower() or "unknown"


def node_kind(node: fx.Node, gm: fx.GraphModule, catalog: Catalog) -> tuple[str, bool]:
    """(canonical kind, known to the catalog) of one node."""
    if node.op in _STRUCTURAL:
        return node.op, True
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
        kind = catalog.kind_of_module_type(cls)
        return (kind, True) if kind else (_snake(cls.__name__), False)
    if node.op == "call_method":
        kind = catalog.canonical_kind(node.target)
    else:
        kind = catalog.kind_of_callable(node.target)
    if catalog.lookup(kind) is not None:
        return kind, True
    return _snake(kind), False


_NAMESPACES = (
    ("torch", torch), ("torch.nn.functional", torch.nn.functional), ("torch.special", torch.special),
    ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("operator", operator),
)


def printable_target(node: fx.Node, gm: fx.GraphModule) -> str:
    """How a user would write the op: ``torch.relu``, ``Tensor.view``, ``blocks.0.ln (LayerNorm)``."""
    target = node.target
    if node.op == "call_module":
        return f"{target} ({type(gm.get_submodule(target)).__name__})"
    if node.op == "call_method":
        return f"Tensor.{target}"
    if callable(target):
        name = getattr(target, "__name__", "")
        for label, namespace in _NAMESPACES:
            if name and getattr(namespace, name, None) is target:
                return f"{label}.{name}"
        module = getattr(target, "__module__", None) or ""
        qualname = getattr(target, "__qualname__", name) or repr(target)
        return f"{module}.{qualname}" if module else qualname
    return str(target)
