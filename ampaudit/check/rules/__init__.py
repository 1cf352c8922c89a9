"""Graph rules: each is a function ``GraphView -> Iterable[Finding]`` registered under the
codes it emits (one concern, sometimes graded into several codes: overflow / flush / subnormal).

A rule decides *where* it fires; its message, severity, thresholds and docs live in
rules/rules.toml.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ampaudit.check.graph_view import GraphView
from ampaudit.core.findings import Finding

GraphRule = Callable[[GraphView], Iterable[Finding]]
GRAPH_RULES: dict[str, GraphRule] = {}


def graph_rule(*codes: str) -> Callable[[GraphRule], GraphRule]:
    def register(fn: GraphRule) -> GraphRule:
        for code in codes:
            if code in GRAPH_RULES:
                raise RuntimeError(f"graph rule {code} registered twice")
            GRAPH_RULES[code] = fn
        return fn

    return register


def run_graph_rules(view: GraphView) -> list[Finding]:
    # Import for the registration side effect: one module per rule.
    from ampaudit.check.rules import (  # noqa: F401
        banned_ops,
        constants,
        exp_overflow,
        explicit_casts,
        fp32_left_low,
        large_reduction,
        log_hazards,
        low_variance,
        measured_ranges,
        pow_overflow,
        unknown_op,
        unsafe_division,
    )

    rules = dict.fromkeys(GRAPH_RULES.values())  # each function once, in registration order
    return [finding for rule in rules for finding in rule(view)]
