"""AMP407: scaler.step() without scaler.update() in the same loop: the scale never adapts,
and after the first overflow every step is skipped.
Fix (unsafe: changes what runs): insert ``scaler.update()`` after the step."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import amp_path, insert_update, lacks_update, on_path
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding


@lint_rule("AMP407", reads=(r"\.step\(", r"\.update\(", "scaler", "GradScaler"))
def step_without_update(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        for step in facts.method_calls("step", scope):
            if step.receiver not in scalers or not step.has_arguments or not amp_path(facts, step):
                continue
            if not lacks_update(facts, step, step.receiver, step.arg(0, "optimizer")):
                continue
            autofix = None
            if step.statement is not None:
                autofix = Autofix((insert_update(facts, step, step.receiver),), safe=False)
            yield on_path(facts, "AMP407", step, via=step.receiver, scaler=step.receiver,
                          fix=f"call {step.receiver}.update() after it", autofix=autofix)

