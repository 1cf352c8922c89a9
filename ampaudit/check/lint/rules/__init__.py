"""Lint rules: each is a function ``ScriptFacts -> Iterable[Finding]``, registered under the
codes it emits. Messages, severities and docs live in rules/rules.toml."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.core.findings import Finding

LintRule = Callable[[ScriptFacts], Iterable[Finding]]
LINT_RULES: dict[str, LintRule] = {}


def lint_rule(*codes: str) -> Callable[[LintRule], LintRule]:
    def register(fn: LintRule) -> LintRule:
        for code in codes:
            if code in LINT_RULES:
                raise RuntimeError(f"lint rule {code} registered twice")
            LINT_RULES[code] = fn
        return fn

    return register


def run_lint_rules(facts: ScriptFacts) -> list[Finding]:
    from ampaudit.check.lint.rules import (  # noqa: F401  (one module per rule: registration)
        adam_eps,
        apex_amp,
        autograd_function,
        backward_in_autocast,
        bce_under_autocast,
        clip_before_unscale,
        deprecated_api,
        half_training,
        mask_constants,
        missing_scaler,
        missing_update,
        one_plus_tiny,
        step_bypasses_scaler,
        unscaled_backward,
        useless_scaler,
    )

    rules = dict.fromkeys(LINT_RULES.values())
    return [finding for rule in rules for finding in rule(facts)]
