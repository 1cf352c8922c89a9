"""AMP417: ``scaler.unscale_(opt)`` more often than ``scaler.step(opt)`` (gradient
accumulation): the second unscale_() before a step raises at run time. Two shapes: the
unscale in the micro-batch loop with the step after it, and both in one loop with only the
step under the accumulation condition (``if (idx + 1) % accum == 0:``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint.facts import Call, ScriptFacts
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
            if not paired:
                continue
            scaler, name = unscale.receiver, optimizer or "optimizer"
            # every step of this optimizer lies outside the unscale's loop: that loop repeats the unscale
            if all(not first <= s.line <= last for s in paired):
                yield on_path(facts, "AMP417", unscale, via=scaler, scaler=scaler, optimizer=name,
                              where=f"in a loop that `{scaler}.step({name})` is outside of",
                              fix=f"move {scaler}.unscale_(...) out of the loop, right before {scaler}.step(...)")
                continue
            # one loop: the step waits for the accumulation condition, the unscale does not
            conditions = [_accumulation_guard(facts, s, unscale) for s in paired if s.loop is unscale.loop]
            if conditions and all(conditions):
                yield on_path(facts, "AMP417", unscale, via=scaler, scaler=scaler, optimizer=name,
                              where=f"on every iteration, while `{scaler}.step({name})` runs only when "
                                    f"`{conditions[0]}`",
                              fix=f"unscale (and clip) only when the step runs: move {scaler}.unscale_(...) "
                                  f"under `if {conditions[0]}:`, right before {scaler}.step(...)")


def _accumulation_guard(facts: ScriptFacts, step: Call, unscale: Call) -> str | None:
    """The condition, as written, under which ``step`` runs and ``unscale`` does not, when it
    counts micro-steps (a ``%``, or a name about accumulation); None if there is none."""
    shared = {(facts.code(test), held) for test, held in unscale.guards}
    for test, held in step.guards:
        if (facts.code(test), held) not in shared and _counts_micro_steps(test):
            return facts.code(test) if held else _negated(facts, test)
    return None


_OPPOSITE = (ast.Eq, ast.NotEq)


def _negated(facts: ScriptFacts, test: ast.expr) -> str:
    """``test`` turned round, as a user would write it: ``x % n != 0`` -> ``x % n == 0``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return facts.code(test.operand)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], _OPPOSITE):
        opposite = "==" if isinstance(test.ops[0], ast.NotEq) else "!="
        return f"{facts.code(test.left)} {opposite} {facts.code(test.comparators[0])}"
    return f"not ({facts.code(test)})"


def _counts_micro_steps(test: ast.expr) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
        if isinstance(node, (ast.Name, ast.Attribute)) and "accum" in (dotted(node) or "").lower():
            return True
    return False
