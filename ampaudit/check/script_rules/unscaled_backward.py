"""AMP404: a GradScaler is in use, yet this backward() runs on the unscaled loss."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.protocol import backward_calls, on_path, scaled_backward, scaler_for, scopes_with_scalers
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP404", reads=("backward", "GradScaler", "scaler", r"\.scale\("))
def unscaled_backward(facts: ScriptFacts) -> Iterator[Finding]:
    for scope, scalers in scopes_with_scalers(facts):
        for call in backward_calls(facts, scope):
            if not scaled_backward(facts, call, facts.scalers(scope)) and not _discarded(facts, call):
                scaler = scaler_for(facts, call, scalers)
                yield on_path(facts, "AMP404", call, via=scaler, scaler=scaler,
                              fix=f"{scaler}.scale(loss).backward()")


def _discarded(facts: ScriptFacts, backward: Call) -> bool:
    """A backward whose gradients are thrown away: its loop zeroes them after it and steps
    nothing (NVIDIA's Jasper pre-allocates its buffers with such passes): no update to lose."""
    loop = backward.loop
    if loop is None:
        return False
    same = [c for c in facts.calls_in(backward.scope) if c.loop is loop]
    return any(c.method == "zero_grad" and c.line > backward.line for c in same) \
        and not any(c.method == "step" for c in same)
