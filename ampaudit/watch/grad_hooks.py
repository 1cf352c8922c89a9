"""A tensor's gradient hooks, written straight into torch's own hook dict: the same entry, in
the same order, as ``tensor.register_hook``, without its Python wrapper (which cost more than
the rest of a module's hook on the watch's hot path).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def add_grad_hook(tensor: torch.Tensor, hook: Any) -> Any:
    """``tensor.register_hook(hook)``, into torch's dict. Returns what
    ``remove_grad_hook`` takes. A subclass (or a torch version without the dict) takes the
    public way."""
    if type(tensor) is not torch.Tensor:
        return tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    if hooks is None:
        grad_fn = tensor.grad_fn
        if grad_fn is not None and not hasattr(grad_fn, "_register_hook_dict"):
            return tensor.register_hook(hook)
        tensor._backward_hooks = hooks = OrderedDict()
        if grad_fn is not None:
            grad_fn._register_hook_dict(tensor)
    key = RemovableHandle.next_id
    RemovableHandle.next_id += 1
    hooks[key] = hook
    return key


def remove_grad_hook(tensor: torch.Tensor, added: Any) -> None:
    """Take off a hook ``add_grad_hook`` put on ``tensor`` (it returned ``added``)."""
    if isinstance(added, RemovableHandle):
        added.remove()
    elif tensor._backward_hooks is not None:
        tensor._backward_hooks.pop(added, None)


def last_hook(tensor: torch.Tensor) -> Any:
    """The gradient hook registered last on ``tensor``, or None."""
    hooks = tensor._backward_hooks
    return next(reversed(hooks.values())) if hooks else None
