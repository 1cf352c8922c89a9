"""Which conditions switch AMP on or off - the everyday trainer shapes:

    if scaler is not None: scaler.scale(loss).backward()      if use_amp: ...
    else: loss.backward()                                      if not args.fp16: ... continue

A test is an *AMP switch* when it reads a GradScaler (``if scaler``, ``scaler is None``,
``scaler.is_enabled()``), a name that is passed as ``enabled=`` to autocast or GradScaler
anywhere in the file, or a flag named for AMP (``use_amp``, ``args.fp16``,
``cfg.mixed_precision``, ``self.scaler``, ``config["use_fp16"]``) - or for fp32, the other
way round (``not self.fp32``); ``not``, ``and``, ``or``, ``is None``, ``== True`` and
comparisons with a precision (``precision == "16-mixed"``, ``dtype == torch.float32``,
``self.amp_type == AmpType.PYTORCH``) are followed. A call's AMP state is decided by its
innermost switch: "on", "off", or None when no switch guards it.
"""

from __future__ import annotations

import ast
import re

from ampaudit.check.lint.facts import Call, Guard, ScriptFacts
from ampaudit.check.lint.memo import per_file
from ampaudit.check.lint.nodes import arguments, dotted
from ampaudit.check.lint.values import string_value

ON, OFF = "on", "off"
Effect = tuple[str | None, str | None]  # the AMP state when the test holds, when it does not

_FLAG_WORDS = frozenset({"amp", "fp16", "half", "mixed", "autocast", "scaler", "scaling", "apex"})
_NOT_FLAG_WORDS = frozenset({"bf16", "bfloat16", "fp32", "full", "no", "disable", "disabled"})
_FP32_FLAG_WORDS = frozenset({"fp32", "float32"})  # `if self.fp32:` - true means AMP is off
# constants that mean "not torch's AMP": none at all, or apex (which scales with its own
# scale_loss, so GradScaler's protocol does not apply on its branch)
_OFF_CONSTANTS = frozenset({"none", "off", "no", "disabled", "fp32", "float32", "full", "apex"})
_LOW_STRING = re.compile(r"16|amp|mixed|half", re.IGNORECASE)
_FP32_STRING = re.compile(r"^(fp32|float32|32|32-true|no|none|full)$", re.IGNORECASE)
_FP32_DTYPES = frozenset({"torch.float32", "torch.float"})
_FP16_DTYPES = frozenset({"torch.float16", "torch.half"})


def _swap(state: Effect) -> Effect:
    """The effect of the negated test: the two branches trade places."""
    return state[1], state[0]


def _is_flag(facts: ScriptFacts, name: str, scalers: frozenset[str]) -> bool:
    return _flag(facts, name, scalers) == (ON, OFF)


def _flag(facts: ScriptFacts, name: str, scalers: frozenset[str]) -> Effect:
    """A name's effect as a test: AMP flags (ON, OFF), fp32 flags (OFF, ON), else nothing."""
    if name in scalers or name in facts.enabled_flags:
        return ON, OFF
    words = set(re.split(r"[_\W]+", name.rsplit(".", 1)[-1].lower()))
    if words & _FLAG_WORDS and not words & _NOT_FLAG_WORDS:
        return ON, OFF
    if words & _FP32_FLAG_WORDS and not words & _FLAG_WORDS:
        return OFF, ON
    return None, None


def _name(test: ast.expr) -> str | None:
    """``a.b``, and the key of ``cfg["use_fp16"]`` / ``cfg.get("use_fp16")``."""
    name = dotted(test)
    if name is not None:
        return name
    if isinstance(test, ast.Subscript) and (key := string_value(test.slice)) is not None:
        return str(key)
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "get" \
            and (written := arguments(test)) and (key := string_value(written[0].value)) is not None:
        return str(key)
    return None


def effect(facts: ScriptFacts, test: ast.expr, scalers: frozenset[str]) -> Effect:
    """The AMP state in the branch where ``test`` holds, and in the one where it does not."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _swap(effect(facts, test.operand, scalers))
    if isinstance(test, ast.BoolOp):  # `a and b and c` read as `(a and b) and c`
        state = effect(facts, test.values[0], scalers)
        for value in test.values[1:]:
            state = _both(isinstance(test.op, ast.And), state, effect(facts, value, scalers))
        return state
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return _comparison(facts, test, scalers)
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr == "is_enabled":
        return (ON, OFF) if _is_flag(facts, dotted(test.func.value) or "", scalers) else (None, None)
    name = _name(test)
    return _flag(facts, name, scalers) if name else (None, None)


def _both(conjunction: bool, left: Effect, right: Effect) -> Effect:
    """The effect of ``left and right`` (``conjunction``) or ``left or right``."""
    # A part that is no AMP switch (`torch.cuda.is_available()`) is taken as the
    # environment: the switch decides both branches.
    if right == (None, None):
        return left
    if left == (None, None):
        return right
    if conjunction:  # true: both hold; false: one fails
        return left[0] or right[0], left[1] if left[1] == right[1] else None
    return left[0] if left[0] == right[0] else None, left[1] or right[1]  # or


def _comparison(facts: ScriptFacts, test: ast.Compare, scalers: frozenset[str]) -> Effect:
    operator, other = test.ops[0], test.comparators[0]
    equal = isinstance(operator, (ast.Eq, ast.Is))
    if not equal and not isinstance(operator, (ast.NotEq, ast.IsNot)):
        return None, None
    dtypes = facts.qualified(other)
    if dtypes & _FP32_DTYPES or dtypes & _FP16_DTYPES:  # dtype == torch.float32 / torch.float16
        state = (OFF, ON) if dtypes & _FP32_DTYPES else (ON, OFF)
        return state if equal else _swap(state)
    name = _name(test.left)
    if name is None:
        return None, None
    flag = _flag(facts, name, scalers)
    constant = isinstance(other, ast.Constant)
    if constant and (other.value is True or other.value is False):  # fp16 == True
        same = equal == other.value
        return flag if same else _swap(flag)
    if constant and other.value is None:  # scaler is None / is not None
        if flag == (None, None) and name not in scalers:
            return None, None
        return (OFF, ON) if equal else (ON, OFF)
    string = string_value(other)
    if flag == (ON, OFF) and (isinstance(other, (ast.Name, ast.Attribute)) or string is not None):
        # amp_type == AmpType.PYTORCH / "pytorch": one kind of AMP (AmpType.NONE: none of them)
        spelled = str(string) if string is not None else dotted(other) or ""
        spelled = spelled.rsplit(".", 1)[-1]
        off = spelled.lower() in _OFF_CONSTANTS or bool(_FP32_STRING.match(spelled))
        state = (OFF, ON) if off else (ON, OFF)
        return state if equal else _swap(state)
    if string is None:
        return None, None
    value = str(string)  # precision == "16-mixed", dtype == "float16"
    state = OFF if _FP32_STRING.match(value) else ON if _LOW_STRING.search(value) and "bf" not in value else None
    if state is None:
        return None, None
    both = (state, OFF if state == ON else ON)
    return both if equal else _swap(both)


def decide(facts: ScriptFacts, guards: tuple[Guard, ...], scalers: frozenset[str]) -> tuple[str | None, str | None]:
    """(state, the guard as the user wrote it) for code under ``guards``: the innermost AMP
    switch decides; (None, None) when none of them is one."""
    for test, held in reversed(guards):
        when_true, when_false = effect(facts, test, scalers)
        state = when_true if held else when_false
        if state is not None:
            text = facts.code(test)
            return state, f"`{text}`" if held else f"not `{text}`"
    return None, None


@per_file
def amp_state(facts: ScriptFacts, call: Call) -> tuple[str | None, str | None]:
    """The AMP state of a call's path: "on", "off" or None, and the guard that says so.
    Every protocol rule asks it of the same calls: decided once per call."""
    return decide(facts, call.guards, facts.scalers(call.scope))
