"""AMP406: gradient clipping after scaler.scale(loss).backward() without scaler.unscale_():
the clip threshold is compared against gradients multiplied by the loss scale.
Fix (unsafe: changes what runs): insert ``scaler.unscale_(optimizer)`` before the clip."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import (
    amp_path,
    backward_calls,
    backward_scaler,
    clips,
    guard_prefix,
    on_path,
    optimizers,
    scaled_backward,
)
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding


@lint_rule("AMP406", reads=("clip_grad", "unscale_", "backward", r"\.scale\(", "scaler", r"\.step\("))
def clip_before_unscale(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        backwards = [c for c in backward_calls(facts, scope) if scaled_backward(facts, c, scalers)]
        if not backwards:
            continue
        for clip in facts.calls_in(scope):
            if not clips(facts, clip) or not amp_path(facts, clip):
                continue
            before = [b for b in backwards if b.line < clip.line]
            if not before:
                continue
            last = max(before, key=lambda b: b.line)  # the backward these gradients come from
            scaler = backward_scaler(facts, last, scalers)
            if any(last.line <= c.line < clip.line for c in facts.method_calls("unscale_", scope)
                   if c.receiver == scaler):
                continue
            steps = {dotted(c.arg(0, "optimizer")) for c in facts.method_calls("step", scope) if c.receiver == scaler}
            if not steps:  # the optimizer steps by itself (AMP405): it is still the one to unscale
                opts = optimizers(facts, scope)
                steps = {c.receiver for c in facts.method_calls("step", scope) if c.receiver in opts}
            optimizer = steps.pop() if len(steps) == 1 else None
            autofix = None
            if optimizer and clip.statement is not None:
                code = f"{guard_prefix(facts, clip, scaler)}{scaler}.unscale_({optimizer})"
                autofix = Autofix((edits.insert_line_before(facts, clip.statement, code),), safe=False)
            yield on_path(facts, "AMP406", clip, via=scaler, scaler=scaler, optimizer=optimizer or "optimizer",
                          fix=f"call {scaler}.unscale_({optimizer or 'optimizer'}) before clipping",
                          autofix=autofix)
