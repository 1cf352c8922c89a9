"""AMP405: optimizer.step() where a GradScaler is in use: the step skips unscaling and the
inf/NaN check. Fix (unsafe: changes what runs): ``scaler.step(optimizer)``."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import (
    amp_path,
    guard_prefix,
    insert_update,
    lacks_update,
    on_path,
    optimizers,
    scaler_for,
    scopes_with_scalers,
    softened,
)
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding


@lint_rule("AMP405", reads=(r"\.step\(", "GradScaler", "scaler", "optim"))
def step_bypasses_scaler(facts: ScriptFacts) -> Iterator[Finding]:
    for scope, scalers in scopes_with_scalers(facts):
        opts = optimizers(facts, scope)
        for call in facts.method_calls("step", scope):
            if call.receiver in opts and call.receiver not in scalers and not call.has_arguments \
                    and amp_path(facts, call):
                scaler = scaler_for(facts, call, scalers, call.receiver)
                fixed = f"{scaler}.step({call.receiver})"
                if guard_prefix(facts, call, scaler):  # the scaler may be None here: keep the fp32 step
                    fixed = f"{fixed} if {scaler} is not None else {call.receiver}.step()"
                fix_edits = [edits.replace(facts, call.node, fixed)]
                if call.statement is not None and lacks_update(facts, call, scaler, call.node.func.value):
                    fix_edits.append(insert_update(facts, call, scaler))  # else the next run finds AMP407
                autofix = Autofix(tuple(fix_edits), safe=False)
                found = on_path(facts, "AMP405", call, via=scaler, optimizer=call.receiver, scaler=scaler,
                                fix=f"{scaler}.step({call.receiver})", autofix=autofix)
                # `scaler.unscale_(opt); opt.step()`: deliberate (a sparse optimizer, say) - the
                # gradients are right, only the inf/NaN skip is lost
                yield softened(found) if _unscaled_by_hand(facts, call, scaler) else found


def _unscaled_by_hand(facts: ScriptFacts, step, scaler: str) -> bool:
    """The code unscales this optimizer itself and steps another one through the scaler: it
    knows scaler.step() and chose the plain step here (DLRM's sparse embedding optimizer)."""
    same_scope = [c for c in facts.calls_in(step.scope) if c.receiver == scaler]
    unscaled = any(c.method == "unscale_" and c.line < step.line and dotted(c.arg(0, "optimizer")) == step.receiver
                   for c in same_scope)
    steps_others = any(c.method == "step" and dotted(c.arg(0, "optimizer")) not in (None, step.receiver)
                       for c in same_scope)
    return unscaled and steps_others
