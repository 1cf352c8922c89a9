"""AMP412: Adam-family eps that is 0 in fp16, on fp16 parameters: the update divides by
sqrt(v) + 0 and blows up where v underflows."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.masters import READS, handled
from ampaudit.check.lint.nodes import arguments
from ampaudit.check.lint.protocol import ADAMS, finding, half_casts, parameters_of
from ampaudit.check.lint.values import literal_number
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding
from ampaudit.core.rulebook import rule


@lint_rule("AMP412", reads=(r"\bAdam", "optim", "half", "float16", *READS))
def adam_eps_underflow(facts: ScriptFacts) -> Iterator[Finding]:
    halves = {name for name, cast in half_casts(facts) if not handled(facts, name, cast, masters=True)}
    if not halves:
        return
    smallest = rule("AMP412").params["smallest_subnormal"]
    for call in facts.calls_to(ADAMS):
        written = arguments(call.node)
        owner = parameters_of(written[0].value) if written else None
        if owner not in halves:
            continue
        eps_node = call.kwarg("eps")
        eps = literal_number(eps_node) if eps_node is not None else rule("AMP412").params["default_eps"]
        if eps is not None and eps < smallest:
            yield finding(facts, "AMP412", call, eps=f"{eps:g}", fix="eps=1e-4 (or keep fp32 master weights)")
