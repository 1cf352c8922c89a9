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


class _Tap:
    """One wrapper of ``torch.autograd.<name>`` for every listener, made by ``wrap(original,
    tap)``; taken off when the last listener leaves, unless something wrapped it since."""

    def __init__(self, name: str, wrap: Callable[[Callable[..., Any], _Tap], Callable[..., Any]]) -> None:
        self.name, self._wrap = name, wrap
        self.listeners: list[Listener] = []
        self.wrapper: Callable[..., Any] | None = None  # the newest wrapper: the one that tells the listeners

    def listen(self, listener: Listener) -> None:
        current = getattr(torch.autograd, self.name)
        if self.wrapper is None or (current is not self.wrapper and not self.listeners):
            self.wrapper = passes_through(self._wrap(current, self))
            setattr(torch.autograd, self.name, self.wrapper)
        self.listeners.append(listener)

    def unlisten(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
        if not self.listeners and self.wrapper is not None and getattr(torch.autograd, self.name) is self.wrapper:
            setattr(torch.autograd, self.name, self.wrapper.__wrapped__)
            self.wrapper = None


def _backward(original: Callable[..., Any], tap: _Tap) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if backward is tap.wrapper:
            for each in list(tap.listeners):
                each(tensors)
        return original(tensors, *args, **kwargs)

    return backward


def _grad(original: Callable[..., Any], tap: _Tap) -> Callable[..., Any]:
    @functools.wraps(original)
    def grad(*args: Any, **kwargs: Any) -> Any:
        # traced by torch.compile: the call alone - dynamo would break the graph at the frame
        # asked for below, and trace the listeners' own code (warnings of builtins it cannot trace)
        if grad is not tap.wrapper or torch.compiler.is_compiling() or \
                not kwargs.get("create_graph", args[4] if len(args) > 4 else False):
            return original(*args, **kwargs)
        frame = sys._getframe(1)
        after = [each(frame) for each in list(tap.listeners)]
        try:
            return original(*args, **kwargs)
        finally:
            for each in after:
                if each is not None:
                    each()

    return grad


_backward_tap = _Tap("backward", _backward)
_grad_tap = _Tap("grad", _grad)


def listen(listener: Listener) -> None:
    """``listener(roots)`` before each ``torch.autograd.backward`` (``loss.backward()`` too)."""
    _backward_tap.listen(listener)


def unlisten(listener: Listener) -> None:
    _backward_tap.unlisten(listener)


def listen_graph_grads(listener: Listener) -> None:
    """``listener(frame)`` before each ``torch.autograd.grad(..., create_graph=True)``, ``frame`` its
    caller's; what it returns, if not None, is called after the gradient is taken."""
    _grad_tap.listen(listener)


def unlisten_graph_grads(listener: Listener) -> None:
    _grad_tap.unlisten(listener)
