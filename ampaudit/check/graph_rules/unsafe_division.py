"""AMP211: division by a norm or reduction with no eps: 0 / 0 = NaN, and small norms flush to 0."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.patterns import arg, bounded_exponent, number, source
from ampaudit.graph.view import GraphView


def _root_of_kept_positive(view: GraphView, root) -> bool:
    """``sqrt(v + eps)`` or ``sqrt(v.clamp_min(eps))`` with an eps the low dtype keeps nonzero:
    the root cannot reach 0 (SAM's LayerNorm2d: ``(x - u) / torch.sqrt(s + self.eps)``)."""
    inner = source(view, arg(root, 0, "input"))
    kind = view.kind(inner) if inner is not None else None
    if kind == "add":
        terms = [number(view, arg(inner, 0)), number(view, arg(inner, 1, "other"))]
    elif kind in ("clamp", "clamp_min"):
        terms = [number(view, arg(inner, 1, "min"))]
    else:
        return False
    return any(t is not None and t >= view.dtype.tiniest for t in terms)


def _positive_constant(view: GraphView, value, depth: int = 0) -> bool:
    """A value made of positive constants alone - DeBERTa's ``torch.sqrt(torch.tensor(d) * 3)``,
    a head size's root -, each one the low dtype keeps above 0: no input makes it vanish."""
    c = number(view, value)
    if c is not None:
        return c >= view.dtype.tiniest
    if value in view.python:  # arithmetic on sizes (fx): a size is never below 1 where one divides
        return True
    node = source(view, value)
    if node is not None and view.kind(node) in ("tensor", "scalar_tensor") and node.args:
        return _positive_constant(view, node.args[0], depth + 1)  # torch.tensor(q.size(-1))
    if node is None or depth > 8 or view.kind(node) not in ("mul", "add", "sqrt", "rsqrt", "pow"):
        return False
    operands = [a for a in node.args if a is not None]
    return bool(operands) and all(_positive_constant(view, a, depth + 1) for a in operands)


def _sum_of_shifted_exp(view: GraphView, total) -> bool:
    terms = source(view, arg(total, 0, "input"))
    return view.kind(terms) == "exp" and bounded_exponent(view, source(view, arg(terms, 0, "input")))


@graph_rule("AMP211")
def unsafe_division(view: GraphView) -> Iterator[Finding]:
    can_vanish = view.catalog.trait("vanishes_with_input")
    for node in view.ops():
        if view.kinds[node] != "div" or not view.runs_low(node):
            continue
        divisor = source(view, arg(node, 1, "other"))
        kind = view.kind(divisor)
        if kind == "sum" and _sum_of_shifted_exp(view, divisor):
            continue  # a softmax denominator: one term is exp(0) = 1
        if kind == "sqrt" and _root_of_kept_positive(view, divisor):
            continue  # the eps is inside the root
        if _positive_constant(view, divisor):
            continue  # a scale, not data
        if kind in can_vanish:
            yield view.finding("AMP211", node, divisor=kind, dtype=view.dtype,
                               fix="add an eps (x / (n + eps)) or clamp the divisor: n.clamp_min(eps)")
