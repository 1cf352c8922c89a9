"""Where a watched step ends: the optimizer's step hooks, and the GradScaler tap.

A step ends at ``optimizer.step()`` (before it: the step reads this step's gradients), or
when its closure returns, before the update, when the step takes one (LBFGS, Lightning's
automatic optimization: the closure runs the forward and backward inside ``step()``; each
call of LBFGS's is a step), or - with a GradScaler - at
``scaler.update()``, so that a skipped step still counts. Each tap calls ``on_boundary``
(with the scaler, when one ends the step) and knows how to come off again.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as optimizer_hooks

from ampaudit.watch.own_frames import passes_through

Boundary = Callable[..., None]  # on_boundary(scaler=None)
Here = Callable[[], bool]  # whether the calling thread is the one the watch follows (watch/threads.py)


def _anywhere() -> bool:
    return True


_HOOKED_STEP = optimizer_hooks.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _nested_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this step() of ``optimizer`` runs inside another of its own: a subclass whose
    step calls ``super().step()`` has both methods wrapped with the hooks by torch (once the
    parent class has had an instance of its own), so each step would end twice."""
    frame, outer = sys._getframe(2), 0
    while frame is not None:
        if frame.f_code is _HOOKED_STEP and frame.f_locals.get("self") is optimizer:
            outer += 1
            if outer > 1:
                return True
        frame = frame.f_back
    return False


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that steps: a wrapper's (Accelerate's AcceleratedOptimizer) inner one."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (got {type(optimizer).__name__})")
    return optimizer


class OptimizerTap:
    """Step boundaries from one optimizer's step hooks, or (``optimizer=None``, ``ampaudit
    run``) from every optimizer that steps; ``optimizers`` are those whose parameters'
    gradients the step records when no model names them."""

    def __init__(self, on_boundary: Boundary, optimizer: torch.optim.Optimizer | None,
                 here: Here = _anywhere) -> None:
        self.on_boundary, self.here = on_boundary, here  # another thread's steps end no step of ours
        optimizer = unwrap_optimizer(optimizer)
        self._given: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
        # global mode: the optimizer that stepped last, held weakly - a script that drops its model
        # and optimizer (the next trial of a sweep) frees their memory before its next step
        self._stepped: weakref.ref | None = None
        self.in_scaler_step = False  # global mode: optimizer.step() called by a GradScaler
        self._handles: list[Any] = []

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer given, or (global mode) the one that stepped last, while it lives."""
        if self._stepped is None:
            return self._given
        optimizer = self._stepped()
        return [optimizer] if optimizer is not None else []

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Global mode: ``optimizer`` is stepping now (its own step, or a GradScaler's)."""
        self._stepped = weakref.ref(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        optimizer = unwrap_optimizer(optimizer)
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._step_pre_hook))
            self._handles.append(optimizer.register_step_post_hook(self._step_post_hook))
        else:
            self._handles.append(optimizer_hooks.register_optimizer_step_pre_hook(self._global_step_hook))
            self._handles.append(optimizer_hooks.register_optimizer_step_post_hook(self._step_post_hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _global_step_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self.in_scaler_step or not self.here():
            return None  # a GradScaler drives this step (its update() is the boundary), or another thread's
        self.stepped(optimizer)
        return self._step_pre_hook(optimizer, args, kwargs)

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """The step boundary is before optimizer.step(), which reads this step's gradients -
        unless the step takes a closure: the closure runs this step's forward and backward
        inside step(), so the boundary is when the closure returns, before the update (a blame
        replays the step's modules: with the updated weights it would replay another step).
        Returns step()'s arguments with the closure wrapped, as torch's pre-hooks may."""
        if not self.here() or _nested_step(optimizer):
            return None
        # torch passes step()'s own args, the optimizer first: a closure is any callable after it
        at = next((i for i, a in enumerate(args) if a is not optimizer and callable(a)), None)
        if at is None and not callable(kwargs.get("closure")):
            self.on_boundary()
            return None
        pending = _ClosureStep()
        if at is not None:
            return (*args[:at], pending.wrap(args[at], self.on_boundary), *args[at + 1:]), kwargs
        return args, {**kwargs, "closure": pending.wrap(kwargs["closure"], self.on_boundary)}

    def _step_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # torch hands post-hooks the arguments the pre-hooks returned: this step's wrapped closure,
        # if any (a step that raised never gets here, and leaves nothing behind)
        steps = (getattr(a, "ampaudit_step", None) for a in (*args, kwargs.get("closure")))
        pending = next((step for step in steps if isinstance(step, _ClosureStep)), None)
        if pending is not None and not pending.ended and self.here() and not _nested_step(optimizer):
            self.on_boundary()  # the optimizer never called its closure: the step ends here


class _ClosureStep:
    """One optimizer.step(closure) in progress: each time its closure returns, a watched step
    ends - before the update, so a blame replays with the weights that call used. A closure
    called again within one step() (LBFGS's further iterations and line search: each at new
    weights) is a watched step of its own."""

    def __init__(self) -> None:
        self.ended = False

    def wrap(self, closure: Callable[..., Any], on_boundary: Boundary) -> Callable[..., Any]:
        def closure_then_boundary(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            self.ended = True
            on_boundary()
            return result

        closure_then_boundary.ampaudit_step = self  # for the post-hook: which step it was
        return closure_then_boundary


class ScalerTap:
    """A GradScaler's ``update()`` as the step boundary: one scaler's (an instance attribute
    wrapping its update), or - ``attach_all``, for ``ampaudit run`` - every GradScaler's (a
    patch of the class, whose ``step()`` also tells ``optimizers`` which optimizer it steps).

    Two watches may tap one scaler: the second wraps the first's wrapper, and each one's
    ``detach`` unwraps only its own - in either order (a watch detached under a later one's
    wrapper just passes through until that one comes off too)."""

    def __init__(self, on_boundary: Boundary, here: Here = _anywhere) -> None:
        self.on_boundary, self.here = on_boundary, here
        self.active = False
        self._original: tuple[Any, tuple] | None = None  # (scaler or class, what to put back)

    def attach(self, scaler: torch.amp.GradScaler) -> None:
        original = scaler.update
        tap = self

        def update(new_scale: Any = None) -> None:
            if tap.active and tap.here():  # a tap detached under a later one's wrapper passes through
                tap.on_boundary(scaler=scaler)
            original(new_scale)

        passes_through(update)
        update.ampaudit_wraps = (tap, original)  # for unwrapping past detached taps
        scaler.update = update  # instance attribute: unwrapped in detach()
        self._original = (scaler, (update, original))
        self.active = True

    def attach_all(self, optimizers: OptimizerTap) -> None:
        cls = torch.amp.GradScaler
        original_update, original_step = cls.update, cls.step
        tap = self

        def step(self_scaler, optimizer, *args, **kwargs):
            # another thread's scaler step; or a disabled scaler's, which is the optimizer's own
            # step: its hook ends the step before the update (update() comes after it)
            if not tap.here() or not self_scaler.is_enabled():
                return original_step(self_scaler, optimizer, *args, **kwargs)
            optimizers.stepped(optimizer)
            optimizers.in_scaler_step = True
            try:
                return original_step(self_scaler, optimizer, *args, **kwargs)
            finally:
                optimizers.in_scaler_step = False

        def update(self_scaler, new_scale=None):
            if tap.here() and self_scaler.is_enabled():
                tap.on_boundary(scaler=self_scaler)
            return original_update(self_scaler, new_scale)

        cls.update, cls.step = passes_through(update), passes_through(step)
        self._original = (cls, (original_update, original_step))
        self.active = True

    def detach(self) -> None:
        self.active = False
        if self._original is None:
            return
        target, original = self._original
        if isinstance(target, type):
            target.update, target.step = original
        elif target.__dict__.get("update") is original[0]:  # ours is on top: put back what it wrapped
            wrapped = original[1]
            while hasattr(wrapped, "ampaudit_wraps") and not wrapped.ampaudit_wraps[0].active:
                wrapped = wrapped.ampaudit_wraps[1]  # a tap detached out of order: drop its wrapper too
            if getattr(wrapped, "__func__", None) is type(target).update:
                del target.update  # the class's own method again
            else:
                target.update = wrapped  # an earlier tap's wrapper
        self._original = None

    @staticmethod
    def read(scaler: torch.amp.GradScaler) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scale this step used and how many found-inf flags its optimizers raised (device
        tensors, no sync); (None, None) for a disabled scaler."""
        if not scaler.is_enabled():
            return None, None
        flags = [v for state in scaler._per_optimizer_states.values()
                 for v in state.get("found_inf_per_device", {}).values()]
        return scaler._scale, torch.stack([f.float().sum() for f in flags]).sum() if flags else None
