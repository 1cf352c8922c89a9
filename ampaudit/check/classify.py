"""The classification pass: every op of the traced graphs gets a precision and a reason.

Emits AMP101 (an fp32 op that autocast would leave in low precision) and AMP102 (an op the
catalog does not know). Trace coverage findings (AMP001/AMP002) come from
:mod:`ampaudit.check.coverage`.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from ampaudit.core.catalog import Catalog
from ampaudit.core.findings import Finding, NodeDecision, Precision
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.dtype_flow import LOW, autocast_flow, explicit_cast, first_float_input
from ampaudit.graph.fx_tracer import LOC, MODULE
from ampaudit.graph.trace import SubGraph, TraceResult

_STRUCTURAL = {
    "placeholder": ("placeholder", "model input"),
    "get_attr": ("get_attr", "parameter, buffer or constant"),
    "output": ("output", "model output"),
}


def _snake(name: str) -> str:
    """A kind-shaped name for things the catalog does not know: ``FancyNorm`` -> fancy_norm."""
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return re.sub(r"\W+", "_", name).strip("_").lower() or "unknown"


def node_kind(node: fx.Node, gm: fx.GraphModule, catalog: Catalog) -> tuple[str, bool]:
    """(canonical kind, known to the catalog) of one node."""
    if node.op in _STRUCTURAL:
        return _STRUCTURAL[node.op][0], True
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
        kind = catalog.kind_of_module_type(cls)
        return (kind, True) if kind else (_snake(cls.__name__), False)
    if node.op == "call_method":
        kind = catalog.canonical_kind(node.target)
    else:
        kind = catalog.kind_of_callable(node.target)
    if catalog.lookup(kind) is not None:
        return kind, True
    return _snake(kind), False


_NAMESPACES = (
    ("torch", torch), ("torch.nn.functional", torch.nn.functional), ("torch.special", torch.special),
    ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("operator", operator),
)


def printable_target(node: fx.Node, gm: fx.GraphModule) -> str:
    """How a user would write the op: ``torch.relu``, ``x.view``, ``blocks.0.ln (LayerNorm)``."""
    target = node.target
    if node.op == "call_module":
        return f"{target} ({type(gm.get_submodule(target)).__name__})"
    if node.op == "call_method":
        return f"Tensor.{target}"
    if callable(target):
        name = getattr(target, "__name__", "")
        for label, namespace in _NAMESPACES:
            if name and getattr(namespace, name, None) is target:
                return f"{label}.{name}"
        module = getattr(target, "__module__", None) or ""
        qualname = getattr(target, "__qualname__", name) or repr(target)
        return f"{module}.{qualname}" if module else qualname
    return str(target)


def _qualify(prefix: str, name: str | None) -> str | None:
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def classify(trace: TraceResult, catalog: Catalog, dtype_name: str) -> tuple[list[NodeDecision], list[Finding]]:
    decisions: list[NodeDecision] = []
    findings: list[Finding] = []
    opaque = set(trace.opaque)
    for sub in trace.graphs:
        _classify_graph(sub, catalog, dtype_name, opaque, decisions, findings)
    return decisions, findings


def _classify_graph(
    sub: SubGraph,
    catalog: Catalog,
    dtype_name: str,
    opaque: set[str],
    decisions: list[NodeDecision],
    findings: list[Finding],
) -> None:
    gm = sub.gm
    kinds = {}
    known = {}
    for node in gm.graph.nodes:
        kinds[node], known[node] = node_kind(node, gm, catalog)
    flow = autocast_flow(gm, kinds, catalog)
    for node in gm.graph.nodes:
        loc = node.meta[LOC]
        file, line = display_path(loc.file), loc.line
        module = _qualify(sub.prefix, node.meta.get(MODULE))
        name = f"{sub.prefix}:{node.name}" if sub.prefix else node.name
        kind = kinds[node]
        policy = catalog.lookup(kind)
        if node.op in _STRUCTURAL:
            precision, reason = Precision.NEUTRAL, _STRUCTURAL[node.op][1]
        elif node.op == "call_module" and module in opaque:
            precision, reason = Precision.NEUTRAL, "not traced: its forward is opaque to torch.fx (see AMP002)"
        elif policy is not None:
            precision, reason = policy.precision, policy.reason
        else:
            precision, reason = Precision.NEUTRAL, "not in the catalog: assumed to follow its input"
        decision = NodeDecision(name, node.op, kind, module, precision, reason, file, line,
                                target=printable_target(node, gm))
        decisions.append(decision)
        if node.op in _STRUCTURAL or (node.op == "call_module" and module in opaque):
            continue
        if not known[node]:
            findings.append(rule("AMP102").finding(file, line, column=loc.column, module=module, node=name,
                                                   target=decision.target))
        elif (
            policy.precision is Precision.FP32
            and policy.autocast == "none"
            and not policy.fp32_under_autocast
            and explicit_cast(node) is False
            and first_float_input(node, flow) == LOW
        ):
            findings.append(rule("AMP101").finding(
                file, line, column=loc.column, module=module, node=name, kind=kind, reason=policy.reason,
                dtype=dtype_name,
                fix=f"cast the input of `{kind}` to fp32 with `.float()`",
            ))
