"""AMP209: a variance or mean square computed in low precision (x.pow(2).mean(), (x*x).sum()).

Squares overflow float16 for |x| > 256 and the sum of many small squares loses its low
bits; HF's LlamaRMSNorm and T5LayerNorm upcast to fp32 first for exactly this reason.
"""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.patterns import arg, number, source
from ampaudit.graph.view import GraphView


def _is_square(view: GraphView, node) -> bool:
    kind = view.kind(node)
    if kind == "square":
        return True
    if kind == "pow":
        return number(view, arg(node, 1, "exponent")) == 2.0
    if kind == "mul":
        a, b = arg(node, 0), arg(node, 1, "other")
        return a is b and a is not None
    return False


@graph_rule("AMP209")
def low_precision_variance(view: GraphView) -> Iterator[Finding]:
    reductions = view.catalog.trait("sum_like")
    for node in view.ops():
        if view.kinds[node] not in reductions:
            continue
        square = source(view, arg(node, 0, "input"))
        if square is not None and _is_square(view, square) and view.runs_low(square):
            yield view.finding("AMP209", node, reduction=view.kinds[node], dtype=view.dtype,
                               fix="upcast before squaring: x.float().pow(2).mean(...) then cast the result back")
