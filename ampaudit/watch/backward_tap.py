"""Where each backward starts: its roots - the loss, which the loop's code makes outside every
module, so no module hook sees it - handed to every watch that listens (``StepRecorder.on_backward``).

``torch.autograd.backward`` is wrapped while any watch listens: ``Tensor.backward`` calls it by
name, so ``loss.backward()`` (a GradScaler's scaled loss, Lightning's, Accelerate's) passes through.
One wrapper for all watches; taken off when the last stops, unless something wrapped it since -
then it stays in that chain, passing through, and a later watch wraps anew (only the newest
wrapper tells the listeners).

``torch.autograd.grad`` is wrapped the same way for the listeners of ``listen_graph_grads``: each
call with ``create_graph=True`` (a gradient penalty: WGAN-GP's, R1's) is told, with its
caller's frame. The backward of a loss that uses such a gradient runs through that gradient's
own graph, which reads the model's activations: a gradient arrives at a module's output from it,
not from the module's consumers (``blame``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ampaudit.watch.own_frames import passes_through

Listener = Callable[[Any], Any]
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

        _wrapper = torch.autograd.backward = passes_through(backward)
    _listeners.append(listener)


_graph_listeners: list[Listener] = []
_grad_wrapper: Callable[..., Any] | None = None


def listen_graph_grads(listener: Listener) -> None:
    """``listener(frame)`` before each ``torch.autograd.grad(..., create_graph=True)``, ``frame`` its
    caller's; what it returns, if not None, is called after the gradient is taken."""
    global _grad_wrapper
    if _grad_wrapper is None or (torch.autograd.grad is not _grad_wrapper and not _graph_listeners):
        original = torch.autograd.grad

        @functools.wraps(original)
        def grad(*args: Any, **kwargs: Any) -> Any:
            # traced by torch.compile: the call alone - dynamo would break the graph at the frame
            # asked for below, and trace the listeners' own code (warnings of builtins it cannot trace)
            if grad is not _grad_wrapper or torch.compiler.is_compiling() or \
                    not kwargs.get("create_graph", args[4] if len(args) > 4 else False):
                return original(*args, **kwargs)
            frame = sys._getframe(1)
            after = [each(frame) for each in list(_graph_listeners)]
            try:
                return original(*args, **kwargs)
            finally:
                for each in after:
                    if each is not None:
                        each()

        _grad_wrapper = torch.autograd.grad = passes_through(grad)
    _graph_listeners.append(listener)


def unlisten_graph_grads(listener: Listener) -> None:
    global _grad_wrapper
    if listener in _graph_listeners:
        _graph_listeners.remove(listener)
    if not _graph_listeners and _grad_wrapper is not None and torch.autograd.grad is _grad_wrapper:
        torch.autograd.grad, _grad_wrapper = _grad_wrapper.__wrapped__, None


def unlisten(listener: Listener) -> None:
    global _wrapper
    if listener in _listeners:
        _listeners.remove(listener)
    if not _listeners and _wrapper is not None and torch.autograd.backward is _wrapper:
        torch.autograd.backward, _wrapper = _wrapper.__wrapped__, None
