"""Watch in a process that forks (Hogwild-style training, ``multiprocessing`` fork pools,
DataLoader workers).

Two rules keep a forking trainer running as it would without watch:

- In the parent, watch's own CPU reductions at a step's end (small ``index_add_`` and
  ``scatter_reduce_`` over the step's rows) run on one thread (while no other Python thread
  is alive: the thread count is the process's, and other threads' ops would change). torch runs some of them on its
  OpenMP pool whatever their size, and GNU OpenMP is not fork-safe once its pool has started:
  a forked child's next parallel op would wait forever on the parent's threads. The pool then
  starts only where the user's own ops start it - as it would without watch.
- In a forked child, every monitor that was running stops, silently: hooks, taps and guard
  removed, the log left to the parent (its handle dropped unwritten), no summary. The child
  trains as it would without watch; the parent counts the fork (``Monitor.forks``) and says
  that what forked processes ran was not watched.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch


class _Forkable(Protocol):
    def forked_here(self) -> None: ...  # in the child, right after the fork

    def forked_away(self) -> None: ...  # in the parent, right after the fork


_running: weakref.WeakSet[_Forkable] = weakref.WeakSet()
_registered = False


def track(monitor: _Forkable) -> None:
    """Tell ``monitor`` about every fork from now on (until ``untrack``)."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_in_child, after_in_parent=_after_in_parent)
        _registered = True
    _running.add(monitor)


def untrack(monitor: _Forkable) -> None:
    _running.discard(monitor)


def _after_in_child() -> None:
    monitors = list(_running)
    _running.clear()  # a fork of the child forks an unwatched process: nothing to tell
    for monitor in monitors:
        monitor.forked_here()


def _after_in_parent() -> None:
    for monitor in list(_running):
        monitor.forked_away()


@contextlib.contextmanager
def single_threaded(device: torch.device) -> Iterator[None]:
    """Run watch's own ops on ``device`` without starting torch's CPU thread pool - unless
    other Python threads are alive: torch's thread count is the whole process's, and setting it
    under a thread that is training changes how its ops split their work, and so their last
    bits (four Hogwild threads' losses differed in the 6th digit). Those ops then start the
    pool themselves, as they would without watch."""
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    if threads == 1 or threading.active_count() > 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
