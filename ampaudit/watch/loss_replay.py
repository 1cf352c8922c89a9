"""The loss code's backward, run again: where a NaN the loss code sent into the model was made
by a backward whose forward values were all finite - a ``sqrt`` at exactly 0, whose slope is
infinite (RMSE at a perfect prediction: sqrt(0) = 0, its backward inf * 0 = NaN). The calls the
loss probe kept (``loss_probe``) run again on copies of what they read, with a gradient where
the original had one, then a backward from the loss; each autograd node is checked as a
module's backward replay checks them (``provenance.NodeScan``) and named with its call's line.
The replay computes what the step computed, but for its random calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ampaudit.core.tensors import iter_tensors
from ampaudit.watch.provenance import NodeScan, Origin


def op_name(func: Any) -> str:
    """``torch.log``, ``F.cross_entropy``, ``Tensor.div`` - how the user wrote the call."""
    name = getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", None)
    if module == "torch.nn.functional":
        return f"F.{name}"
    if module and module.startswith("torch"):
        return f"torch.{name}"
    return f"Tensor.{name}"


def replay_backward(calls: Sequence[tuple[Any, Any, tuple, dict | None, Any]], root: torch.Tensor) -> Origin | None:
    """The node whose backward made NaN or Inf of finite gradients in ``calls`` (the probe's:
    func, line, args, kwargs, output) run again and backward from the copy of ``root``; None:
    nothing found, or the replay failed (the user's code: only the name is lost)."""
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

    try:
        with torch.enable_grad():
            for func, loc, args, kwargs, out in calls:
                args, kwargs = tree_map(take, (args, kwargs or {}))
                replayed = func(*args, **kwargs)
                scan.made(replayed, lambda func=func, loc=loc: (op_name(func), loc))
                # the same structure: the same call on tensors of the same kinds
                copies.update((id(a), b) for a, b in zip(iter_tensors(out), iter_tensors(replayed), strict=False))
            loss = copies.get(id(root))
            if loss is None or not loss.requires_grad or not leaves:
                return None
            scan.backward([loss], leaves, [torch.ones_like(loss)])
    except Exception:  # the user's code, run again: a failed replay names nothing
        return None
    return scan.found
