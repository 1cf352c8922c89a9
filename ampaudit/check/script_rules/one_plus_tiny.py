"""AMP416: ``1 - c`` / ``1 + c`` with a literal c below half fp16's spacing at 1: the sum is
exactly 1 in fp16, so the constant does nothing."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import finding
from ampaudit.check.lint.values import literal_number
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule


def _uses_low_precision(facts: ScriptFacts) -> bool:
    return bool(facts.autocasts) or facts.mentions_float16 or any(c.method == "half" for c in facts.calls)


@lint_rule("AMP416", reads=(r"\de-\d", "autocast", "half", "float16"))
def one_plus_tiny(facts: ScriptFacts) -> Iterator[Finding]:
    if not facts.binary_ops or not _uses_low_precision(facts):
        return
    half_spacing = rule("AMP416").params["half_spacing_at_one"]
    for op in facts.binary_ops:
        left, right = literal_number(op.node.left), literal_number(op.node.right)
        if left == 1.0:
            tiny = right
        elif right == 1.0 and isinstance(op.node.op, ast.Add):
            tiny = left
        else:
            continue
        if tiny is not None and 0 < abs(tiny) < half_spacing:
            yield finding(facts, "AMP416", op, expression=facts.text(op.node),
                          fix="use a constant of at least 1e-3, or compute this in fp32")
