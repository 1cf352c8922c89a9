"""AMP207 / AMP208: log of a probability (use the fused log-space op) or of values that hit 0."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.patterns import arg, number, source
from ampaudit.graph.view import GraphView

_FUSED = {"softmax": "torch.log_softmax(x, dim)", "sigmoid": "torch.nn.functional.logsigmoid(x)"}


def _can_be_zero(view: GraphView, producer) -> bool:
    kind = view.kind(producer)
    if kind in view.catalog.trait("reaches_zero"):
        return True
    if kind == "pow":
        exponent = number(view, arg(producer, 1, "exponent"))
        return exponent is not None and exponent > 0 and exponent % 2 == 0
    if kind == "sub":  # 1 - p: a probability complement
        return number(view, arg(producer, 0)) is not None
    return False


@graph_rule("AMP207", "AMP208")
def log_hazards(view: GraphView) -> Iterator[Finding]:
    logs = view.catalog.trait("logarithm")
    for node in view.ops():
        if view.kinds[node] not in logs:
            continue
        producer = source(view, arg(node, 0, "input"))
        kind = view.kind(producer)
        if kind in _FUSED:
            yield view.finding("AMP207", node, producer=kind, fused=_FUSED[kind], dtype=view.dtype,
                               fix=f"use {_FUSED[kind]}")
        elif producer is not None and view.runs_low(node) and _can_be_zero(view, producer):
            yield view.finding("AMP208", node, producer=kind, dtype=view.dtype,
                               fix="clamp the input first: x.clamp_min(eps) with eps >= the dtype's smallest normal")
