"""A wall-clock limit on the user's code that ampaudit runs: importing a model file, building
its model, its ``example_inputs()``.

A hung import (a ``while True`` in a decorator, a download that never returns) must not hang
``ampaudit check``. The limit is a POSIX interval timer whose handler raises
:class:`TimeLimitExceeded` in the user's code, so the traceback says where it was stopped. It
is a BaseException, as KeyboardInterrupt is, so the user's ``except Exception`` does not swallow
it, and it is raised again every second if a bare ``except:`` does.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

DEFAULT_SECONDS = 60.0


class TimeLimitExceeded(BaseException):
    """The user's code was still running when the limit ran out."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Run the block under a wall-clock limit of ``seconds`` (None or 0: no limit). Only the
    main thread of a POSIX process can be interrupted; elsewhere the block runs unlimited."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
