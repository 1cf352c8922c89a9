"""Checks on what callers pass to the Python API: a wrong type is a TypeError that names
the expected type, not an AttributeError from deep inside."""

from __future__ import annotations

from typing import Any


def require_module(value: Any, api: str, *, optional: bool = False) -> None:
    """``value`` must be a ``torch.nn.Module`` (or None when ``optional``)."""
    if optional and value is None:
        return
    import torch  # only the torch APIs call this: the lint path never imports torch

    if not isinstance(value, torch.nn.Module):
        hint = " (for a model file use ampaudit.check_path('model.py'))" if api == "ampaudit.check" else ""
        raise TypeError(f"{api}() takes a torch.nn.Module as its model, not {type(value).__name__}{hint}")
