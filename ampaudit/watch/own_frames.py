"""The frames watch puts between a script's code and torch's: what a traceback python prints
at the script's death leaves out under ``ampaudit run``, which prints it as python would.

A wrapper watch puts in torch's place (``torch.autograd.backward`` and ``grad``, a GradScaler's
``step``/``update``, ``nn.Module.compile``) is a frame of its own in every traceback through it:
``loss.backward()`` failing showed ``backward_tap.py`` between torch's frames. The loss probe
(``--probe-loss``) adds more: its ``__torch_function__``, ``warn_frame``'s call made as from the
user's line (a second frame at that line), and - for a torch function written in Python
(``F.softmax``) - that function's frame at its ``handle_torch_function`` call and torch's
``overrides`` frames, before the function runs again from the probe. Only the frames a script
raised through; its own handlers' ``traceback.print_exc()`` still see them (a frame is added as
an exception leaves it, after any code here could run).
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.overrides

# the frames torch puts between a Python function (F.softmax) and a mode: its handle_torch_function
OVERRIDES = torch.overrides.__file__
_passing: set[types.CodeType] = set()  # code of wrappers and of the probe's own call path
_probe_entry: set[types.CodeType] = set()  # the probe's __torch_function__: torch's override frames before it go
_sites: weakref.WeakSet[types.CodeType] = weakref.WeakSet()  # warn_frame's calls made as from a user's line


def passes_through(func: Callable[..., Any], *, mode_entry: bool = False) -> Callable[..., Any]:
    """``func``'s frames are left out of the script's traceback; ``mode_entry``: it is a torch
    function mode's ``__torch_function__``, reached through torch's ``handle_torch_function``."""
    code = getattr(func, "__code__", None)
    if code is not None:
        _passing.add(code)
        if mode_entry:
            _probe_entry.add(code)
    return func


def site(code: types.CodeType) -> types.CodeType:
    """``code`` runs a call as from a user's line (``warn_frame``): left out of tracebacks."""
    _sites.add(code)
    return code


def without_own_frames(exc: BaseException) -> None:
    """``exc``'s traceback, and those of the exceptions chained to it, without watch's frames:
    relinked in place (the script is over; nothing else reads them)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = _strip(exc.__traceback__)
        if exc.__cause__ is not None and id(exc.__cause__) not in seen:
            without_own_frames(exc.__cause__)
        exc = exc.__context__


def _strip(tb: types.TracebackType | None) -> types.TracebackType | None:
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    kept: list[types.TracebackType] = []
    for entry in entries:
        code = entry.tb_frame.f_code
        if code in _probe_entry:  # torch's overrides frames before it, and the function that asked them
            asked = False
            while kept and kept[-1].tb_frame.f_code.co_filename == OVERRIDES:
                kept.pop()
                asked = True
            if asked and kept:
                kept.pop()
        if code in _passing or code in _sites:
            continue
        kept.append(entry)
    for before, after in itertools.pairwise(kept):
        before.tb_next = after
    if kept:
        kept[-1].tb_next = None
    return kept[0] if kept else None
