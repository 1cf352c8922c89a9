"""Which conditions switch AMP on or off - the everyday trainer shapes:

    if scaler is not None: scaler.scale(loss).backward()      if use_amp: ...
    else: loss.backward()                                      if not args.fp16: ... continue

A test is an *AMP switch* when it reads a GradScaler (``if scaler``, ``scaler is None``,
``scaler.is_enabled()``), a name that is passed as ``enabled=`` to autocast or GradScaler
anywhere in the file, or a flag named for AMP (``use_amp``, ``args.fp16``,
``cfg.mixed_precision``, ``self.scaler``); ``not``, ``and``, ``or``, ``is None`` and
comparisons with a precision string (``precision == "16-mixed"``) are followed. A call's AMP
state is decided by its innermost switch: "on", "off", or None when no switch guards it.
"""

from __future__ import annotations

import re

import libcst as cst

from ampaudit.check.lint.facts import Call, Guard, ScriptFacts, dotted

ON, OFF = "on", "off"
Effect = tuple[str | None, str | None]  # the AMP state when the test holds, when it does not

_FLAG_WORDS = frozenset({"amp", "fp16", "half", "mixed", "autocast", "scaler", "apex"})
_NOT_FLAG_WORDS = frozenset({"bf16", "bfloat16", "fp32", "full", "no", "disable", "disabled"})
_LOW_STRING = re.compile(r"16|amp|mixed|half", re.IGNORECASE)
_FP32_STRING = re.compile(r"^(fp32|float32|32|32-true|no|none|full)$", re.IGNORECASE)
_EMPTY = cst.Module([])


def _is_flag(facts: ScriptFacts, name: str, scalers: frozenset[str]) -> bool:
    if name in scalers or name in facts.enabled_flags:
        return True
    words = set(re.split(r"[_\W]+", name.rsplit(".", 1)[-1].lower()))
    return bool(words & _FLAG_WORDS) and not words & _NOT_FLAG_WORDS


def effect(facts: ScriptFacts, test: cst.BaseExpression, scalers: frozenset[str]) -> Effect:
    """The AMP state in the branch where ``test`` holds, and in the one where it does not."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        when_true, when_false = effect(facts, test.expression, scalers)
        return when_false, when_true
    if isinstance(test, cst.BooleanOperation):
        left, right = effect(facts, test.left, scalers), effect(facts, test.right, scalers)
        if isinstance(test.operator, cst.And):  # true: both hold; false: one fails
            return left[0] or right[0], left[1] if left[1] == right[1] else None
        return left[0] if left[0] == right[0] else None, left[1] or right[1]  # or
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        return _comparison(facts, test, scalers)
    if isinstance(test, cst.Call) and isinstance(test.func, cst.Attribute):
        if test.func.attr.value == "is_enabled" and _is_flag(facts, dotted(test.func.value) or "", scalers):
            return ON, OFF
        return None, None
    name = dotted(test)
    if name and _is_flag(facts, name, scalers):
        return ON, OFF
    return None, None


def _comparison(facts: ScriptFacts, test: cst.Comparison, scalers: frozenset[str]) -> Effect:
    target = test.comparisons[0]
    operator, other = target.operator, target.comparator
    name = dotted(test.left)
    if name is None or (not _is_flag(facts, name, scalers) and not isinstance(other, cst.SimpleString)):
        return None, None
    if isinstance(other, cst.Name) and other.value == "None":  # scaler is None / is not None
        if isinstance(operator, (cst.IsNot, cst.NotEqual)):
            return ON, OFF
        if isinstance(operator, (cst.Is, cst.Equal)):
            return OFF, ON
    if isinstance(other, cst.SimpleString):  # precision == "16-mixed", dtype == "float16"
        value = str(other.evaluated_value)
        state = OFF if _FP32_STRING.match(value) else ON if _LOW_STRING.search(value) and "bf" not in value \
            else None
        if state is None:
            return None, None
        if isinstance(operator, cst.Equal):
            return state, None
        if isinstance(operator, cst.NotEqual):
            return None, state
    return None, None


def decide(facts: ScriptFacts, guards: tuple[Guard, ...], scalers: frozenset[str]) -> tuple[str | None, str | None]:
    """(state, the guard as the user wrote it) for code under ``guards``: the innermost AMP
    switch decides; (None, None) when none of them is one."""
    for test, held in reversed(guards):
        when_true, when_false = effect(facts, test, scalers)
        state = when_true if held else when_false
        if state is not None:
            text = _EMPTY.code_for_node(test)
            return state, f"`{text}`" if held else f"not `{text}`"
    return None, None


def amp_state(facts: ScriptFacts, call: Call) -> tuple[str | None, str | None]:
    """The AMP state of a call's path: "on", "off" or None, and the guard that says so."""
    return decide(facts, call.guards, facts.scalers(call.scope))
