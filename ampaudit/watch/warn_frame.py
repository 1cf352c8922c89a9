"""A torch call a torch function mode makes for the user, whose warnings name the user's line.

A mode's ``__torch_function__`` is a Python frame between the user's call and torch's code:
Python's ``warnings`` takes the innermost Python frame for a warning torch raises in C++
(``torch.tensor(t)``: "To copy construct from a tensor..."), and counts the mode's frame in a
Python warning's ``stacklevel`` (``F.softmax(x)``'s "Implicit dimension choice"). Either named
the mode's file and line, and filed the warning in the mode's module - its "once per line"
registry and its ``module=`` filters, not the user's. Here the call runs through a one-line
function compiled as the caller's line - its file, line, function name and module globals -, so
every warning lands where it lands without the mode: the same file, line, module and registry.
An exception's traceback shows that line once more, as a frame of the user's function.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch.overrides

# the frames torch puts between a Python function (F.softmax) and the mode: its handle_torch_function
_OVERRIDES = torch.overrides.__file__
_CALL = compile("lambda func, args, kwargs: func(*args, **kwargs)", "<call>", "eval").co_consts[0]
_MAX_SITES = 4096  # call sites compiled at most, then compiled again as they come
_sites: dict[tuple[types.CodeType, int], tuple[dict, types.FunctionType]] = {}


def caller(func: Any, frame: types.FrameType | None) -> types.FrameType | None:
    """The frame whose warnings ``func``'s call makes without the mode, from ``frame``, the
    one that called the mode's ``__torch_function__``: for a function torch implements in C
    (``torch.log``, ``Tensor.grad``), that frame; for one in Python (``F.softmax``), which asked
    for the mode through ``handle_torch_function``, the frame that called the function."""
    if frame is None or frame.f_code.co_filename != _OVERRIDES:
        return frame
    while frame is not None and frame.f_code.co_filename == _OVERRIDES:
        frame = frame.f_back
    # the function's own frame - or, under a decorator that dispatches (``boolean_dispatch``:
    # F.max_pool2d), a frame of what it called - within a few frames of handle_torch_function
    code, probe = getattr(func, "__code__", None), frame
    for _ in range(3):
        if probe is None or probe.f_code is code:
            break
        probe = probe.f_back
    if probe is not None and probe.f_code is code:
        frame = probe
    return frame.f_back if frame is not None else None


def call_as(frame: types.FrameType | None, func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``func(*args, **kwargs)``, run from a function compiled as ``frame``'s line."""
    line = frame.f_lineno if frame is not None else None
    if line is None:
        return func(*args, **(kwargs or {}))
    key = (frame.f_code, line)
    site = _sites.get(key)
    if site is None or site[0] is not frame.f_globals:  # one code run under other globals: rare
        if len(_sites) >= _MAX_SITES:
            _sites.clear()
        code = _CALL.replace(co_filename=frame.f_code.co_filename, co_firstlineno=line, co_name=frame.f_code.co_name)
        site = _sites[key] = (frame.f_globals, types.FunctionType(code, frame.f_globals))
    return site[1](func, args, kwargs or {})


def call_for(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``func(*args, **kwargs)`` for a mode's ``__torch_function__`` (which calls this directly):
    its warnings where they are without the mode."""
    return call_as(caller(func, sys._getframe(2)), func, args, kwargs)
