"""AMP426: an optimizer stepped only where AMP is off - the fp32 branch steps it, the GradScaler
branch steps another optimizer and not this one: with AMP on its parameters never train.
NVIDIA's Transformer-XL trainer steps its sparse-embedding optimizer in the fp32/apex branch
only (``if args.fp16: scaler.step(optimizer) ... else: optimizer.step(); optimizer_sparse.step()``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint.facts import Call, Scope, ScriptFacts
from ampaudit.check.lint.guards import OFF, amp_state
from ampaudit.check.lint.nodes import arguments, dotted
from ampaudit.check.lint.protocol import finding, optimizers, scopes_with_scalers
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP426", reads=(r"\.step\(", "GradScaler", "scaler"))
def optimizer_unstepped_under_amp(facts: ScriptFacts) -> Iterator[Finding]:
    for scope, scalers in scopes_with_scalers(facts):
        opts = optimizers(facts, scope)
        calls = facts.calls_in(scope)
        scaled = [c for c in calls if c.method == "step" and c.receiver in scalers]
        stepped = {dotted(c.arg(0, "optimizer")) for c in scaled}
        # the AMP branch steps something, each by its name: a loop variable or a list element
        # (`for opt in optimizers: scaler.step(opt)`) could be any optimizer - nothing is said
        if not scaled or not stepped <= opts or any(_loop_variable(c) for c in scaled):
            continue
        scaler = min(scalers)
        for name in sorted(opts - stepped):
            plain = [c for c in calls if c.method == "step" and c.receiver == name and not c.has_arguments]
            states = [amp_state(facts, c) for c in plain]
            if not plain or any(state != OFF for state, _ in states):
                continue
            if _handed_on(facts, scope, name):  # a helper may step it on the AMP path
                continue
            yield finding(facts, "AMP426", plain[0], optimizer=name, scaler=scaler, guard=states[0][1] or "AMP is off",
                          fix=f"step it where the scaler steps: {scaler}.step({name})")


def _loop_variable(step: Call) -> bool:
    """``scaler.step(opt)`` inside ``for opt in ...``: it steps whatever the loop goes over."""
    name = dotted(step.arg(0, "optimizer"))
    loop = step.loop
    return isinstance(loop, (ast.For, ast.AsyncFor)) and any(
        isinstance(n, ast.Name) and n.id == name for n in ast.walk(loop.target))


def _handed_on(facts: ScriptFacts, scope: Scope, name: str) -> bool:
    """``name`` is passed to a call where AMP may be on (``amp_step(optimizer_sparse)``)."""
    return any(amp_state(facts, c)[0] != OFF and any(dotted(a.value) == name for a in arguments(c.node))
               for c in facts.calls_in(scope) if c.method != "step")
