"""Graph rules: each is a function ``GraphView -> Iterable[Finding]`` registered under the
codes it emits (one concern, sometimes graded into several codes: overflow / flush / subnormal).

A rule decides *where* it fires; its message, severity, thresholds and docs live in
rules/rules.toml.
"""

from __future__ import annotations

from ampaudit.core.registry import RuleRegistry

GRAPH_RULES: RuleRegistry = RuleRegistry(__name__, (
    "banned_ops", "constants", "declared_precision", "exp_overflow", "explicit_casts", "fp32_left_low",
    "large_reduction", "log_hazards", "low_variance", "measured_ranges", "pow_overflow", "unknown_op",
    "unsafe_division",
))
graph_rule = GRAPH_RULES.rule
run_graph_rules = GRAPH_RULES.run
