"""AMP403: fp16 autocast and backward() in one function, but no GradScaler in sight (nor a
callable wrapping one, such as timm's ``loss_scaler(loss, optimizer)``) - or a GradScaler
that is optional while the autocast is not: ignite's ``supervised_training_step_amp`` shape,
``with autocast("cuda", enabled=True)`` and then ``if scaler: ... else: loss.backward()``,
whose ``else`` trains in fp16 without loss scaling."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import Autocast, Call, Scope, ScriptFacts
from ampaudit.check.lint.guards import OFF, amp_state
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import backward_calls, finding, is_raw_backward, softened
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
            found = finding(facts, "AMP403", block, where="in this function",
                            fix='create scaler = torch.amp.GradScaler("cuda") and call scaler.scale(loss).backward()')
            # the dtype is a variable: an error only if it is float16
            yield softened(found, f"if {block.dtype_text} is float16") if maybe_fp16 else found
        elif block.dtype is FLOAT16:
            yield from _optional_scaler(facts, block)


def _optional_scaler(facts: ScriptFacts, block: Autocast) -> Iterator[Finding]:
    """backward() on the branch that turns AMP off (``else: loss.backward()`` after ``if
    scaler:``), after an fp16 autocast that no switch turns off: neither its ``enabled=`` (an
    expression ties it to the switch) nor a branch around it."""
    if block.switched or _block_state(facts, block) is not None:
        return
    for call in facts.calls_in(block.scope):
        if call.line <= block.line or not is_raw_backward(facts, call):
            continue
        state, guard = amp_state(facts, call)
        if state == OFF:
            yield finding(facts, "AMP403", call,
                          where=f"on the path where {guard} (the autocast at line {block.line} is float16 in "
                                f"every run)",
                          fix="scale the loss on this path too, or tie the autocast to the same condition: "
                              "autocast(\"cuda\", enabled=<the condition>)")


def _block_state(facts: ScriptFacts, block: Autocast) -> str | None:
    """The AMP state of the ``with`` statement itself: read off the calls in its header (the
    autocast call), or else the call inside it under the fewest conditions."""
    inside: list[Call] = [c for c in facts.calls_in(block.scope) if c.autocast is block]
    if not inside:
        return OFF  # nothing runs under it: not worth a finding
    header = [c for c in inside if c.line == block.line]
    return amp_state(facts, min(header or inside, key=lambda c: len(c.guards)))[0]


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
