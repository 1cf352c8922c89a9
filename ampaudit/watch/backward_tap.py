"""Where each backward starts: its roots - the loss, which the loop's code makes outside every
module, so no module hook sees it - handed to every watch that listens (``StepRecorder.on_backward``).

``torch.autograd.backward`` is wrapped while any watch listens: ``Tensor.backward`` calls it by
name, so ``loss.backward()`` (a GradScaler's scaled loss, Lightning's, Accelerate's) passes through.
One wrapper for all watches; taken off when the last stops, unless something wrapped it since -
then it stays in that chain, passing through, and a later watch wraps anew (only the newest
wrapper tells the listeners).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

Listener = Callable[[Any], None]
_listeners: list[Listener] = []
_wrapper: Callable[..., Any] | None = None  # the newest wrapper: the one that tells the listeners


def listen(listener: Listener) -> None:
    global _wrapper
    if _wrapper is None or (torch.autograd.backward is not _wrapper and not _listeners):
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if backward is _wrapper:
                for each in list(_listeners):
                    each(tensors)
            return original(tensors, *args, **kwargs)

        _wrapper = torch.autograd.backward = backward
    _listeners.append(listener)


def unlisten(listener: Listener) -> None:
    global _wrapper
    if listener in _listeners:
        _listeners.remove(listener)
    if not _listeners and _wrapper is not None and torch.autograd.backward is _wrapper:
        torch.autograd.backward, _wrapper = _wrapper.__wrapped__, None
