"""AMP407: scaler.step() without scaler.update() in the same loop: the scale never adapts,
and after the first overflow every step is skipped.
Fix (unsafe: changes what runs): insert ``scaler.update()`` after the step."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, Call, ScriptFacts
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
            if not lacks_update(facts, step, step.receiver, step.arg(0, "optimizer")) \
                    or _steps_for_its_caller(facts, step):
                continue
            autofix = None
            if step.statement is not None:
                autofix = Autofix((insert_update(facts, step, step.receiver),), safe=False)
            yield on_path(facts, "AMP407", step, via=step.receiver, scaler=step.receiver,
                          fix=f"call {step.receiver}.update() after it", autofix=autofix)


def _steps_for_its_caller(facts: ScriptFacts, step: Call) -> bool:
    """A helper handed a scaler it does not build, that neither scales a loss nor runs a
    backward: it steps for a training step written elsewhere, whose update() comes once after
    every optimizer has stepped (nerfstudio's ``Optimizers.optimizer_scaler_step_all(grad_scaler)``).
    A function handed the scaler that runs the training loop itself is no such helper."""
    scaler = step.receiver
    if step.scope.kind != "function" or scaler.startswith("self."):
        return False  # an attribute scaler: lacks_update looks in the object's other methods
    if any(a.target == scaler for a in facts.assigned(GRAD_SCALERS, step.scope)):
        return False
    return not any(c.method == "backward" or (c.method == "scale" and c.receiver == scaler)
                   for c in facts.calls_in(step.scope))
