"""What converted models call at run time."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch import nn


@torch.fx.wrap
def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype`` if it is a floating-point tensor; anything else untouched
    (token ids, masks, Python numbers), so a cast can sit wherever dtypes are unknown."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


@torch.fx.wrap
def call_with(module: nn.Module, names: tuple[str, ...], values: tuple[torch.Tensor, ...], *args: Any,
              **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with ``values`` (its parameters and buffers ``names``, cast)
    in place of its own for this call - still a call of the module, so its hooks fire: a
    low-precision module whose weights stay fp32 (``weights="fp32"``). Names and values come
    apart because fx freezes a dict argument. A buffer updated in place would update its cast
    copy: modules with running statistics (BatchNorm) compute in fp32 by the catalog and are
    never called this way."""
    return torch.func.functional_call(module, dict(zip(names, values, strict=True)), args, kwargs)


class CheckpointedCall:
    """A part of a converted graph that the model ran under ``torch.utils.checkpoint.checkpoint``,
    called under it again with the same options (convert/checkpoints.py): its activations are
    recomputed in backward instead of kept. ``forward`` is the part's generated code, run with
    ``owner`` (the converted GraphModule) as ``self``, so it reads the owner's own parameters and
    modules. Not an nn.Module: the state stays the owner's, under the model's state_dict keys; a
    deep copy of the owner copies this with it and points it at the copy."""

    def __init__(self, owner: nn.Module, forward: Any, kwargs: dict[str, Any], code: str) -> None:
        self.owner, self.forward, self.kwargs, self.code = owner, forward, kwargs, code

    def __call__(self, *inputs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self._run, *inputs, **self.kwargs)

    def _run(self, *inputs: Any) -> Any:
        return self.forward(self.owner, *inputs)


@torch.fx.wrap
def checkpointed(part: CheckpointedCall, *inputs: Any) -> Any:
    """``part(*inputs)`` under ``torch.utils.checkpoint.checkpoint``: what a converted graph calls
    where the model called checkpoint (the generated code reads ``checkpointed(self.ampaudit_checkpoint_0, x)``)."""
    return part(*inputs)


class Retracer(torch.fx.Tracer):
    """What a pickled converted GraphModule (``torch.save(model)``) is traced with again on
    load - ``GraphModule.__reduce__`` keeps the class that traced it, and ampaudit's audit
    tracer takes arguments (TypeError on load): these functions stay calls, not traced
    through (a ``cast`` traced through on a Proxy dropped, and the loaded model fed fp32 to
    fp16 weights)."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=(cast, call_with, checkpointed))
