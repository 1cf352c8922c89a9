"""Mapping a function over the tensors inside nested args and outputs (lists, tuples, dicts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``; containers rebuilt, namedtuples
    and other objects left as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and not is_namedtuple(value):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value
