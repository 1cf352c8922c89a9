"""AMP403: fp16 autocast and backward() in one function, but no GradScaler in sight (nor a
callable wrapping one, such as timm's ``loss_scaler(loss, optimizer)``)."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import Scope, ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import backward_calls, finding, softened
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.dtypes import FLOAT16
from ampaudit.core.findings import Finding


@lint_rule("AMP403", reads=("autocast", "backward", "GradScaler", "scaler"))
def fp16_autocast_without_scaler(facts: ScriptFacts) -> Iterator[Finding]:
    for block in facts.autocasts:
        maybe_fp16 = block.dtype is None and block.dtype_text is not None and _mentions_float16(facts)
        if not (block.dtype is FLOAT16 or maybe_fp16) or not block.enabled:
            continue
        if backward_calls(facts, block.scope) and not facts.scalers(block.scope) \
                and not _scaler_wrapper_called(facts, block.scope):
            found = finding(facts, "AMP403", block,
                            fix='create scaler = torch.amp.GradScaler("cuda") and call scaler.scale(loss).backward()')
            # the dtype is a variable: an error only if it is float16
            yield softened(found, f"if {block.dtype_text} is float16") if maybe_fp16 else found


def _mentions_float16(facts: ScriptFacts) -> bool:
    return any(word in facts.source for word in ("float16", "torch.half", "fp16"))


def _scaler_wrapper_called(facts: ScriptFacts, scope: Scope) -> bool:
    """A callable that wraps a GradScaler is called with the loss: timm/ConvNeXt's
    ``loss_scaler(loss, optimizer, ...)`` scales, steps and updates for you."""
    for call in facts.calls_in(scope):
        if call.method is None and call.arg(0) is not None:
            name = (dotted(call.node.func) or "").rsplit(".", 1)[-1].lower()
            if "scaler" in name:
                return True
    return False
