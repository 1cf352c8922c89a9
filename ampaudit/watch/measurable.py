"""Which tensors watch measures: dense, strided float tensors with values. The others - torch.func
wrappers, nested, sparse and meta tensors - are counted by kind, never measured.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ampaudit.watch.call_context import functorch_wrapped


def unmeasurable(t: torch.Tensor, wrapped: bool = True) -> str | None:
    """Why watch cannot measure a float tensor (its kind), or None: the row kernels read a
    dense, strided buffer with values. ``wrapped=False``: no torch.func transform is active
    (``call_context.transformed``), so no tensor is a functorch wrapper - the hooks' hot path
    skips asking."""
    if wrapped and functorch_wrapped(t):
        return "functorch"
    if t.is_nested:
        return "nested"
    if t.layout != torch.strided:
        return "sparse"
    if t.is_meta:
        return "meta"
    return None


def measurable_tensors(value: Any, limit: int = 8, skipped: Counter | None = None,
                       wrapped: bool = True) -> list[torch.Tensor]:
    """Measurable float tensors in a module's output or inputs (a tensor, or a tuple/list/dict
    of them); the others are counted in ``skipped`` by kind, never measured (complex and
    quantized tensors are not floating point: not counted). ``wrapped``: as ``unmeasurable``."""
    items = [value] if isinstance(value, torch.Tensor) else \
        value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    found = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            kind = unmeasurable(item, wrapped)
            if kind is None:
                found.append(item)
            elif skipped is not None:
                skipped[kind] += 1
        if len(found) >= limit:
            break
    return found


def positional(args: Any, skipped: Counter | None = None, wrapped: bool = True) -> list[tuple[int, torch.Tensor]]:
    """The measurable float tensors among a call's positional arguments, with their position;
    the others counted in ``skipped`` by kind (``measurable_tensors``)."""
    found = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            kind = unmeasurable(arg, wrapped)
            if kind is None:
                found.append((i, arg))
            elif skipped is not None:
                skipped[kind] += 1
    return found
