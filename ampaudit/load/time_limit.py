"""A wall-clock limit on the user's code that ampaudit runs in its own process - the Python API's
``check_path`` and ``load_target``: importing a model file, building its model, its
``example_inputs()``. The command line does not use it: there the model runs in a child process
that the parent kills when ``--import-timeout`` runs out (core/child.py).

A hung import (a ``while True`` in a decorator, a download that never returns) must not hang
``ampaudit check``. The limit is a POSIX interval timer whose handler raises
:class:`TimeLimitExceeded` in the user's code, so the traceback says where it was stopped. It
is a BaseException, as KeyboardInterrupt is, so the user's ``except Exception`` does not swallow
it. Code that swallows it anyway (a bare ``except:`` in a retry loop) is stopped for good a
second later: every line of the user's frames then raises it again, up to ampaudit's own frame.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

DEFAULT_SECONDS = 60.0


MIN_SECONDS, MAX_SECONDS = 0.01, 86_400.0  # below: the timer fires before its handler; above: a day

class TimeLimitExceeded(BaseException):
    """The user's code was still running when the limit ran out."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Run the block under a wall-clock limit of ``seconds`` (None or 0: no limit). Only the
    main thread of a POSIX process can be interrupted; elsewhere the block runs unlimited."""
    if seconds and not (isinstance(seconds, (int, float)) and MIN_SECONDS <= seconds <= MAX_SECONDS):
        raise ValueError(f"import_timeout must be 0 (no limit) or {MIN_SECONDS:g} to {MAX_SECONDS:g} seconds, "
                         f"not {seconds!r}")
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    fired = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:  # the first stop was swallowed: make every line of the user's frames raise
            _trace_user_frames(frame, seconds)
        fired = True
        raise TimeLimitExceeded(seconds)

    tracer = sys.gettrace()  # a debugger's or coverage's: restored if the stop had to trace
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if sys.gettrace() is not tracer:
            sys.settrace(tracer)


_AMPAUDIT = str(Path(__file__).resolve().parent.parent)


def _trace_user_frames(frame: FrameType | None, seconds: float) -> None:
    def again(frame: FrameType, event: str, arg: object) -> object:
        if event == "line":
            raise TimeLimitExceeded(seconds)
        return again

    while frame is not None and not frame.f_code.co_filename.startswith(_AMPAUDIT):
        frame.f_trace = again
        frame = frame.f_back
    sys.settrace(lambda *_: None)  # line events reach f_trace only while tracing is on; new frames stay untraced
