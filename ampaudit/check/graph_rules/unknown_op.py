"""AMP102: an op missing from the catalog, so its precision is a guess."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.graph.kinds import printable_target
from ampaudit.graph.view import GraphView


@graph_rule("AMP102")
def unknown_op(view: GraphView) -> Iterator[Finding]:
    for node in view.ops():
        if not view.known[node]:
            yield view.finding("AMP102", node, target=printable_target(node, view.sub.gm))
