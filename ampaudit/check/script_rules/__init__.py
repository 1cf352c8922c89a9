"""Lint rules: each is a function ``ScriptFacts -> Iterable[Finding]``, registered under the
codes it emits and with the source text it ``reads`` (regular expressions): a top-level
function or class that matches none of the rules' patterns is not parsed. Messages,
severities and docs live in rules/rules.toml."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ampaudit.core.registry import RuleFn, RuleRegistry

LINT_RULES: RuleRegistry = RuleRegistry(__name__, (
    "adam_eps", "apex_amp", "autograd_function", "backward_in_autocast", "bce_under_autocast",
    "clip_before_unscale", "deprecated_api", "half_training", "mask_constants", "missing_scaler",
    "missing_update", "one_plus_tiny", "step_bypasses_scaler", "unscaled_backward", "useless_scaler",
    "unscale_twice", "custom_fwd_device", "skipped_step", "autocast_regions",
    "framework_backward", "scaler_per_epoch", "scaler_checkpoint", "unstepped_under_amp",
))


def lint_rule(*codes: str, reads: Sequence[str]) -> Callable[[RuleFn], RuleFn]:
    """Register a lint rule; ``reads`` is required (an empty list would hide every function)."""
    if not reads:
        raise ValueError(f"lint rule {', '.join(codes)} must declare the source text it reads")
    return LINT_RULES.rule(*codes, reads=reads)


run_lint_rules = LINT_RULES.run
