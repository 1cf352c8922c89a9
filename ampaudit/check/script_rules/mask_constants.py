"""AMP414: a mask or fill constant that fp16 cannot hold, in source: a literal beyond 65504,
or ``torch.finfo(torch.float32).min/max`` (the twin of the graph rule AMP201, for scripts).
Fix (unsafe: changes the value): ``torch.finfo(x.dtype).min/max`` of the filled tensor."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.nodes import arguments
from ampaudit.check.lint.protocol import finding
from ampaudit.check.lint.values import literal_number
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding
from ampaudit.core.rulebook import rule

_FP32 = frozenset({"torch.float32", "torch.float"})


def _value_args(call: Call) -> list[ast.expr]:
    """The arguments of a fill-like call that become tensor data (rules.toml AMP414.params)."""
    table = rule("AMP414").params
    slots = table["methods"].get(call.method or "") if call.receiver else None
    if slots is None:
        slots = next((table["functions"][n] for n in call.names if n in table["functions"]), None)
    values = []
    for slot in slots or ():
        value = call.arg(slot) if isinstance(slot, int) else call.kwarg(slot)
        if value is not None:
            values.append(value)
    return values


def _limited_dtype(facts: ScriptFacts, call: Call, value: ast.expr) -> str:
    """The dtype expression whose finfo the hint names: the filled tensor's, where the call says."""
    if call.receiver and call.method in rule("AMP414").params["methods"]:
        return f"{call.receiver}.dtype"
    table = rule("AMP414").params["dtype_from"]
    source = next((table[n] for n in call.names if n in table), None)
    if source == "dtype":
        given = call.kwarg("dtype")
        return facts.text(given) if given is not None else "torch.float16"
    if source == "other":
        branches = [call.arg(1, "input"), call.arg(2, "other")]
        tensor = next((b for b in branches if b is not None and b is not value), None)
    else:
        tensor = call.arg(source) if isinstance(source, int) else None
    if tensor is None or literal_number(tensor) is not None:
        return "torch.float16"
    return f"{facts.text(tensor)}.dtype"


def _finfo_fp32_limit(facts: ScriptFacts, node: ast.expr) -> str | None:
    """'min' or 'max' for ``torch.finfo(torch.float32).min`` / ``.max``."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    if not (isinstance(node, ast.Attribute) and node.attr in ("min", "max")):
        return None
    call = node.value
    if not isinstance(call, ast.Call) or "torch.finfo" not in facts.qualified(call.func):
        return None
    written = arguments(call)
    return node.attr if written and facts.qualified(written[0].value) & _FP32 else None


@lint_rule("AMP414", reads=("fill", "full", "where", "clamp", "finfo"))
def mask_constants(facts: ScriptFacts) -> Iterator[Finding]:
    limit = rule("AMP414").params["float16_max"]
    for call in facts.calls:
        for value in _value_args(call):
            number = literal_number(value)
            bound = _finfo_fp32_limit(facts, value)
            if number is not None and abs(number) > limit:
                shown = facts.text(value)
                which = "min" if number < 0 else "max"
            elif bound is not None:
                shown, which = facts.text(value), bound
            else:
                continue
            replacement = f"torch.finfo({_limited_dtype(facts, call, value)}).{which}"
            autofix = None
            # the fix writes torch.finfo: only where the file binds torch (maybe as `th`)
            torch_name = facts.imports_map.name_for("torch")
            if call.receiver and call.method in ("masked_fill", "masked_fill_") and torch_name is not None:
                written = f"{torch_name}{replacement.removeprefix('torch')}"
                autofix = Autofix((edits.replace(facts, value, written),), safe=False)
            yield finding(facts, "AMP414", call, value=shown, replacement=replacement, fix=f"use {replacement}",
                          autofix=autofix)
