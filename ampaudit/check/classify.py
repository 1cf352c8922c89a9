"""The classification pass: every node of a traced graph gets a precision and a reason."""

from __future__ import annotations

from ampaudit.core.catalog import OpPolicy
from ampaudit.core.findings import NodeDecision, Precision
from ampaudit.core.paths import display_path
from ampaudit.graph.fx_tracer import LOC
from ampaudit.graph.kinds import printable_target
from ampaudit.graph.range_probe import MEASURED
from ampaudit.graph.view import STRUCTURAL_OPS, GraphView

_STRUCTURAL_REASONS = {
    "placeholder": "model input",
    "get_attr": "parameter, buffer or constant",
    "output": "model output",
}
_OPAQUE_REASON = "not traced: its forward is opaque to torch.fx (see AMP002)"
_UNKNOWN_REASON = "not in the catalog: assumed to follow its input"
_PYTHON_REASON = "Python arithmetic on sizes or shapes: not a tensor op"


def _computes(policy: OpPolicy | None) -> bool:
    """An op whose precision a declared-fp32 module overrides: one that would run in the low
    dtype (fp16 or promote), or that the catalog does not know."""
    return policy is None or policy.precision in (Precision.LOW, Precision.PROMOTE)


def classify(view: GraphView) -> list[NodeDecision]:
    decisions = []
    for node in view.nodes:
        policy = view.policy(node)
        if node.op in STRUCTURAL_OPS:
            precision, reason = Precision.NEUTRAL, _STRUCTURAL_REASONS[node.op]
        elif view.is_opaque(node):
            precision, reason = Precision.NEUTRAL, _OPAQUE_REASON
        elif node in view.python:
            precision, reason = Precision.NEUTRAL, _PYTHON_REASON
        elif node in view.fp32_declared and _computes(policy) and view.catalog.declared is not None:
            declared, module = view.catalog.declared, view.fp32_declared[node]
            precision = declared.precision
            reason = declared.reason.format(owner=view.declared.owner, attribute=module.attribute,
                                            pattern=repr(module.pattern))
        elif policy is not None:
            precision, reason = policy.precision, policy.reason
        else:
            precision, reason = Precision.NEUTRAL, _UNKNOWN_REASON
        loc = node.meta[LOC]
        measured = node.meta.get(MEASURED)
        decisions.append(NodeDecision(
            view.name(node), node.op, view.kinds[node], view.module(node), precision, reason,
            display_path(loc.file), loc.line, target=printable_target(node, view.sub.gm),
            measured=measured.to_dict() if measured is not None else None,
        ))
    return decisions
