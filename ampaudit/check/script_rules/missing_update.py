"""AMP407: scaler.step() without scaler.update() in the same loop: the scale never adapts,
and after the first overflow every step is skipped.
Fix (unsafe: changes what runs): insert ``scaler.update()`` after the step."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import amp_path, guard_prefix, on_path
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding


@lint_rule("AMP407", reads=(r"\.step\(", r"\.update\(", "scaler", "GradScaler"))
def step_without_update(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        for step in facts.method_calls("step", scope):
            if step.receiver not in scalers or not step.node.args or not amp_path(facts, step):
                continue
            updates = [u for u in facts.method_calls("update", scope) if u.receiver == step.receiver
                       and (step.loop is None or u.loop is step.loop) and amp_path(facts, u)]
            if updates or _updated_elsewhere(facts, step):
                continue
            autofix = None
            if step.statement is not None:
                code = f"{guard_prefix(facts, step, step.receiver)}{step.receiver}.update()"
                autofix = Autofix((edits.insert_line_after(facts, step.statement, code),), safe=False)
            yield on_path(facts, "AMP407", step, via=step.receiver, scaler=step.receiver,
                          fix=f"call {step.receiver}.update() after it", autofix=autofix)


def _updated_elsewhere(facts: ScriptFacts, step) -> bool:
    """``self.scaler.update()`` in another method of the class (a trainer's after-step hook)."""
    if not (step.receiver or "").startswith("self.") or step.loop is not None:
        return False
    return any(c.method == "update" and c.receiver == step.receiver and c.scope is not step.scope
               for c in facts.calls)
