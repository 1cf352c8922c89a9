"""AMP206: x ** p with a large constant exponent overflows float16 for modest |x|."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule
from ampaudit.graph.patterns import arg, number
from ampaudit.graph.view import GraphView


@graph_rule("AMP206")
def pow_overflow(view: GraphView) -> Iterator[Finding]:
    min_exponent = rule("AMP206").params["min_exponent"]
    limit = view.dtype.max
    for node in view.ops():
        if view.kinds[node] != "pow" or not view.runs_low(node):
            continue
        exponent = number(view, arg(node, 1, "exponent"))
        if exponent is None or abs(exponent) < min_exponent:
            continue
        bound = limit ** (1.0 / abs(exponent))
        yield view.finding("AMP206", node, exponent=f"{exponent:g}", dtype=view.dtype, bound=f"{bound:.3g}",
                           fix="compute the power on an fp32 copy: x.float() ** p")
