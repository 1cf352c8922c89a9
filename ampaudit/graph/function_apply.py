"""One wrap of ``torch.autograd.Function.apply`` that ampaudit's passes share.

A pass that needs to see, or swap, the custom autograd Functions a model applies - the audit
noting which ones run, a converted forward giving their backward its autocast - registers a
hook for a block of code: in that block, in this thread, each Function applied is first passed
to the hook, which returns the class to apply (itself, or a subclass). One patch serves them
all and comes off when the last block ends; other threads apply their Functions as written.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from ampaudit.core.userframe import Loc, user_location

Hook = Callable[[type], type]

_FUNCTION = torch.autograd.Function
_HOOKS: ContextVar[tuple[Hook, ...]] = ContextVar("ampaudit_function_apply", default=())
_lock = threading.Lock()
_installed: list[Any] = []  # the apply each install replaced, innermost last


@contextlib.contextmanager
def on_apply(hook: Hook) -> Iterator[None]:
    """While the block runs, pass each custom Function applied in this thread to ``hook``."""
    token = _HOOKS.set((*_HOOKS.get(), hook))
    with _lock:
        if not _installed or _FUNCTION.__dict__["apply"] is not _PATCHED:
            _installed.append(_FUNCTION.__dict__["apply"])
            _FUNCTION.apply = _PATCHED
        else:
            _installed.append(_PATCHED)
    try:
        yield
    finally:
        with _lock:
            replaced = _installed.pop()
            if replaced is not _PATCHED:
                _FUNCTION.apply = replaced
        _HOOKS.reset(token)


def user_function(function: type) -> bool:
    """A Function of the user's or a library's, not one of torch's own."""
    return function.__module__.split(".")[0] != "torch"


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    for hook in _HOOKS.get():
        cls = hook(cls)
    # torch's own: a block is never opened inside fx tracing's patch (fx_tracer), which calls
    # this one where a block opened first
    return _ORIGINAL.__func__(cls, *args, **kwargs)


_ORIGINAL = _FUNCTION.__dict__["apply"]  # the classmethod every Function inherits
_PATCHED = classmethod(_apply)


@contextlib.contextmanager
def functions_applied() -> Iterator[dict[type, Loc | None]]:
    """The custom Functions of the user's (or a library's) the block applies, each with the
    user's line that first applied it - what the audit checks for custom_fwd/custom_bwd."""
    seen: dict[type, Loc | None] = {}

    def note(cls: type) -> type:
        if user_function(cls) and cls not in seen:
            seen[cls] = user_location(sys._getframe())
        return cls

    with on_apply(note):
        yield seen
