"""AMP417: ``scaler.unscale_(opt)`` inside a loop that ``scaler.step(opt)`` is outside of
(gradient accumulation): the second unscale_() before a step raises at run time."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import amp_path, loops_over, on_path
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP417", reads=("unscale_",))
def unscale_more_than_once_per_step(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        scalers = facts.scalers(scope)
        steps = [c for c in facts.method_calls("step", scope) if c.receiver in scalers and amp_path(facts, c)]
        for unscale in facts.method_calls("unscale_", scope):
            if unscale.receiver not in scalers or unscale.loop is None or not amp_path(facts, unscale) \
                    or loops_over(unscale, unscale.arg(0, "optimizer")):
                continue
            optimizer = dotted(unscale.arg(0, "optimizer"))
            first, last = facts.lines(unscale.loop)
            paired = [s for s in steps if s.receiver == unscale.receiver and dotted(s.arg(0, "optimizer")) == optimizer]
            # every step of this optimizer lies outside the unscale's loop: that loop repeats the unscale
            if paired and all(not first <= s.line <= last for s in paired):
                yield on_path(facts, "AMP417", unscale, via=unscale.receiver, scaler=unscale.receiver,
                              optimizer=optimizer or "optimizer",
                              fix=f"move {unscale.receiver}.unscale_(...) out of the loop, right before "
                                  f"{unscale.receiver}.step(...)")
