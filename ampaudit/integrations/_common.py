"""What the integrations share: the one-line error for a framework that is not installed, what
a callback holds (the watch's options and its Monitor), and the step boundary at a trainer's
hook - the one place they reach into Monitor's internals."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch.monitor import Monitor


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
    options, checked when the callback is built; the Monitor of the current (or last) run,
    ``monitor``; and ``close()``, ``summary()``, ``print()``."""

    def __init__(self, *, log: str | Path | None = None, every: int = 1,
                 dtype: LowDtype | torch.dtype | str | None = None, stop_on_nonfinite: bool = False,
                 inputs: bool = False, stop_after_skips: int = 10, eval: bool = False) -> None:
        super().__init__()  # the framework's callback class, next in line
        self.options = {"log": log, "every": every, "dtype": dtype, "stop_on_nonfinite": stop_on_nonfinite,
                        "inputs": inputs, "stop_after_skips": stop_after_skips, "eval": eval}
        Monitor(None, **self.options)  # a bad option fails here, not when training starts; hooks nothing
        self.monitor: Monitor | None = None
        self._running = False

    def _start(self, model: torch.nn.Module) -> None:
        self.close()  # an earlier run that ended without its end hook (an exception)
        self.monitor = Monitor(model, **self.options).start()
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
