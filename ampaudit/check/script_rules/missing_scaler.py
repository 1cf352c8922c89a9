"""AMP403: fp16 autocast and backward() in one function, but no GradScaler in sight."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import backward_calls, finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.dtypes import FLOAT16
from ampaudit.core.findings import Finding


@lint_rule("AMP403", reads=("autocast", "backward", "GradScaler", "scaler"))
def fp16_autocast_without_scaler(facts: ScriptFacts) -> Iterator[Finding]:
    for block in facts.autocasts:
        if block.dtype is not FLOAT16 or not block.enabled:
            continue
        if backward_calls(facts, block.scope) and not facts.scalers(block.scope):
            yield finding(facts, "AMP403", block,
                          fix='create scaler = torch.amp.GradScaler("cuda") and call scaler.scale(loss).backward()')
