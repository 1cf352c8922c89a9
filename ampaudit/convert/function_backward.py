"""A custom autograd Function's backward under the autocast its forward ran under, in a model
the modules backend converted.

That backend runs the converted forward under ``torch.autocast`` with low weights. A Function
without ``torch.amp.custom_bwd`` runs its backward with autocast off - and a recomputing
checkpoint (improved-diffusion's and guided-diffusion's ``CheckpointFunction``, copied into many
diffusion codebases) runs its block again there, fp16 weights meeting fp32 activations: "Input
type (float) and bias type (c10::Half) should be the same". ``custom_bwd`` is torch's answer;
while a converted forward runs, each such Function of the user's is applied as a subclass
whose backward enters again what the forward ran under, as ``custom_bwd`` would. Other threads,
and torch's own Functions (``torch.utils.checkpoint`` restores autocast itself), are left as
they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from ampaudit.graph.function_apply import on_apply, user_function

Reenter = Callable[[], contextlib.AbstractContextManager[Any]]

_FUNCTION = torch.autograd.Function
_REENTER: ContextVar[Reenter | None] = ContextVar("ampaudit_function_backward", default=None)


@contextlib.contextmanager
def backward_as_forward(reenter: Reenter) -> Iterator[None]:
    """While the block runs, custom Functions applied in this thread run their backward inside
    ``reenter()`` - the contexts the forward entered."""
    token = _REENTER.set(reenter)
    try:
        with on_apply(_swap):
            yield
    finally:
        _REENTER.reset(token)


def _swap(cls: type) -> type:
    return _restoring(cls) if _needs_it(cls) else cls


def _needs_it(function: type) -> bool:
    """A user's Function whose backward does not restore autocast itself (custom_bwd)."""
    if not user_function(function) or getattr(function, "_ampaudit_restoring", False):
        return False
    return "custom_bwd" not in getattr(_user_backward(function)[1], "__qualname__", "")


def _user_backward(function: type) -> tuple[str, Callable[..., Any]]:
    """The name of the method autograd calls in backward (``vjp`` where the Function defines it
    instead of ``backward``) and that method."""
    if function.vjp is not _FUNCTION.vjp:
        return "vjp", function.vjp
    return "backward", function.backward


@functools.cache
def _restoring(function: type) -> type:
    """``function`` with its backward run inside the contexts its forward ran in."""
    name, user_backward = _user_backward(function)

    def backward(ctx: Any, *grads: Any) -> Any:
        reenter = getattr(ctx, "_ampaudit_reenter", None)
        if reenter is None:
            return user_backward(ctx, *grads)
        with reenter():
            return user_backward(ctx, *grads)

    attributes: dict[str, Any] = {name: staticmethod(backward), "_ampaudit_restoring": True,
                                  "__module__": function.__module__, "__qualname__": function.__qualname__}
    if function.setup_context is not _FUNCTION.setup_context:  # forward(*args) + setup_context(ctx, ...)
        user_setup = function.setup_context

        def setup_context(ctx: Any, inputs: Any, output: Any) -> Any:
            ctx._ampaudit_reenter = _REENTER.get()
            return user_setup(ctx, inputs, output)

        attributes["setup_context"] = staticmethod(setup_context)
    else:
        user_forward = function.forward

        def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            ctx._ampaudit_reenter = _REENTER.get()
            return user_forward(ctx, *args, **kwargs)

        attributes["forward"] = staticmethod(forward)
    return type(function.__name__, (function,), attributes)
