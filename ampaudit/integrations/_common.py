"""What the integrations share: the one-line error for a framework that is not installed, what
a callback holds (the watch's options and its Monitor), the guard on the trainer's GradScaler,
and the step boundary at a trainer's hook. They use Monitor's public API only (``start``,
``step(scaler=...)``, ``stop``, ``summary``; ``guard`` is set once the trainer's GradScaler is
known); the one private state read is the GradScaler's per-optimizer stage (``unscale_once``)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch

from ampaudit.watch.monitor import Monitor
from ampaudit.watch.options import WatchOptions, resolve
from ampaudit.watch.step_guard import guard_for


def require(candidates: tuple[str, ...], needs: str) -> ModuleType:
    """The first of ``candidates`` (module names) the program already imported, else the first
    that imports; when none is installed, a one-line ModuleNotFoundError: ``needs``, which names
    the pip command. (A candidate that is installed but fails to import raises its own error.)"""
    for name in candidates:
        if sys.modules.get(name) is not None:
            return sys.modules[name]
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # installed, but something it imports is missing: its own message says what
    raise ModuleNotFoundError(needs, name=candidates[0].split(".")[0])


class WatchingCallback:
    """What the callbacks share (mixed into each framework's callback class): ``ampaudit.watch``'s
    options (a ``WatchOptions``, or its fields as keyword arguments), checked when the callback
    is built; the Monitor of the current (or last) run, ``monitor``; and ``close()``,
    ``summary()``, ``print()``."""

    def __init__(self, options: WatchOptions | None = None, **keywords: Any) -> None:
        super().__init__()  # the framework's callback class, next in line
        self.options = resolve(options, keywords, caller=f"{type(self).__module__}.{type(self).__name__}()")
        # A bad option fails here, not when training starts; hooks nothing. The guard waits for
        # the trainer's GradScaler, known when training starts.
        Monitor(None, options=replace(self.options, guard=False))
        self.monitor: Monitor | None = None
        self._running = False

    def _start(self, model: torch.nn.Module, scaler: torch.amp.GradScaler | None = None,
               optimizer: torch.optim.Optimizer | None = None) -> None:
        """Watch ``model``; ``scaler`` (the trainer's GradScaler) and ``optimizer`` (None: any the
        scaler steps) are what the ``guard`` option guards."""
        self.close()  # an earlier run that ended without its end hook (an exception)
        # The trainer's hook ends each step (end_step): the scaler is given to the guard alone,
        # as a Monitor given a scaler would end steps at its update() too.
        monitor = Monitor(model, options=replace(self.options, guard=False))
        if self.options.guard not in (False, None):
            if scaler is None:
                raise ValueError("guard needs the GradScaler that skips steps, and this trainer runs without one "
                                 "(it has one with fp16 mixed precision)")
            monitor.guard = guard_for(self.options.guard, scaler, optimizer, model)
        self.monitor = monitor.start()
        self._running = True

    def close(self) -> None:
        """Remove the hooks and finish the log (the trainer's end-of-training hook does this)."""
        if self._running:
            self._running = False
            self.monitor.stop()

    def summary(self) -> dict[str, Any]:
        return self._started().summary()

    def print(self, file: Any = None) -> None:
        self._started().print(file)

    def _started(self) -> Monitor:
        if self.monitor is None:
            raise RuntimeError(f"{type(self).__name__}: no training has started yet")
        return self.monitor


# -- the step boundary at a trainer's hook ----------------------------------------------------------
# A trainer that owns its GradScaler ends the step with Monitor.step(scaler=...): after unscale_,
# before the scaler's step and update, so the step's found-inf flags and scale are recorded.
# unscale_once reads the GradScaler's own per-optimizer stage, as torch's GradScaler.step does.


def end_step(monitor: Monitor, scaler: torch.amp.GradScaler | None = None) -> None:
    """A step boundary at a trainer's hook, where this step's gradients are final and unscaled;
    with ``scaler``, this step's skip (its found-inf flags) and scale are recorded too."""
    monitor.step(scaler=scaler)


def unscale_once(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless this step already did it (gradient clipping does):
    the same call ``scaler.step`` would make first, so training does not change."""
    from torch.amp.grad_scaler import OptState

    if not scaler.is_enabled():
        return
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
