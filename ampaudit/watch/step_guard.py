"""Keep the rest of the training state still when a GradScaler skips a step.

A GradScaler that finds inf/NaN gradients skips ``optimizer.step()``, but the loop around it
goes on: the LR scheduler steps (the schedule drifts ahead of the weights), an EMA averages
the unchanged weights once more, and BatchNorm's running statistics already took the bad
batch in the forward. ``StepGuard`` tells, per step, whether the step was applied, and on a
skipped one holds the schedulers and EMAs it was given and puts BatchNorm's buffers back.

It reads the scaler's found-inf flags right after ``scaler.step()``, which has already
synchronised on them: no extra host sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase

_EMA_METHODS = ("update_parameters", "update")  # torch's AveragedModel, timm's ModelEmaV2 and most others


class StepGuard:
    """``guard = StepGuard(scaler, optimizer, model=model, schedulers=[sched], emas=[ema])``,
    then ``guard.start()`` (or ``with guard:``). ``step_applied`` is False after a skipped step;
    ``counts`` says how often each kind of state was held."""

    def __init__(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer | None = None, *,
                 model: torch.nn.Module | None = None, schedulers: Iterable[Any] = (),
                 emas: Iterable[Any] = ()) -> None:
        self.scaler, self.optimizer, self.model = scaler, optimizer, model
        self.schedulers, self.emas = list(schedulers), list(emas)
        for ema in self.emas:
            if not any(callable(getattr(ema, m, None)) for m in _EMA_METHODS):
                raise TypeError(f"{type(ema).__name__} has no update_parameters() or update() to hold")
        self.step_applied = True
        self.steps = 0
        self.skipped: list[int] = []
        self.counts = {"scheduler_steps_held": 0, "ema_updates_held": 0, "batchnorm_restores": 0}
        self._undo: list[tuple[object, str]] = []
        self._handles: list[Any] = []
        self._bn_saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __enter__(self) -> StepGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> StepGuard:
        if self._undo:
            return self
        self._wrap(self.scaler, "step", self._scaler_step)
        for scheduler in self.schedulers:
            self._wrap(scheduler, "step", self._held("scheduler_steps_held"))
        for ema in self.emas:
            method = next(m for m in _EMA_METHODS if callable(getattr(ema, m, None)))
            self._wrap(ema, method, self._held("ema_updates_held"))
        if self.model is not None and any(isinstance(m, _NormBase) for m in self.model.modules()):
            self._handles.append(self.model.register_forward_pre_hook(self._snapshot_batchnorm))
        return self

    def stop(self) -> None:
        for target, name in reversed(self._undo):
            del target.__dict__[name]  # the class's method again
        self._undo.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "skipped_steps": list(self.skipped), **self.counts}

    def _wrap(self, target: object, name: str, make) -> None:
        if name in target.__dict__:
            raise ValueError(f"{type(target).__name__}.{name} is already wrapped on this object")
        setattr(target, name, make(getattr(target, name)))
        self._undo.append((target, name))

    def _scaler_step(self, original):
        def step(optimizer, *args, **kwargs):
            result = original(optimizer, *args, **kwargs)
            if self.optimizer is None or optimizer is self.optimizer:
                state = self.scaler._per_optimizer_states[id(optimizer)]
                flags = state.get("found_inf_per_device", {}).values()
                # scaler.step() has just read these flags with .item(): no new sync
                self.step_applied = not (self.scaler.is_enabled() and sum(float(f) for f in flags))
                if not self.step_applied:
                    self.skipped.append(self.steps)
                    self._restore_batchnorm()
                self.steps += 1
                self._bn_saved = None  # the next forward starts the next step
            return result

        return step

    def _held(self, counter: str):
        def wrap(original):
            def call(*args, **kwargs):
                if not self.step_applied:
                    self.counts[counter] += 1
                    return None
                return original(*args, **kwargs)

            return call

        return wrap

    def _snapshot_batchnorm(self, module: torch.nn.Module, args: Any) -> None:
        if self._bn_saved is None and torch.is_grad_enabled():  # the step's first training forward
            self._bn_saved = [(b, b.detach().clone()) for m in module.modules() if isinstance(m, _NormBase)
                              for b in m.buffers()]

    def _restore_batchnorm(self) -> None:
        if self._bn_saved:
            with torch.no_grad():
                for buffer, saved in self._bn_saved:
                    buffer.copy_(saved)
            self.counts["batchnorm_restores"] += 1


def guard_for(guard: bool | Sequence[Any] | None, scaler: torch.amp.GradScaler | None,
              optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None) -> StepGuard | None:
    """The watch option ``guard``: None, or a StepGuard for the watched scaler, holding the given
    schedulers (objects with ``step`` and ``get_last_lr``) and EMAs (the others)."""
    if guard is False or guard is None:
        return None
    if scaler is None:
        raise ValueError("guard needs the GradScaler that skips steps: watch(..., scaler=scaler, guard=True)")
    held = [] if guard is True else list(guard)
    schedulers = [h for h in held if callable(getattr(h, "step", None)) and hasattr(h, "get_last_lr")]
    emas = [h for h in held if not any(h is s for s in schedulers)]
    return StepGuard(scaler, optimizer, model=model, schedulers=schedulers, emas=emas)
