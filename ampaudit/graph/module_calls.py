"""How each submodule is really called: one fp32 run of the model on its example inputs,
recording the first call of every module.

A submodule traced on its own (because its parent cannot be traced) would otherwise be
traced with every argument a tensor - but a Hugging Face layer is called with
``token_type_ids=None`` or ``use_cache=False``, and a graph that treats those as tensors
fails when the parent calls it. The recorded non-tensor arguments become fx's
``concrete_args``, and the recorded tensors the child's own example inputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ampaudit.core.tensors import has_tensor
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.tree import map_tensors


def record_calls(model: torch.nn.Module, inputs: ExampleInputs) -> dict[str, ExampleInputs]:
    """Module path -> the arguments of its first call (tensors detached and cloned)."""
    calls: dict[str, ExampleInputs] = {}
    names = {module: name for name, module in model.named_modules(remove_duplicate=False)}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        name = names.get(module)
        if name is not None and name not in calls:
            calls[name] = ExampleInputs(map_tensors(args, _detached), map_tensors(kwargs, _detached),
                                        f"the call of {name or 'the model'}")

    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in names]
    try:
        with torch.no_grad():
            model(*inputs.args, **inputs.kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def concrete_args(module: torch.nn.Module, call: ExampleInputs) -> dict[str, Any] | None:
    """The non-tensor arguments of a recorded call, by parameter name, for fx to specialise
    on (None when there are none, or the call does not bind to ``forward``'s signature)."""
    try:
        bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    fixed = {}
    for name, value in bound.arguments.items():
        kind = inspect.signature(module.forward).parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            return None  # fx cannot specialise *args / **kwargs
        if not has_tensor(value):
            fixed[name] = value
    return fixed or None


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()  # the recorded call must not change when the model runs on
