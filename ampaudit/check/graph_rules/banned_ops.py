"""AMP212: binary_cross_entropy / nn.BCELoss, which autocast refuses to run."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.view import GraphView


@graph_rule("AMP212")
def banned_under_autocast(view: GraphView) -> Iterator[Finding]:
    for node in view.ops():
        policy = view.policy(node)
        if policy is not None and policy.autocast == "banned":
            yield view.finding("AMP212", node, kind=view.kinds[node],
                               fix="apply BCEWithLogitsLoss / F.binary_cross_entropy_with_logits to the logits")
