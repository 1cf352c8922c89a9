"""AMP408: backward() inside the autocast block."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP408", reads=("backward", "autocast"))
def backward_inside_autocast(facts: ScriptFacts) -> Iterator[Finding]:
    for call in facts.calls:
        if call.method == "backward" and call.autocast is not None and call.autocast.enabled:
            yield finding(facts, "AMP408", call, block_line=call.autocast.line,
                          fix="dedent the backward call out of the `with autocast` block")
