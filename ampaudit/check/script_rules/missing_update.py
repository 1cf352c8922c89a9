"""AMP407: scaler.step() without scaler.update() in the same loop: the scale never adapts,
and after the first overflow every step is skipped.
Fix (unsafe: changes what runs): insert ``scaler.update()`` after the step."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.protocol import amp_path, guard_prefix, loops_over, on_path
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding


@lint_rule("AMP407", reads=(r"\.step\(", r"\.update\(", "scaler", "GradScaler"))
def step_without_update(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        for step in facts.method_calls("step", scope):
            if step.receiver not in scalers or not step.has_arguments or not amp_path(facts, step):
                continue
            per_optimizer = loops_over(step, step.arg(0, "optimizer"))  # update after the loop is right
            updates = [u for u in facts.method_calls("update", scope) if u.receiver == step.receiver
                       and (step.loop is None or u.loop is step.loop or per_optimizer) and amp_path(facts, u)]
            if updates or _updated_elsewhere(facts, step):
                continue
            autofix = None
            if step.statement is not None:
                code = f"{guard_prefix(facts, step, step.receiver)}{step.receiver}.update()"
                autofix = Autofix((edits.insert_line_after(facts, step.statement, code),), safe=False)
            yield on_path(facts, "AMP407", step, via=step.receiver, scaler=step.receiver,
                          fix=f"call {step.receiver}.update() after it", autofix=autofix)


def _updated_elsewhere(facts: ScriptFacts, step: Call) -> bool:
    """``self.scaler.update()`` (or ``self.learn.scaler.update()``) in another method: a
    trainer's after-step hook updates the scaler the step used."""
    receiver = step.receiver or ""
    if not receiver.startswith("self."):
        return False
    attribute = receiver.rsplit(".", 1)[-1]
    updates = facts.once("self updates", lambda: [c for c in facts.method_calls("update")
                                                   if (c.receiver or "").startswith("self.")])
    return any(c.scope is not step.scope and c.receiver.rsplit(".", 1)[-1] == attribute for c in updates)
