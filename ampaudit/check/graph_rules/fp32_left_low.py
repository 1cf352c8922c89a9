"""AMP101: an op the catalog keeps in fp32 that autocast would run in fp16/bf16 here."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding, Precision
from ampaudit.graph.dtype_flow import LOW, explicit_cast, first_float_input
from ampaudit.graph.view import GraphView


@graph_rule("AMP101")
def fp32_op_left_in_low_precision(view: GraphView) -> Iterator[Finding]:
    for node in view.ops():
        policy = view.policy(node)
        if (
            policy is not None
            and policy.precision is Precision.FP32
            and policy.autocast == "none"  # autocast upcasts listed ops itself
            and not policy.fp32_under_autocast
            and explicit_cast(node) is False  # dtype=torch.float32 given
            and first_float_input(node, view.flow) == LOW
        ):
            kind = view.kinds[node]
            yield view.finding("AMP101", node, kind=kind, reason=policy.reason, dtype=view.dtype,
                               fix=f"cast the input of `{kind}` to fp32 with `.float()`")
