"""The loss code, which no module hook sees: where a NaN made between the model's forward and its
backward was born.

A training loop computes its loss from the model's output in plain torch calls -
``-(y * torch.log(p)).mean()``, ``loss.sum() / mask.sum()`` - outside every module, so a NaN
they make is seen only in the loss itself (``backward_tap``: the loss event) or as a bad gradient
of the model's output, and the blame can say no more than "the loss" or "from the loss". Once a
step has said that (``loss_notes.from_the_loss``), the probe is armed for the next recorded steps
(``ARMED_STEPS``): a torch function mode that keeps each torch call the loop makes outside the
model - from the step's start to its backward, less the model's forward (under ``ampaudit run``,
that of any module called outside all others): the loss code before the model call too, as
EDM2's loss weights its noise levels - with the user's line and the tensors it read and made,
references freed at the step's end - the latest calls, at most ``MAX_CALLS`` of them holding at
most ``probe_loss_mb`` of what the loss code made (``probe_budget``).
At the step boundary, only when that step's NaN again came from the loss, the calls are
judged in order as a forward replay judges aten ops (``provenance.FirstBadOp``): the first that
made NaN/+inf out of finite values, or -inf by arithmetic (a log of 0), is named with its line.
Where every value was finite and only the gradient into the model was not (a ``sqrt`` at 0),
the calls are run again and backward from the loss (``loss_replay``).

Why only after such a step, and not on every step: a mode on the stack changes what
``torch.compile`` traces and costs each call of the loop some Python. A healthy run never arms it;
a run whose loss goes bad again and again (a GradScaler skipping steps: the weights stay finite,
the same loss code makes the same NaN) is named at the next recorded step. A run whose weights
went NaN after the first bad step (no GradScaler: fp32 and bf16 runs) blames the weights from
then on: there the probe can only be on from the first step (``watch(probe_loss=True)``,
``ampaudit run --probe-loss``), at that cost on every step.

The mode steps off the stack while any module of parameters runs (its hooks see that code; a compiled model
is traced without it; torch's modules take their fused inference paths only with no mode on)
and back on when the module returns, and at the step's end.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from threading import get_ident
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from ampaudit.core.userframe import user_location
from ampaudit.watch.loss_replay import Kept, op_name, replay_backward
from ampaudit.watch.options import PROBE_LOSS_MB
from ampaudit.watch.own_frames import passes_through
from ampaudit.watch.probe_budget import MB, ByteBudget
from ampaudit.watch.provenance import FirstBadOp, Origin, autocast_state
from ampaudit.watch.warn_frame import call_for

ARMED_STEPS = 3  # recorded steps a probe stays armed for when it finds nothing
# a step's calls kept at most, the latest: a loop that evaluates between forward and backward, or
# a script's setup before its first step under ``probe_loss``; and the bytes of what they made that
# they hold (``probe_budget``), at most ``probe_loss_mb`` (WatchOptions)
MAX_CALLS = 512
_ACCESS = ("__get__", "__set__", "__delete__")
# calls that compute nothing and give the user's code a way into the backward: a replay of
# ``d.register_hook(log)`` ran the user's hook again in the replay's backward
_HOOKS = ("register_hook", "register_post_accumulate_grad_hook", "retain_grad")


def _computes(name: str) -> bool:
    """Whether a call of this name is the loop's computation: not an attribute read or written
    (``p.grad``, ``x.data``), nor torch's own machinery (``_set_grad_enabled``, the profiler's
    ``_record_function_enter_new``: the optimizer's step code after the boundary), nor a hook
    registered on a tensor, which a replay must not run again."""
    return name not in _ACCESS and name not in _HOOKS and not (name.startswith("_") and not name.startswith("__"))


def _a_network(module: Any) -> bool:
    """Whether a module is a network - the model, a perceptual loss's frozen one - and not a
    criterion: whether it or a module under it has a parameter."""
    return next(module.parameters(), None) is not None


class LossProbe(TorchFunctionMode):
    """The torch calls of one step's loss code (``recording``: between a model's return and the
    backward), to judge at the step's end."""

    def __init__(self, budget_mb: int = PROBE_LOSS_MB) -> None:
        super().__init__()
        self.recording = False
        self.on_stack = False
        # the step's backward roots, the losses (``backward_origin``): one per micro-batch under
        # gradient accumulation, the discriminator's and the generator's in a GAN
        self.roots: list[torch.Tensor] = []
        self.calls: deque[Kept] = deque()
        self.budget = ByteBudget(budget_mb * MB)
        self._counted: deque[tuple] = deque()  # per kept call, the storages the budget counted for it
        self.dropped = 0  # calls of this step dropped, the oldest first, for the count or the bytes
        self._aside: Any = None  # global module hooks: off the stack while a module runs, back after
        self._aside_for: Any = None  # the module it stepped aside for (and thread), whether it was recording
        self._was_recording = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # compiling: dynamo traces the mode's code - the call alone; paused (the backward and the
        # optimizer's unscaling run before the step's end takes it off the stack: inside this method
        # it cannot): the call, recorded by no one
        if torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        recording = self.recording
        # run as from the caller's line: a warning torch raises names the user's line, not this one
        # (``warn_frame``)
        out = call_for(func, args, kwargs)
        if not recording:
            return out
        # the call paused it (``loss.backward()``: the backward is no loss code, and a replay of it
        # would run it); one that computes nothing; torch's own machinery
        if self.recording and torch.is_grad_enabled() and _computes(getattr(func, "__name__", "")):
            self._keep((func, user_location(sys._getframe(1)), args, kwargs, out, autocast_state()))
        return out

    passes_through(__torch_function__, mode_entry=True)  # not in the script's traceback (``own_frames``)

    def _keep(self, call: Kept) -> None:
        """``call`` kept, and the oldest dropped while over the count or the bytes."""
        self.calls.append(call)
        self._counted.append(self.budget.add((call[2], call[3]), call[4]))
        while self.calls and (len(self.calls) > MAX_CALLS or self.budget.over()):
            self.calls.popleft()
            self.budget.drop(self._counted.popleft())
            self.dropped += 1

    def __deepcopy__(self, memo: dict) -> None:
        # a deep copy of the watched model (an EMA made mid-step) copies the recorder: the calls
        # hold tensors with autograd history, which refuse to be copied; the copy has no probe
        return None

    # -- on the training thread only: a mode stack is per thread ------------------------------
    def start(self) -> None:
        """A step begins, or the model returned: record what the loop does next - only from an
        empty mode stack. A mode the loop entered before (``with torch.device(...)`` around the
        whole loop) would be below this one, and its ``__exit__`` pops whatever is on top: it
        would take the probe off and stay on itself, its device the default after the block."""
        if not self.on_stack:
            if torch._C._len_torch_function_stack():
                return
            self.__enter__()
            self.on_stack = True
            self._aside_for = None
        if self._aside is None:
            self._aside = (register_module_forward_pre_hook(self._step_aside),
                           register_module_forward_hook(self._step_back, always_call=True))
        self.recording = True

    def _step_aside(self, module: Any, args: Any) -> None:
        """A module's forward starts (any module, called from anywhere: an eval pass between
        steps too): off the stack while it runs - a module is never the loss code, and torch's
        modules change what they compute when any mode is on (``nn.MultiheadAttention``'s and
        ``nn.TransformerEncoder``'s fused inference paths, whose padded positions are 0, are taken
        only with none). Only where it is on top: on another thread, or below a mode the loop
        pushed (which keeps those paths off itself), it stays. A module of no parameters is the
        loss code: a criterion (``nn.CrossEntropyLoss()``, a user's ``RMSELoss`` module) records
        its calls as the loop's own."""
        if torch.compiler.is_compiling():  # traced into a compiled graph: nothing to step off (nor get_ident to trace)
            return
        if self.on_stack and self._aside_for is None and self._on_top() and _a_network(module):
            self._aside_for, self._was_recording = (module, get_ident()), self.recording
            self.recording = False
            self._pop()

    def _step_back(self, module: Any, args: Any, output: Any) -> None:
        """That module returned: back on the stack as it was - the loss code goes on after a
        module of its own (a perceptual loss's frozen network, which no watch hook restarts it
        after). The watch's own hooks restart it after the watched model's forward."""
        aside = self._aside_for  # on this thread: another's call of the same module (Hogwild) is its own
        if aside is not None and not torch.compiler.is_compiling() and aside[0] is module and aside[1] == get_ident():
            self._aside_for = None
            if self._was_recording:
                self.start()

    def _on_top(self) -> bool:
        depth = torch._C._len_torch_function_stack()
        return bool(depth) and torch._C._get_function_stack_at(depth - 1) is self

    def pause(self) -> None:
        """A module runs (its hooks see it) or the backward started (any thread: a flag only)."""
        self.recording = False

    def resumer(self) -> Callable[[], None] | None:
        """Around a gradient the loss code takes (``torch.autograd.grad(..., create_graph=True)``:
        a gradient penalty), whose backward's hooks pause it: what records again after it, if it
        was recording."""
        if not self.recording:
            return None

        def resume() -> None:
            if self.on_stack:
                self.recording = True
        return resume

    def step_aside(self) -> None:
        """The model's forward, the loop's backward or the step's end starts, on the training
        thread: off the stack until the model returns or the next step starts (``start``) -
        torch.compile traces the model as it would without the probe, and the watch's own step
        end pays nothing for it. (``loss.backward()`` reaches the watch inside this mode's
        ``__torch_function__``, where the mode is not on the stack: only its flag changes then.)"""
        self.recording = False
        self._pop()

    def leave(self) -> bool:
        """Off the mode stack at the step's end, its calls released. A mode the loop pushed
        since and has not popped is above it: this one stays on, paused, until a later end finds
        it on top. Returns whether it is off."""
        self.recording = False
        self.calls.clear()
        self._counted.clear()
        self.budget.clear()
        self.dropped = 0
        self.roots = []
        if self._aside is not None:
            for hook in self._aside:
                hook.remove()
            self._aside = self._aside_for = None
        self._pop()
        return not self.on_stack

    def _pop(self) -> None:
        """Off this thread's mode stack, if it is on top of it."""
        if self.on_stack and self._on_top():
            self.__exit__(None, None, None)
            self.on_stack = False

    def origin(self) -> Origin | None:
        """The first call that made NaN/+inf of finite values (or -inf by arithmetic), with its
        line; None where the first bad value came in bad (the batch, the labels)."""
        judge = FirstBadOp()
        for func, loc, args, kwargs, out, _ in self.calls:
            name = op_name(func)
            judge.observe(name.rpartition(".")[2], args, kwargs, out,
                          lambda name=name, loc=loc: Origin.at(name, loc))
            if judge.found is not None:
                break
        return judge.result()

    def backward_origin(self) -> Origin | None:
        """Where the loss code's backward made a finite gradient non-finite while its values
        stayed finite (``loss_replay``); None: nothing found, or no backward kept."""
        return replay_backward(list(self.calls), self.roots) if self.roots else None
