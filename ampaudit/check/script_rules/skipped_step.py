"""AMP419 / AMP420: what a skipped step (scaler.step() found inf/NaN gradients) means for
the code around it - a scheduler or EMA that steps anyway, and a skip check that counts the
scale's growth as a skip."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.memo import per_file
from ampaudit.check.lint.nodes import arguments, dotted
from ampaudit.check.lint.protocol import amp_path, finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding

_SCHEDULE = re.compile(r"(^|[._])(sched|scheduler|lr_scheduler|lr_sched|warmup)s?(_\w+)?$", re.IGNORECASE)
_EMA = re.compile(r"(^|[._])(ema|model_ema|ema_model|swa_model)(_\w+)?$", re.IGNORECASE)
_CHECKED = re.compile(r"get_scale|skip|step_applied|found_inf|optimizer_was_run", re.IGNORECASE)
# A learning-rate range test (an "LR finder") raises the rate every step whatever happens:
# it measures the loss per rate, it does not follow a schedule
_RANGE_TEST = re.compile(r"range_?test|lr_?find|find_?lr|record_?lr|lr_?range|RangeTest", re.IGNORECASE)
_PLATEAU = "ReduceLROnPlateau"
# `scheduler.step(train_step - warmup)`: a per-step schedule told the step number (the legacy
# epoch argument), not a plateau scheduler told a metric
_STEP_NUMBER = re.compile(r"step|epoch|iter|update", re.IGNORECASE)
_METRIC = re.compile(r"loss|metric|score|acc\b|accuracy|perf|val|ppl|perplex|bleu|dice|iou|error|f1|\bmap\b",
                     re.IGNORECASE)


@lint_rule("AMP419", reads=(r"\.step\(", "scaler", "GradScaler"))
def schedule_steps_on_skipped_step(facts: ScriptFacts) -> Iterator[Finding]:
    for scope in facts.scopes():
        if _RANGE_TEST.search(scope.name):
            continue
        scalers = facts.scalers(scope)
        steps = [c for c in facts.method_calls("step", scope) if c.receiver in scalers and c.has_arguments
                 and amp_path(facts, c)]
        if not steps or any("get_scale" in c.method for c in facts.calls_in(scope) if c.method):
            continue  # no scaled step, or the code already looks at the scale
        for call in facts.calls_in(scope):
            if call.receiver is None:
                continue
            follows = (call.method == "step" and _SCHEDULE.search(call.receiver)) or \
                (call.method in ("update", "update_parameters") and _EMA.search(call.receiver))
            step = next((s for s in steps if s.loop is call.loop and s.line < call.line), None)
            if not follows or step is None or _checked(facts, call) or not _per_step(facts, call):
                continue
            yield finding(facts, "AMP419", call, call=f"{call.receiver}.{call.method}()", scaler=step.receiver,
                          fix=f"step it only when {step.receiver}.get_scale() did not drop in update()")


@per_file
def _plateaus(facts: ScriptFacts) -> frozenset[str]:
    """Names only ever assigned a ReduceLROnPlateau, or a range test's scheduler."""
    kinds: dict[str, set[bool]] = {}
    for a in facts.assignments:
        names = [*a.call.names, dotted(a.call.node.func) or ""]
        plateau = any(n.rsplit(".", 1)[-1] == _PLATEAU or _RANGE_TEST.search(n) for n in names)
        if plateau or any(".lr_scheduler." in n for n in a.call.names):
            kinds.setdefault(a.target, set()).add(plateau)
    return frozenset(name for name, plateau in kinds.items() if plateau == {True})


def _per_step(facts: ScriptFacts, call: Call) -> bool:
    """Whether ``call`` advances a per-step schedule: not ``scheduler.step(val_loss)`` (a
    plateau scheduler stepped on a metric, per evaluation, not per update), not a
    ReduceLROnPlateau, not an LR finder's schedule - but ``scheduler.step(train_step)`` is."""
    if _RANGE_TEST.search(call.receiver or ""):
        return False
    if call.method == "step" and call.has_arguments:
        told = " ".join(facts.text(a.value) for a in arguments(call.node))
        return bool(_STEP_NUMBER.search(told)) and not _METRIC.search(told)
    return call.receiver not in _plateaus(facts)


def _checked(facts: ScriptFacts, call: Call) -> bool:
    """Whether a condition around the call already asks about skipped steps."""
    return any(_CHECKED.search(facts.text(test)) for test, _ in call.guards)


@lint_rule("AMP420", reads=("get_scale",))
def skip_check_with_not_equal(facts: ScriptFacts) -> Iterator[Finding]:
    for comparison in facts.scale_comparisons:
        node = comparison.node
        other = node.comparators[0]
        if dotted(node.left) is None and dotted(other) is None:
            continue  # get_scale() against a literal: not a before/after check
        expression = facts.code(node)
        better = expression.replace("!=", "<") if isinstance(node.ops[0], ast.NotEq) \
            else expression.replace("==", ">=")
        yield finding(facts, "AMP420", comparison, expression=expression, fix=f"`{better}`")
