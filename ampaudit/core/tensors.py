"""The tensors in a nested value - a call's arguments, a model's output: tuples, lists and
mappings (HF's ModelOutput too). graph's tracers, convert's checks and watch's replays all walk
them. torch is imported when a walk starts, not with this module, as core/ imports without torch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nest of tuples, lists and mappings (HF's ModelOutput too), depth first."""
    from torch import Tensor

    return _walk(value, Tensor)


def has_tensor(value: Any) -> bool:
    """Whether a (nested) output holds a tensor; dict subclasses such as HF's ModelOutput count."""
    return next(iter_tensors(value), None) is not None


def _walk(value: Any, tensor: type) -> Iterator[torch.Tensor]:
    if isinstance(value, tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _walk(item, tensor)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item, tensor)
