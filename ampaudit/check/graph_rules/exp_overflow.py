"""AMP204 / AMP205: exp of unbounded values, alone or inside a hand-written softmax / logsumexp.

exp overflows float16 for x > 11.09. Subtracting the row max first (what torch.softmax and
torch.logsumexp do) keeps every exponent <= 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import fx

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.patterns import arg, bounded_exponent, source
from ampaudit.graph.view import GraphView


def _handwritten(view: GraphView, exp: fx.Node) -> str | None:
    """'softmax' for exp(x) / exp(x).sum(...), 'logsumexp' for log(exp(x).sum(...))."""
    for total in exp.users:
        if view.kind(total) != "sum":
            continue
        for user in total.users:
            if view.kind(user) == "log":
                return "logsumexp"
        for user in exp.users:
            if view.kind(user) == "div" and source(view, arg(user, 1, "other")) is total:
                return "softmax"
    return None


@graph_rule("AMP204", "AMP205")
def exp_overflow(view: GraphView) -> Iterator[Finding]:
    for node in view.ops():
        if view.kinds[node] not in ("exp", "exp2") or not view.runs_low(node):
            continue
        exponent = source(view, arg(node, 0, "input"))
        if bounded_exponent(view, exponent):
            continue
        pattern = _handwritten(view, node)
        if pattern is not None:
            yield view.finding("AMP205", node, pattern=pattern, dtype=view.dtype,
                               fix=f"use torch.{pattern}(x, dim): it subtracts the max and is upcast by autocast")
        else:
            yield view.finding("AMP204", node, dtype=view.dtype,
                               fix="subtract the max first (x - x.amax(dim, keepdim=True)) or compute exp in fp32")
