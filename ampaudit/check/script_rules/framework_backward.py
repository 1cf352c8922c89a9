"""AMP423 / AMP424: mixed precision owned by a framework, and code that steps around it.

AMP423: accelerate with ``mixed_precision="fp16"`` scales in ``accelerator.backward`` and
unscales in ``accelerator.clip_grad_norm_``; torch's own clip after it sees scaled gradients.
AMP424: in a LightningModule, ``self.manual_backward(loss)`` is what Lightning's precision
plugin scales; a raw ``loss.backward()`` is not (an error when the file's Trainer uses a
16-bit precision, else a warning).
Fixes (unsafe: they change what runs): ``accelerator.clip_grad_norm_(...)``,
``self.manual_backward(loss)``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import replace

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import CLIPS, finding, is_raw_backward, softened
from ampaudit.check.lint.values import literal_integer, string_value
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding, Severity
from ampaudit.core.rulebook import rule

_ACCELERATORS = frozenset({"accelerate.Accelerator", "accelerate.accelerator.Accelerator"})
_LIGHTNING_MODULES = frozenset({"lightning.LightningModule", "lightning.pytorch.LightningModule",
                                "pytorch_lightning.LightningModule", "lightning.pytorch.core.module.LightningModule",
                                "pytorch_lightning.core.module.LightningModule"})
_TRAINERS = frozenset({"lightning.Trainer", "lightning.pytorch.Trainer", "pytorch_lightning.Trainer"})


def _fp16(call) -> bool | None:
    """True for ``mixed_precision="fp16"``, None when not a literal, False otherwise."""
    value = call.kwarg("mixed_precision")
    if value is None:
        return False
    text = string_value(value)
    return text == "fp16" if text is not None else None


@lint_rule("AMP423", reads=("clip_grad", "accelerator", "Accelerator"))
def torch_clip_after_accelerator_backward(facts: ScriptFacts) -> Iterator[Finding]:
    accelerators = {a.target: _fp16(a.call) for a in facts.assignments if a.call.names & _ACCELERATORS}
    if not any(state is not False for state in accelerators.values()):
        return
    for clip in facts.calls_to(CLIPS):
        backwards = [c for c in facts.calls_in(clip.scope) if c.method == "backward"
                     and c.receiver in accelerators and accelerators[c.receiver] is not False and c.line < clip.line]
        if not backwards:
            continue
        accelerator = backwards[-1].receiver
        method = "clip_grad_value_" if "value" in facts.text(clip.node.func) else "clip_grad_norm_"
        autofix = Autofix((edits.replace(facts, clip.node.func, f"{accelerator}.{method}"),), safe=False) \
            if _accelerate_takes(clip.node, _ACCELERATE_PARAMETERS[method]) else None
        found = finding(facts, "AMP423", clip, clip=facts.text(clip.node.func), accelerator=accelerator,
                        fix=f"{accelerator}.{method}(...)", autofix=autofix)
        # mixed_precision=<expression>: fp16 in some runs
        yield softened(found, "when it is fp16") if accelerators[accelerator] is None else found


@lint_rule("AMP424", reads=("LightningModule", "backward", "Trainer"))
def backward_in_lightning_module(facts: ScriptFacts) -> Iterator[Finding]:
    modules = [c for c in facts.classes if c.bases & _LIGHTNING_MODULES]
    if not modules:
        return
    severe = _sixteen_bit_trainer(facts)
    for call in facts.calls:
        if not is_raw_backward(facts, call) or call.receiver is None:
            continue
        if not any(_inside(facts, m.node, call.line) for m in modules):
            continue
        # backward's own arguments (retain_graph=True) go on: manual_backward passes them through
        _, end = facts.span(call.node)
        opening = facts.source.index("(", facts.span(call.node.func)[1])
        passed = facts.source[opening + 1:end - 1].strip() if call.has_arguments else ""
        fixed = f"self.manual_backward({call.receiver}{', ' + passed if passed else ''})"
        autofix = Autofix((edits.replace(facts, call.node, fixed),), safe=False)
        found = finding(facts, "AMP424", call, call=f"{call.receiver}.backward()",
                        fix=f"self.manual_backward({call.receiver})", autofix=autofix)
        yield replace(found, severity=Severity.ERROR) if severe else found


# what accelerate's Accelerator.clip_grad_norm_ / clip_grad_value_ take, in order: torch's
# error_if_nonfinite= and foreach= would be a TypeError there
_ACCELERATE_PARAMETERS = {"clip_grad_norm_": ("parameters", "max_norm", "norm_type"),
                          "clip_grad_value_": ("parameters", "clip_value")}


def _accelerate_takes(call: ast.Call, parameters: tuple[str, ...]) -> bool:
    if len(call.args) > len(parameters) or any(isinstance(a, ast.Starred) for a in call.args):
        return False
    return all(k.arg in parameters[len(call.args):] for k in call.keywords)  # `**kw`: arg None


def _inside(facts: ScriptFacts, node: ast.ClassDef, line: int) -> bool:
    start, end = facts.lines(node)
    return start <= line <= end


def _sixteen_bit_trainer(facts: ScriptFacts) -> bool:
    wanted = set(rule("AMP424").params["error_when_precision"])
    for call in facts.calls_to(_TRAINERS):
        value = call.kwarg("precision")
        text = string_value(value)
        if text is not None and str(text) in wanted:
            return True
        if literal_integer(value) and facts.text(value) in wanted:  # as written: `16`
            return True
    return False
