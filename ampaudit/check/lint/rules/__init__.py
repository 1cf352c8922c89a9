"""Lint rules: each is a function ``ScriptFacts -> Iterable[Finding]``, registered under the
codes it emits. Messages, severities and docs live in rules/rules.toml."""

from __future__ import annotations

from ampaudit.core.registry import RuleRegistry

LINT_RULES: RuleRegistry = RuleRegistry(__name__, (
    "adam_eps", "apex_amp", "autograd_function", "backward_in_autocast", "bce_under_autocast",
    "clip_before_unscale", "deprecated_api", "half_training", "mask_constants", "missing_scaler",
    "missing_update", "one_plus_tiny", "step_bypasses_scaler", "unscaled_backward", "useless_scaler",
))
lint_rule = LINT_RULES.rule
run_lint_rules = LINT_RULES.run
