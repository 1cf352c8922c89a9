"""The loss code's backward, run again: where a NaN the loss code sent into the model was made
by a backward whose forward values were all finite - a ``sqrt`` at exactly 0, whose slope is
infinite (RMSE at a perfect prediction: sqrt(0) = 0, its backward inf * 0 = NaN). The calls the
loss probe kept (``loss_probe``) run again on copies of what they read, with a gradient where
the original had one and under the autocast each ran under, then a backward from every loss the
step ran backward from; each autograd node is checked as a module's backward replay checks them
(``provenance.NodeScan``) and named with its call's line. The replay computes what the step
computed, but for its random calls, whose generators it leaves as they were."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ampaudit.core.tensors import iter_tensors
from ampaudit.watch.provenance import NodeScan, Origin, autocast_contexts

# a kept call: func, the user's line, args, kwargs, output, the autocast it ran under
Kept = tuple[Any, Any, tuple, "dict | None", Any, tuple]


def op_name(func: Any) -> str:
    """``torch.log``, ``F.cross_entropy``, ``Tensor.div`` - how the user wrote the call."""
    name = getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", None)
    if module == "torch.nn.functional":
        return f"F.{name}"
    if module and module.startswith("torch"):
        return f"torch.{name}"
    return f"Tensor.{name}"


def _takes_a_gradient(func: Any) -> bool:
    """``torch.autograd.grad``: a gradient penalty's (WGAN-GP's ``create_graph=True``), which torch
    hands to a mode. Run again on copies it fails - the copy of the output it differentiates is
    a leaf, cut from the copied inputs -, and its graph is the model's (its double backward, which
    no replay of the loss code runs): its gradients are where the replay starts. A NaN made in that
    double backward, inside the model, is not named here."""
    return getattr(func, "__name__", None) == "grad" and getattr(func, "__module__", None) == "torch.autograd"


def _under(autocast: tuple) -> ExitStack:
    """The autocast a call ran under (``provenance.autocast_state``), entered for its replay."""
    stack = ExitStack()
    for context in autocast_contexts(autocast):
        stack.enter_context(context)
    return stack


def replay_backward(calls: Sequence[Kept], roots: Sequence[torch.Tensor]) -> Origin | None:
    """The node whose backward made NaN or Inf of finite gradients in ``calls`` run again and
    backward from the copies of ``roots`` (the step's losses: one per micro-batch under gradient
    accumulation); None: nothing found, or the replay failed (the user's code: only the name is
    lost)."""
    copies: dict[int, torch.Tensor] = {}  # id of a tensor the step held -> its copy in the replay
    leaves: list[torch.Tensor] = []
    scan = NodeScan()

    def take(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in copies:  # made before the loss code (the model's output, the labels)
            copy = value.detach().clone()
            if value.requires_grad and copy.is_floating_point():
                leaves.append(copy.requires_grad_())
            copies[id(value)] = copy
        return copies[id(value)]

    # the replay's random calls draw from forked generators: a noise the loss code samples
    # (a diffusion loss's) would advance them, and the run go on with other draws than without watch
    devices = sorted({t.device.index for call in calls for t in iter_tensors(call[4])
                      if t.device.type == "cuda" and t.device.index is not None})
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            for func, loc, args, kwargs, out, autocast in calls:
                if _takes_a_gradient(func):  # its gradients start the replay, as a tensor made before it would
                    tree_map(take, out)
                    continue
                args, kwargs = tree_map(take, (args, kwargs or {}))
                with _under(autocast):  # a matmul the loop ran in fp16 underflows as it did
                    replayed = func(*args, **kwargs)
                scan.made(replayed, lambda func=func, loc=loc: (op_name(func), loc))
                # the same structure: the same call on tensors of the same kinds
                copies.update((id(a), b) for a, b in zip(iter_tensors(out), iter_tensors(replayed), strict=False))
            # every backward of the step: a micro-batch's sqrt at 0 is not behind the last one's loss
            losses = list({id(loss): loss for root in roots
                           if (loss := copies.get(id(root))) is not None and loss.requires_grad}.values())
            if not losses or not leaves:
                return None
            scan.backward(losses, leaves, [torch.ones_like(loss) for loss in losses])
    except Exception:  # the user's code, run again: a failed replay names nothing
        return None
    return scan.found
