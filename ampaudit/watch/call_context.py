"""Where a hook runs: inside a torch.compile'd region being traced, inside a backward (a
checkpointed block recomputed), inside a ``torch.func`` transform. Each is one C call on the
hooks' hot path, bound once: dynamo knows the function, not the name.
"""

from __future__ import annotations

import sys

import torch

_functorch = getattr(torch._C, "_functorch", None)
# the torch.func transform level of this thread, or None outside any transform
functorch_level = _functorch.maybe_current_level if _functorch is not None else lambda: None
# Inside a torch.compile'd region the hooks are traced, not run. By default they record nothing
# there (a branch dynamo does not take: no graph break, the compiled graph is the one without
# watch); with ``inside_compile`` the forward hook of a watched model's module puts the recording
# op in the graph (``compiled``).
compiling = torch.compiler.is_compiling
graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: no backward pass runs
_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)


# autograd's own vmap prototype (``torch.autograd.grad(..., is_grads_batched=True)``,
# ``torch.autograd.functional.jacobian(..., vectorize=True)``) runs the backward on batched
# gradients with no storage, outside any torch.func level: a gradient hook gets one
legacy_batched = getattr(_functorch, "is_legacy_batchedtensor", lambda _: False)


def functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func wrapper (no storage of its own). Not traced by dynamo (a
    C function it cannot trace): a compiled graph's tensors are no wrappers."""
    return _functorch is not None and not compiling() and (_functorch.is_functorch_wrapped_tensor(t)
                                                           or legacy_batched(t))


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpointed block recomputed)."""
    return graph_task() != -1


def recomputed() -> bool:
    """Whether this module call is non-reentrant activation checkpointing recomputing, in
    backward, a call its forward already made (and watch recorded): its saved-tensor hooks are
    on top. Reentrant checkpointing's forward runs without grad, its recomputation is the one
    call to record."""
    if not in_backward():  # the forward: nearly every call, one C call
        return False
    top = _top_saved_hooks(False)
    return top is not None and "_recomputation_hook" in getattr(top[0], "__qualname__", "")


def transformed() -> bool:
    """Inside a ``torch.func`` transform (vmap, grad, jacrev, ...): its tensors are wrappers
    with no storage of their own, and a tensor made there (an arena row) would be one too."""
    return functorch_level() is not None


def compiled_anything() -> bool:
    """Whether torch.compile has compiled a graph in this process (dynamo counts them)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo is not None and bool(dynamo.counters["stats"]["unique_graphs"])
