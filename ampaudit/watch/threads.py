"""Watch in a process where several threads train (Hogwild-style threads, a training thread
beside an evaluation thread, ``nn.DataParallel``'s replicas).

A step's rows, events and module calls are one thread's story: the forward, its backward and
the optimizer step that ends it. Interleaving another thread's modules into them would mix two
steps (and race on the arena). So a watch follows one thread - the first that runs a module
forward with grad enabled, or that steps an optimizer - for as long as it lives; when it has
ended, the next thread that trains takes over. Other threads train untouched: their module
forwards record nothing (their float outputs are counted, as ``unmeasured["other-thread"]``)
and their optimizer steps end no step. Gradient hooks are not checked here: they were put on
the followed thread's tensors, and on CUDA autograd runs them on its own device thread.
"""

from __future__ import annotations

import threading


class FollowedThread:
    """Which thread a watch records. ``here()`` is the hot path: one identity check."""

    def __init__(self) -> None:
        self.ident: int | None = None  # the followed thread's id: the hot paths compare it alone
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def here(self, claim: bool = True) -> bool:
        """Whether the calling thread is the followed one; with ``claim``, it becomes the
        followed one when there is none (or that one has ended). An id of an ended thread that
        a new thread reuses makes that one followed: what a claim would do anyway."""
        if threading.get_ident() == self.ident:
            return True
        followed = self._thread
        if not claim:
            return followed is None or not followed.is_alive()
        with self._lock:
            followed, current = self._thread, threading.current_thread()
            if followed is None or followed is current or not followed.is_alive():
                self._thread, self.ident = current, current.ident
                return True
        return False

    def __deepcopy__(self, memo: dict) -> FollowedThread:
        # a model deep-copied while watched (AveragedModel, an EMA copy) copies its hooks and,
        # through them, the recorder: that copy follows no thread yet (a lock cannot be copied)
        return FollowedThread()

    @property
    def lock(self) -> threading.Lock:
        """For what other threads count (a Counter's += is no atomic update)."""
        return self._lock
