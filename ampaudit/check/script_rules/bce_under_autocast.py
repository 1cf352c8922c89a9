"""AMP413: binary_cross_entropy / nn.BCELoss called inside an autocast block (it raises)."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding

_FUNCTIONS = frozenset({"torch.nn.functional.binary_cross_entropy", "torch.binary_cross_entropy"})
_MODULES = frozenset({"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"})


@lint_rule("AMP413", reads=("binary_cross_entropy", "BCELoss", "autocast"))
def bce_under_autocast(facts: ScriptFacts) -> Iterator[Finding]:
    losses = [(a.target, a.call.scope) for a in facts.assignments if a.call.names & _MODULES]
    for call in facts.calls:
        if call.autocast is None or not call.autocast.enabled:
            continue
        # a loss module named in this function or at module level (not another function's)
        local = {name for name, scope in losses if scope is call.scope or scope.kind == "module"}
        if call.names & _FUNCTIONS or dotted(call.node.func) in local:
            yield finding(facts, "AMP413", call,
                          fix="use F.binary_cross_entropy_with_logits / nn.BCEWithLogitsLoss on the logits")
