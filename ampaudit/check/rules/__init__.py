"""Graph rules: each is a function ``GraphView -> Iterable[Finding]`` registered under its code.

A rule decides *where* it fires; its message, severity and docs live in rules/rules.toml.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ampaudit.check.graph_view import GraphView
from ampaudit.core.findings import Finding

GraphRule = Callable[[GraphView], Iterable[Finding]]
GRAPH_RULES: dict[str, GraphRule] = {}


def graph_rule(code: str) -> Callable[[GraphRule], GraphRule]:
    def register(fn: GraphRule) -> GraphRule:
        if code in GRAPH_RULES:
            raise RuntimeError(f"graph rule {code} registered twice")
        GRAPH_RULES[code] = fn
        return fn

    return register


def run_graph_rules(view: GraphView) -> list[Finding]:
    # Import for the registration side effect: one module per rule.
    from ampaudit.check.rules import fp32_left_low, unknown_op  # noqa: F401

    return [finding for rule in GRAPH_RULES.values() for finding in rule(view)]
