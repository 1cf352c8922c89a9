"""What the AMP training protocol rules share: findings at a call, and who is who in a scope
(optimizers, scalers, backward calls, models cast to fp16)."""

from __future__ import annotations

import re
from typing import Any

import libcst as cst

from ampaudit.check.lint.facts import FLOAT16_NAMES, Call, Scope, ScriptFacts, dotted
from ampaudit.core.findings import Autofix, Finding
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule

CLIPS = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
                   "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_"})
ADAMS = frozenset({"torch.optim.Adam", "torch.optim.AdamW", "torch.optim.Adamax", "torch.optim.NAdam",
                   "torch.optim.RAdam", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW"})


def finding(facts: ScriptFacts, code: str, at: Any, *, fix: str | None = None,
            autofix: Autofix | None = None, **fields: Any) -> Finding:
    """A finding at a fact (anything with ``line`` and ``column``)."""
    return rule(code).finding(display_path(facts.path), at.line, column=at.column, fix=fix, autofix=autofix,
                              **fields)


def is_optimizer(call: Call) -> bool:
    return any(n.startswith("torch.optim.") and ".lr_scheduler" not in n and ".swa_utils" not in n
               for n in call.names)


# A receiver named like an optimizer (a function parameter, say): `optimizer.step()`,
# `opt.step()`, `self.optim.step()` - but not `env.step()` or `scheduler.step()`.
_OPTIMIZER_NAME = re.compile(r"(^|[._])(opt|optim|optimizer|optimiser)s?(_\w+)?$")


def optimizers(facts: ScriptFacts, scope: Scope) -> set[str]:
    """Names that hold an optimizer here: built from torch.optim, handed to a scaler, or
    named like one."""
    names = {a.target for a in facts.assignments if is_optimizer(a.call)
             and (a.call.scope is scope or a.call.scope.kind == "module")}
    names |= {c.receiver for c in facts.method_calls("step", scope)
              if c.receiver and _OPTIMIZER_NAME.search(c.receiver)}
    scalers = facts.scalers(scope)
    for call in facts.calls:
        if call.scope is scope and call.method in ("step", "unscale_") and call.receiver in scalers:
            target = dotted(call.arg(0, "optimizer"))
            if target:
                names.add(target)
    return names


def scaled_backward(call: Call, scalers: frozenset[str]) -> bool:
    """``s.scale(loss).backward()`` with ``s`` a scaler."""
    func = call.node.func
    if call.method != "backward" or not isinstance(func, cst.Attribute) or not isinstance(func.value, cst.Call):
        return False
    inner = func.value.func
    return isinstance(inner, cst.Attribute) and inner.attr.value == "scale" and dotted(inner.value) in scalers


def backward_calls(facts: ScriptFacts, scope: Scope) -> list[Call]:
    return [c for c in facts.calls if c.scope is scope and c.method == "backward"]


def scaler_in_use(facts: ScriptFacts, scope: Scope) -> set[str]:
    """Scalers this scope actually uses (scale / step / unscale_ / update)."""
    scalers = facts.scalers(scope)
    return {c.receiver for c in facts.calls if c.scope is scope and c.receiver in scalers
            and c.method in ("scale", "step", "unscale_", "update")}


def is_float16(facts: ScriptFacts, node: cst.BaseExpression | None) -> bool:
    return node is not None and bool(facts.qualified(node) & FLOAT16_NAMES)


def half_casts(facts: ScriptFacts) -> list[tuple[str, Call]]:
    """(model name, call) for ``m.half()`` / ``m.to(torch.float16)`` whose model is trained:
    its parameters go to an optimizer, or it is put in train mode."""
    trained = set()
    for call in facts.calls:
        if is_optimizer(call) and call.node.args:
            first = call.node.args[0].value
            if isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute) \
                    and first.func.attr.value == "parameters":
                name = dotted(first.func.value)
                if name:
                    trained.add(name)
        if call.method == "train" and call.receiver:
            trained.add(call.receiver)
    targets = {id(a.call.node): a.target for a in facts.assignments}
    casts = []
    for call in facts.calls:
        to_half = call.method == "half" or (call.method == "to" and (
            is_float16(facts, call.arg(0, "dtype")) or is_float16(facts, call.arg(1))))
        if not to_half:
            continue
        name = targets.get(id(call.node), call.receiver)  # model = Net().half() or model.half()
        if name in trained:
            casts.append((name, call))
    return casts
