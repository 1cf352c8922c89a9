"""How each submodule is really called: one fp32 run of the model on its example inputs,
recording the first call of every module.

A submodule traced on its own (because its parent cannot be traced) would otherwise be
traced with every argument a tensor - but a Hugging Face layer is called with
``token_type_ids=None`` or ``use_cache=False``, and a graph that treats those as tensors
fails when the parent calls it. The recorded non-tensor arguments become fx's
``concrete_args``, and the recorded tensors the child's own example inputs.

Calls are seen by wrapping each module's ``forward`` for the run (:func:`forwards_wrapped`),
not by module hooks: Meta's llama calls ``self.attention.forward(...)`` directly, which no
hook sees.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.tensors import has_tensor
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.tree import map_tensors


def record_calls(model: torch.nn.Module, inputs: ExampleInputs) -> dict[str, ExampleInputs]:
    """Module path -> the arguments of its first call (tensors detached and cloned)."""
    calls: dict[str, ExampleInputs] = {}
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}

    def wrap(module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def recording(*args: Any, **kwargs: Any) -> Any:
            name = names.get(id(module))
            if name is not None and name not in calls:
                calls[name] = ExampleInputs(map_tensors(args, _detached), map_tensors(kwargs, _detached),
                                            f"the call of {name or 'the model'}")
            return forward(*args, **kwargs)
        return recording

    with attributes_kept(model), forwards_wrapped(model, wrap, include_root=True), torch.no_grad():
        model(*inputs.args, **inputs.kwargs)
    return calls


@contextlib.contextmanager
def forwards_wrapped(root: torch.nn.Module, wrap: Callable[[torch.nn.Module, Callable[..., Any]], Callable[..., Any]],
                     *, include_root: bool = False) -> Iterator[None]:
    """Each module under ``root`` (once, however often it is shared) gets ``wrap(module,
    forward)`` as its ``forward`` for the block: an instance attribute, so both ``module(x)``
    and a direct ``module.forward(x)`` go through it; the previous attribute (or none) is put
    back afterwards."""
    modules = list({id(m): m for m in root.modules()}.values())
    previous = [(m, m.__dict__.get("forward", _NONE)) for m in modules if include_root or m is not root]
    try:
        for module, _ in previous:
            module.__dict__["forward"] = wrap(module, module.forward)
        yield
    finally:
        for module, forward in previous:
            if forward is _NONE:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward


_NONE = object()


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
