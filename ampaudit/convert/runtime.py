"""What converted models call at run time."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch import nn
from torch.fx.graph_module import _forward_from_src


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
    deep copy of the owner copies this with it and points it at the copy.

    A pickle (``torch.save(model)``) holds ``source`` - the part's code after the imports of
    what it calls, as fx pickles a GraphModule's own code - and not ``forward``, a function fx
    compiled from it, which pickle cannot name; the load compiles it again. ``owner`` pickles as
    the part's state, after the part: pickling the owner reaches the part inside its own
    ``__reduce__``, and pickle, finding the owner made when its state comes, keeps that one."""

    def __init__(self, owner: nn.Module, forward: Any, kwargs: dict[str, Any], code: str, source: str) -> None:
        self.owner, self.forward, self.kwargs, self.code, self.source = owner, forward, kwargs, code, source

    def __reduce__(self) -> tuple:
        return (_part_from_source, (self.source, self.kwargs, self.code), {"owner": self.owner})

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedCall:
        # the same compiled function: a copy need not compile the part's code again (the pickle's way)
        return CheckpointedCall(copy.deepcopy(self.owner, memo), self.forward, copy.deepcopy(self.kwargs, memo),
                                self.code, self.source)

    def __call__(self, *inputs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self._run, *inputs, **self.kwargs)

    def _run(self, *inputs: Any) -> Any:
        return self.forward(self.owner, *inputs)


def _part_from_source(source: str, kwargs: dict[str, Any], code: str) -> CheckpointedCall:
    """A pickled part, its ``forward`` compiled again from its source; its owner comes after."""
    return CheckpointedCall(None, _forward_from_src(source, {}), kwargs, code, source)  # type: ignore[arg-type]


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
        # a buffer the code reads (``attn.bias[:, :, :T, :T]``, T from a traced size) is a Proxy, as
        # it was in the first trace: a plain tensor sliced by a Proxy (TypeError on load)
        self.proxy_buffer_attributes = True

    def create_arg(self, a: Any) -> Any:
        # ``self.ampaudit_checkpoint_0`` read by the code is the part itself, no Proxy: a
        # reference to the attribute again, as ``keep_checkpoints`` wrote it - fx takes no constant of its type
        if isinstance(a, CheckpointedCall):
            name = next((k for k, v in vars(self.root).items() if v is a), None)
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)
