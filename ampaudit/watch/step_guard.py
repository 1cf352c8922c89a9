"""Keep the rest of the training state still when a GradScaler skips a step.

A GradScaler that finds inf/NaN gradients skips ``optimizer.step()``, but the loop around it
goes on: the LR scheduler steps (the schedule drifts ahead of the weights), an EMA averages
the unchanged weights once more, and BatchNorm's running statistics already took the bad
batch in the forward. ``StepGuard`` tells, per step, whether the step was applied, and on a
skipped one holds the schedulers and EMAs it was given and puts BatchNorm's buffers back.

It reads the scaler's found-inf flags right after ``scaler.step()``, which has already
synchronised on them: no extra host sync.

A scheduler or EMA is held only when it steps once per optimizer step: one that steps after
several optimizer steps (a per-epoch scheduler, SWA's per-epoch average) ends an epoch whose
other steps were applied, and holding it would hold the epoch's whole update. ``find=True``
(the ``guard=True`` option) finds them itself: every torch LR scheduler of the guarded
optimizer and every ``torch.optim.swa_utils.AveragedModel``, however late the script makes
them; with no scaler given, every GradScaler the script steps (``ampaudit run --guard``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import register_module_forward_pre_hook

from ampaudit.watch.own_frames import passes_through

_EMA_METHODS = ("update_parameters", "update")  # torch's AveragedModel, timm's ModelEmaV2 and most others


class StepGuard:
    """``guard = StepGuard(scaler, optimizer, model=model, schedulers=[sched], emas=[ema])``,
    then ``guard.start()`` (or ``with guard:``). ``step_applied`` is False after a skipped step;
    ``counts`` says how often each kind of state was held. ``find``: also every LR scheduler of
    ``optimizer`` (any optimizer's when None) and every torch ``AveragedModel``; ``scaler`` None:
    every GradScaler."""

    def __init__(self, scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer | None = None, *,
                 model: torch.nn.Module | None = None, schedulers: Iterable[Any] = (),
                 emas: Iterable[Any] = (), find: bool = False) -> None:
        self.scaler, self.optimizer, self.model, self.find = scaler, optimizer, model, find
        self.schedulers, self.emas = list(schedulers), list(emas)
        for ema in self.emas:
            if not any(callable(getattr(ema, m, None)) for m in _EMA_METHODS):
                raise TypeError(f"{type(ema).__name__} has no update_parameters() or update() to hold")
        self.step_applied = True
        self.steps = 0
        self._applied: dict[int, tuple[bool, int]] = {}  # per optimizer: its last step applied, its steps
        self.skipped: list[int] = []
        self.counts = {"scheduler_steps_held": 0, "ema_updates_held": 0, "batchnorm_restores": 0}
        self._undo: list[tuple[object, str]] = []
        self._classes: list[tuple[type, str, Any]] = []
        self._handles: list[Any] = []
        # this step's norm buffers as they were before it, by module: None until its first training forward
        self._bn_saved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # per scheduler or EMA: the guarded optimizer steps there had been when it last stepped
        self._last_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._inside = threading.local()  # a scheduler that steps its children (SequentialLR) is held once

    def __enter__(self) -> StepGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> StepGuard:
        if self._undo or self._classes:
            return self
        if self.scaler is not None:
            self._wrap(self.scaler, "step", self._scaler_step)
        else:  # every GradScaler the script steps
            original = torch.amp.GradScaler.step

            def step(scaler, optimizer, *args, **kwargs):
                result = original(scaler, optimizer, *args, **kwargs)
                self._after_step(scaler, optimizer)
                return result

            self._wrap_class(torch.amp.GradScaler, "step", step)
        for scheduler in self.schedulers:
            self._wrap(scheduler, "step", self._held("scheduler_steps_held", lambda _, s=scheduler: s))
        for ema in self.emas:
            method = next(m for m in _EMA_METHODS if callable(getattr(ema, m, None)))
            self._wrap(ema, method, self._held("ema_updates_held", lambda _, e=ema: e))
        if self.find:
            given = {id(s) for s in self.schedulers}
            for cls in _scheduler_classes():
                self._wrap_class(cls, "step", self._held("scheduler_steps_held", self._found_scheduler(given))(
                    cls.__dict__["step"]))
            from torch.optim.swa_utils import AveragedModel

            given = {id(e) for e in self.emas}
            pick = lambda args: args[0] if id(args[0]) not in given else None  # noqa: E731
            self._wrap_class(AveragedModel, "update_parameters",
                             self._held("ema_updates_held", pick)(AveragedModel.update_parameters))
        if self.model is not None and any(isinstance(m, _NormBase) for m in self.model.modules()):
            self._handles.append(self.model.register_forward_pre_hook(self._snapshot_batchnorm))
        elif self.model is None and self.optimizer is None:
            # ampaudit run --guard names no model: every BatchNorm as it first runs in a step
            self._handles.append(register_module_forward_pre_hook(self._snapshot_one_batchnorm))
        return self

    def stop(self) -> None:
        for target, name in reversed(self._undo):
            del target.__dict__[name]  # the class's method again
        self._undo.clear()
        for cls, name, original in reversed(self._classes):
            setattr(cls, name, original)
        self._classes.clear()
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

    def _wrap_class(self, cls: type, name: str, method: Callable) -> None:
        """``cls.name`` replaced until ``stop``: instances the script makes later are guarded too."""
        self._classes.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, method)

    def _found_scheduler(self, given: set[int]) -> Callable[[tuple], Any]:
        def pick(args: tuple) -> Any:
            scheduler = args[0]
            if id(scheduler) in given:
                return None  # given by name: its own wrapper holds it
            optimizer = getattr(scheduler, "optimizer", None)
            return scheduler if self.optimizer is None or optimizer is self.optimizer else None

        return pick

    def _scaler_step(self, original):
        def step(optimizer, *args, **kwargs):
            result = original(optimizer, *args, **kwargs)
            self._after_step(self.scaler, optimizer)
            return result

        return step

    def _after_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is None or optimizer is self.optimizer:
            state = scaler._per_optimizer_states[id(optimizer)]
            flags = state.get("found_inf_per_device", {}).values()
            # scaler.step() has just read these flags with .item(): no new sync
            self.step_applied = not (scaler.is_enabled() and sum(float(f) for f in flags))
            self._applied[id(optimizer)] = (self.step_applied, self._applied.get(id(optimizer), (True, 0))[1] + 1)
            if not self.step_applied:
                self.skipped.append(self.steps)
                self._restore_batchnorm()
            self.steps += 1
            self._bn_saved = None  # the next forward starts the next step

    def _held(self, counter: str, target: Callable[[tuple], Any]):
        """A wrapper of a scheduler's step or an EMA's update: held when the last step was skipped
        and it is the only optimizer step since the target last stepped (a per-step one)."""
        def wrap(original):
            def call(*args, **kwargs):
                held = target(args)
                if held is None or getattr(self._inside, "on", False):
                    return original(*args, **kwargs)
                if getattr(held, "_step_count", None) == 0:  # a scheduler's first step, in its __init__
                    own = id(getattr(held, "optimizer", None))
                    self._last_seen[held] = self._applied.get(own, (True, self.steps))[1]
                    return original(*args, **kwargs)
                # a scheduler counts its own optimizer's steps (two optimizers, two schedulers)
                own = id(getattr(held, "optimizer", None))
                applied, steps = self._applied.get(own, (self.step_applied, self.steps))
                last = self._last_seen.get(held, 0)
                self._last_seen[held] = steps
                if not applied and steps - last == 1:
                    self.counts[counter] += 1
                    return None
                self._inside.on = True
                try:
                    return original(*args, **kwargs)
                finally:
                    self._inside.on = False
            return passes_through(call)

        return wrap

    def _snapshot_batchnorm(self, module: torch.nn.Module, args: Any) -> None:
        if self._bn_saved is None and torch.is_grad_enabled():  # the step's first training forward
            self._bn_saved = {id(m): _snapshot(m) for m in module.modules() if isinstance(m, _NormBase)}

    def _snapshot_one_batchnorm(self, module: torch.nn.Module, args: Any) -> None:
        """A global hook's: one norm module's buffers, before its first training forward of the step."""
        if not isinstance(module, _NormBase) or not torch.is_grad_enabled():
            return
        if self._bn_saved is None:
            self._bn_saved = {}
        if id(module) not in self._bn_saved:
            self._bn_saved[id(module)] = _snapshot(module)

    def _restore_batchnorm(self) -> None:
        if self._bn_saved:
            with torch.no_grad():
                for buffer, saved in (pair for pairs in self._bn_saved.values() for pair in pairs):
                    buffer.copy_(saved)
            self.counts["batchnorm_restores"] += 1


def _snapshot(norm: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A norm module's own buffers (running statistics, batch count) and a copy of each."""
    return [(b, b.detach().clone()) for b in norm.buffers(recurse=False)]


def _scheduler_classes() -> list[type]:
    """torch's LR scheduler classes that define their own ``step`` (subclasses of those that do
    not inherit the wrapped one), ReduceLROnPlateau included."""
    from torch.optim import lr_scheduler

    found, stack = [], [lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau]
    while stack:
        cls = stack.pop()
        if cls not in found:
            if "step" in cls.__dict__:
                found.append(cls)
            stack.extend(cls.__subclasses__())
    return found


def guard_for(guard: bool | Sequence[Any] | None, scaler: torch.amp.GradScaler | None,
              optimizer: torch.optim.Optimizer | None, model: torch.nn.Module | None) -> StepGuard | None:
    """The watch option ``guard``: None, or a StepGuard for the watched scaler, holding the given
    schedulers (objects with ``step`` and ``get_last_lr``) and EMAs (the others); True: those it
    finds (the optimizer's LR schedulers, torch's AveragedModel)."""
    if guard is False or guard is None:
        return None
    if scaler is None and (model is not None or optimizer is not None):
        raise ValueError("guard needs the GradScaler that skips steps: watch(..., scaler=scaler, guard=True)")
    # no model, optimizer or scaler named (ampaudit run --guard): every GradScaler the script steps
    held = [] if guard is True else list(guard)
    schedulers = [h for h in held if callable(getattr(h, "step", None)) and hasattr(h, "get_last_lr")]
    emas = [h for h in held if not any(h is s for s in schedulers)]
    return StepGuard(scaler, optimizer, model=model, schedulers=schedulers, emas=emas, find=guard is True)
