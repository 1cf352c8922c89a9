"""AMP210: a reduction over so many elements that its result can leave the low dtype's range.

Needs shapes, so it runs when the model ran on example inputs (the range audit records them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule
from ampaudit.graph.range_probe import SHAPE
from ampaudit.graph.view import GraphView


@graph_rule("AMP210")
def large_reduction(view: GraphView) -> Iterator[Finding]:
    min_elements = rule("AMP210").params["min_elements"]
    reductions = view.catalog.trait("accumulates")
    for node in view.ops():
        if view.kinds[node] not in reductions or not view.runs_low(node):
            continue
        source = node.args[0] if node.args else None
        in_shape = source.meta.get(SHAPE) if hasattr(source, "meta") else None
        out_shape = node.meta.get(SHAPE)
        if in_shape is None or out_shape is None:
            continue
        per_output = math.prod(in_shape) // max(1, math.prod(out_shape))
        if view.kinds[node] in ("cumsum", "cumprod"):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
            per_output = in_shape[dim] if isinstance(dim, int) and in_shape else per_output
        if per_output >= min_elements:
            yield view.finding("AMP210", node, reduction=view.kinds[node], count=f"{per_output:,}", dtype=view.dtype,
                               fix=f"reduce in fp32: x.{view.kinds[node]}(..., dtype=torch.float32)")
