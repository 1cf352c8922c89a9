"""A script under ``ampaudit run`` recurses as deep as under ``python``: run's own frames (the
CLI, the runner, and whatever called them - pytest, in the tests) sit below the script's module
frame and would take a dozen of its recursion limit. While the script runs, the limit is raised
by those frames, and ``sys.getrecursionlimit`` / ``sys.setrecursionlimit`` read and set it as
the script would see it under python (a script that prints or sets its limit sees its own
numbers). Other threads, which start without those frames, get that many frames more.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def as_python(extra: int) -> Iterator[None]:
    """``extra`` frames more in the recursion limit, and the sys functions that read and set it
    seeing it without them, until the block ends."""
    get, set_ = sys.getrecursionlimit, sys.setrecursionlimit

    def getrecursionlimit() -> int:
        return get() - extra

    def setrecursionlimit(limit: int) -> None:
        limit = operator.index(limit)  # python's TypeError for a float, a str
        if limit < 1:
            raise ValueError("recursion limit must be greater or equal than 1")
        set_(limit + extra)

    getrecursionlimit.__doc__, setrecursionlimit.__doc__ = get.__doc__, set_.__doc__
    before = get()
    set_(before + extra)
    sys.getrecursionlimit, sys.setrecursionlimit = getrecursionlimit, setrecursionlimit
    try:
        yield
    finally:  # run's own limit again: the script may have left one too low for run's frames
        sys.getrecursionlimit, sys.setrecursionlimit = get, set_
        set_(before)


_PROBE = compile("room = _room()", "<ampaudit: the script's stack>", "exec")


def _room(n: int = 0) -> int:
    """How many calls deep a call from the caller can go before RecursionError."""
    try:
        return _room(n + 1)
    except RecursionError:
        return n


def frames_below() -> int:
    """The recursion depth a script's module frame that the caller runs (``exec``) would start
    at, less python's: there the module frame is the first, and a call from it goes the limit
    less two deep. Measured - a probe run where the script will be - rather than counted from
    the frames, as C calls (a type's call, pytest's plugins) take some of the depth too."""
    space = {"_room": _room}
    exec(_PROBE, space)
    return sys.getrecursionlimit() - 3 - space["room"]  # the probe runs a frame above the caller
