"""Recording inside a ``torch.compile``'d region (``watch(..., inside_compile=True)``): one
custom op that dynamo puts in the graph.

Under torch.compile a module's forward hook is traced, not run, so it cannot fill an arena row
itself. Instead the traced hook calls ``torch.ops.ampaudit.record(tensor, recorder, module,
kind, index)``: an opaque node in the compiled graph (no graph break, ``fullgraph`` works)
that, when the graph runs, hands the real tensor to its ``StepRecorder``, which fills the
tensor's row as in eager mode (the C kernel on the CPU, Triton on CUDA). Gradient hooks
registered on a traced tensor call it too, from the compiled backward (or at once, when
dynamo runs such a hook eagerly).

The op reads its tensor and never writes it. It returns nothing, so it is declared to have a
side effect (torch's effect tokens) - else every compiler pass would drop it as dead code.
Everything that changes between steps (is this step recorded, is a replay running) is read by
the op when it runs, never by the traced hook: dynamo would guard on it and recompile. The
traced hook reads only what is fixed while a watch runs - the module's number and the
recorder's token - so a watch compiles once.

What it costs in numerics: a recorded tensor must exist in memory, so inductor may fuse the
graph differently than without watch, and a reduction may then add in another order - the
last bits of the results can differ (``aot_eager`` and ``eager`` stay bit-identical). That is
why it is an option, off by default.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ampaudit.watch.events import EVAL, FORWARD, GRAD_INPUT, GRAD_OUTPUT

# What the op calls when its graph runs: a recorder's ``record_traced(tensor, module, kind, index)``.
Record = Callable[[torch.Tensor, int, int, int], None]

_records: dict[int, weakref.WeakMethod] = {}
_tokens = itertools.count(1)


def register(record: Record) -> int:
    """The token by which the op finds ``record``, a recorder's bound method - held weakly, so
    a compiled graph that outlives its watch records nothing and keeps no recorder alive."""
    token = next(_tokens)
    _records[token] = weakref.WeakMethod(record)
    weakref.finalize(record.__self__, _records.pop, token, None)
    return token


@torch.library.custom_op("ampaudit::record", mutates_args=())
def _record(x: torch.Tensor | None, token: int, module: int, kind: int, index: int) -> None:
    _record_now(x, token, module, kind, index)


@_record.register_fake
def _(x: torch.Tensor | None, token: int, module: int, kind: int, index: int) -> None:
    return None


def _declare_side_effect() -> bool:
    """Mark the op as having a side effect, so that no pass drops it: torch's effect tokens
    (a private registration, under two names across torch versions)."""
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None and hasattr(torch.library, "EffectType"):
        register("ampaudit::record", torch.library.EffectType.ORDERED)
        return True
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return False
    _register_effectful_op(torch.ops.ampaudit.record.default, _EffectType.ORDERED)
    return True


SUPPORTED = _declare_side_effect()  # whether inside_compile can work with this torch


def record(x: torch.Tensor, token: int, module: int, kind: int, index: int) -> None:
    """In a traced hook: record ``x`` when the compiled graph runs. Dynamo may run a gradient
    hook eagerly in the backward instead of tracing it: then it records at once."""
    if torch.compiler.is_compiling():
        torch.ops.ampaudit.record(x, token, module, kind, index)
    else:
        _record_now(x, token, module, kind, index)


def _record_now(x: torch.Tensor | None, token: int, module: int, kind: int, index: int) -> None:
    ref = _records.get(token)
    target = ref() if ref is not None else None
    if target is not None and x is not None:  # a compiled backward passes None for a gradient never made
        target(x, module, kind, index)


def hook_grad(x: torch.Tensor, token: int, module: int, kind: int, index: int) -> None:
    """In a traced hook: record the gradient w.r.t. ``x`` when the compiled backward makes it."""
    def hook(grad: torch.Tensor) -> None:
        record(grad, token, module, kind, index)

    x.register_hook(hook)


def trace_forward(token: int, module: int, output: Any, tensors: list[torch.Tensor],
                  inputs: list[tuple[int, torch.Tensor]], *, record_eval: bool) -> None:
    """What a module's forward hook does while dynamo traces it: its output ``tensors`` (and, in
    training, their gradients and those of its positional ``inputs``: none, without provenance)
    recorded by the op; ``record_eval``: whether grad-disabled forwards are recorded."""
    grad = torch.is_grad_enabled()
    if not grad and not record_eval:
        return
    several = not isinstance(output, torch.Tensor)
    for i, t in enumerate(tensors):
        record(t, token, module, (FORWARD if grad else EVAL) + several, i)
        if grad and t.requires_grad:
            hook_grad(t, token, module, GRAD_OUTPUT + several, i)
    if grad:
        for i, t in inputs:
            if t.requires_grad:
                hook_grad(t, token, module, GRAD_INPUT, i)
