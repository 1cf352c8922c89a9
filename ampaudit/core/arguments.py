"""Checks on what callers pass to the Python API: a wrong type is a TypeError that names
the expected type, not an AttributeError from deep inside."""

from __future__ import annotations

from typing import Any


def require_module(value: Any, api: str, *, optional: bool = False, eager: bool = False) -> None:
    """``value`` must be a ``torch.nn.Module`` (or None when ``optional``); ``eager``: the
    module itself, not a torch.compile wrapper or a TorchScript module (the API traces it)."""
    if optional and value is None:
        return
    import torch  # only the torch APIs call this: the lint path never imports torch

    if not isinstance(value, torch.nn.Module):
        hint = (" (for a model file: from ampaudit.check.api import check_path; check_path('model.py'))"
                if api == "ampaudit.check" else "")
        raise TypeError(f"{api}() takes a torch.nn.Module as its model, not {type(value).__name__}{hint}")
    if eager and hasattr(value, "_orig_mod"):
        raise TypeError(f"{api}() takes the module before torch.compile: pass model._orig_mod, and compile "
                        "what ampaudit returns")
    if eager and isinstance(value, torch.jit.ScriptModule):
        raise TypeError(f"{api}() takes the module before torch.jit.script / trace: pass the nn.Module itself")
