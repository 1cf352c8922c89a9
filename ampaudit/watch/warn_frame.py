"""A torch call a torch function mode makes for the user, whose warnings name the user's line.

A mode's ``__torch_function__`` is a Python frame between the user's call and torch's code:
Python's ``warnings`` takes the innermost Python frame for a warning torch raises in C++
(``torch.tensor(t)``: "To copy construct from a tensor..."), and counts the mode's frame in a
Python warning's ``stacklevel`` (``F.softmax(x)``'s "Implicit dimension choice"). Either named
the mode's file and line, and filed the warning in the mode's module - its "once per line"
registry and its ``module=`` filters, not the user's. Here the call runs through a one-line
function compiled as the caller's line - its file, line, columns, function name and module
globals -, so every warning lands where it lands without the mode: the same file, line, module and
registry. An exception's traceback shows that line, and the call marked in it, once more, as a
frame of the user's function.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ampaudit.watch.own_frames import OVERRIDES, passes_through, site

_CALL = "f(*a, **k)"
_MAX_SITES = 4096  # call sites compiled at most, then compiled again as they come
_sites: dict[tuple[types.CodeType, int], tuple[dict, types.FunctionType]] = {}


def _caller(func: Any, above: types.FrameType | None) -> types.FrameType | None:
    """The frame whose warnings a torch function in Python (``F.softmax``) makes without the
    mode, from ``above``, the first frame above torch's overrides (``handle_torch_function``,
    which asked for the mode): the frame that called the function."""
    # the function's own frame - or, under a decorator that dispatches (``boolean_dispatch``:
    # F.max_pool2d), a frame of what it called - within a few frames of handle_torch_function
    code, probe, frame = getattr(func, "__code__", None), above, above
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
    key = (frame.f_code, frame.f_lasti)
    site = _sites.get(key)
    if site is None or site[0] is not frame.f_globals:  # one code run under other globals: rare
        if len(_sites) >= _MAX_SITES:
            _sites.clear()
        site = _sites[key] = (frame.f_globals, types.FunctionType(_site_code(frame, line), frame.f_globals))
    return site[1](func, args, kwargs or {})


def _site_code(frame: types.FrameType, line: int) -> types.CodeType:
    """A ``lambda f, a, k: f(*a, **k)`` whose call is at ``frame``'s file and line - and, where
    Python keeps columns (3.11+), at its call's columns: a traceback through it marks the user's
    expression, not the lambda's."""
    columns = _columns(frame, line)
    if columns is None or line < 2:
        source = f"lambda f, a, k: {_CALL}"
        first = line
    else:  # the call on the second line, from the user's column, padded to end where the user's does
        start, end = columns
        source = f"lambda f, a, k: (\n{' ' * start}{_CALL[:-1]}{' ' * max(0, end - start - len(_CALL))}))"
        first = line - 1
    code = compile(source, frame.f_code.co_filename, "eval").co_consts[0]
    return site(code.replace(co_firstlineno=first, co_name=frame.f_code.co_name))


def _columns(frame: types.FrameType, line: int) -> tuple[int, int] | None:
    """The columns of the expression ``frame`` is running, where it is on one line."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None or frame.f_lasti < 0:
        return None
    found = next(iter(list(positions())[frame.f_lasti // 2:]), None)
    if found is None or found[0] != line or found[1] != line or found[2] is None or found[3] is None:
        return None
    return found[2], found[3]


def call_for(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """``func(*args, **kwargs)`` for a mode's ``__torch_function__`` (which calls this directly):
    its warnings where they are without the mode. A torch function in Python that asked for the
    mode is handed what its module's name holds now - a wrapper the script (or watch:
    ``backward_tap``) put there, which called it: the function that asked is called, from the
    wrapper's line, else the wrapper ran twice (a script counting its ``autograd.grad`` calls
    counted two)."""
    frame = sys._getframe(2)
    if frame is None or frame.f_code.co_filename != OVERRIDES:  # a torch function in C: its caller's line
        return call_as(frame, func, args, kwargs)
    above = frame
    while above is not None and above.f_code.co_filename == OVERRIDES:
        above = above.f_back
    asked = _asked(func, above)
    if asked is not None:
        return call_as(asked[1], asked[0], args, kwargs)
    return call_as(_caller(func, above), func, args, kwargs)


def _asked(func: Any, above: types.FrameType | None) -> tuple[Any, types.FrameType | None] | None:
    """Where ``func`` wraps (``__wrapped__``, as ``functools.wraps`` sets it) the torch function
    whose frame - ``above``, the first above torch's overrides - called ``handle_torch_function``:
    that function and its caller's frame; None otherwise."""
    if above is None or getattr(func, "__code__", None) is above.f_code:
        return None
    inner = getattr(func, "__wrapped__", None)
    for _ in range(8):  # a chain of wrappers, bounded: a __wrapped__ cycle ends too
        if inner is None:
            return None
        if getattr(inner, "__code__", None) is above.f_code:
            return inner, above.f_back
        inner = getattr(inner, "__wrapped__", None)
    return None


# a traceback python prints at the script's death leaves the call's own frames out (``own_frames``)
passes_through(call_as)
passes_through(call_for)
