"""Where each backward starts: its roots - the loss, which the loop's code makes outside every
module, so no module hook sees it - handed to every watch that listens (``StepRecorder.on_backward``).

``torch.autograd.backward`` is wrapped while any watch listens: ``Tensor.backward`` calls it by
name, so ``loss.backward()`` (a GradScaler's scaled loss, Lightning's, Accelerate's) passes through.
One wrapper for all watches; taken off when the last stops, unless something wrapped it since
(then it stays, passing through).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Listener = Callable[[Any], None]
_listeners: list[Listener] = []
_original: Callable[..., Any] | None = None


def _backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    for listener in list(_listeners):
        listener(tensors)
    return _original(tensors, *args, **kwargs)


def listen(listener: Listener) -> None:
    global _original
    if not _listeners and torch.autograd.backward is not _backward:
        _original = torch.autograd.backward
        torch.autograd.backward = _backward
    _listeners.append(listener)


def unlisten(listener: Listener) -> None:
    global _original
    if listener in _listeners:
        _listeners.remove(listener)
    if not _listeners and torch.autograd.backward is _backward:
        torch.autograd.backward, _original = _original, None
