"""Choose how to see the model's ops: fx, the recorder, or fx with failing modules as leaves.

1. ``fx``: torch.fx symbolic trace of the whole model - every path, no inputs needed.
2. ``recorder``: fx failed and example inputs exist - record what one forward executes.
3. ``fx-partial``: fx failed and there are no inputs - trace again keeping each failing
   submodule whole, and trace that module's children on their own. The failing forward's
   own ops stay unseen, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from ampaudit.core.catalog import Catalog
from ampaudit.core.userframe import Loc
from ampaudit.graph.forward import ExampleInputs, run_model
from ampaudit.graph.fx_tracer import LOC, MODULE, FxFailure, forward_location, fx_trace, is_leaf
from ampaudit.graph.recorder import record_trace


@dataclass
class SubGraph:
    """A traced graph of the module at ``prefix`` (``""`` for the model itself)."""

    prefix: str
    gm: fx.GraphModule


@dataclass
class TraceResult:
    method: str  # "fx", "recorder" or "fx-partial"
    graphs: list[SubGraph]
    failures: list[FxFailure] = field(default_factory=list)  # where fx gave up, outermost first
    opaque: list[str] = field(default_factory=list)  # modules kept whole, their own ops unseen
    output: Any = None  # the model's output on the example inputs, when it ran


def trace_model(
    model: torch.nn.Module, catalog: Catalog, inputs: ExampleInputs | None, *, validate: bool = True
) -> TraceResult:
    """``validate``: run the model once on the inputs after a successful fx trace, so bad
    inputs fail here (off when the range probe is about to run the graph anyway)."""
    gm, failure = fx_trace(model, catalog)
    if gm is not None:
        output = run_model(model, inputs) if inputs is not None and validate else None
        return TraceResult("fx", [SubGraph("", gm)], output=output)
    if inputs is not None:
        gm, output = run_model(model, inputs, runner=lambda: record_trace(model, inputs.args, inputs.kwargs,
                                                                          catalog))
        return TraceResult("recorder", [SubGraph("", gm)], [failure], output=output)
    result = TraceResult("fx-partial", [])
    _trace_partial(model, "", catalog, failure, result)
    return result


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _trace_partial(
    module: torch.nn.Module, prefix: str, catalog: Catalog, failure: FxFailure | None, result: TraceResult
) -> None:
    opaque: list[str] = []
    gm = None
    while failure is not None and failure.module and failure.module not in opaque:
        # A submodule failed: keep it whole and try again.
        result.failures.append(replace(failure, module=_join(prefix, failure.module)))
        opaque.append(failure.module)
        gm, failure = fx_trace(module, catalog, opaque)
    if failure is not None:
        # This module's own forward cannot be traced: only its children can be seen.
        result.failures.append(replace(failure, module=prefix))
        opaque = [""]
    elif gm is not None:
        result.graphs.append(SubGraph(prefix, gm))
    for path in opaque:
        owner = module.get_submodule(path) if path else module
        result.opaque.append(_join(prefix, path))
        _trace_children(owner, _join(prefix, path), catalog, result)


def _trace_children(owner: torch.nn.Module, prefix: str, catalog: Catalog, result: TraceResult) -> None:
    default_leaf = fx.Tracer().is_leaf_module
    for name, child in owner.named_children():
        path = _join(prefix, name)
        if is_leaf(catalog, child, default_leaf(child, name)):
            # A leaf is one op: list it at the owner's forward, the call site fx could not see.
            result.graphs.append(SubGraph(prefix, _single_module_graph(name, child, forward_location(owner))))
            continue
        gm, failure = fx_trace(child, catalog)
        if gm is not None:
            result.graphs.append(SubGraph(path, gm))
        else:
            _trace_partial(child, path, catalog, failure, result)


def _single_module_graph(name: str, child: torch.nn.Module, loc: Loc) -> fx.GraphModule:
    graph = fx.Graph()
    node = graph.call_module(name, (graph.placeholder("input"),))
    graph.output(node)
    for n in graph.nodes:
        n.meta[LOC] = loc
        n.meta[MODULE] = name if n is node else None
    return fx.GraphModule({name: child}, graph)
