"""AMP409 / AMP410: a GradScaler that cannot help - with bf16 autocast, or fp16 parameters.

AMP409 also hears a scaler the file does not build (I-JEPA: ``optimizer, scaler = init_opt(...)``
from a helper module; VideoMAEv2: ``loss_scaler(loss, optimizer)``, timm's NativeScaler built in
another file) when the function that scales its loss autocasts only to bf16: said at the
``scaler.scale(loss)`` or ``loss_scaler(...)`` there, since the construction is out of sight."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, Call, ScriptFacts
from ampaudit.check.lint.masters import READS, handled, unscales
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import backward_scaler, finding, half_casts
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.dtypes import BFLOAT16
from ampaudit.core.findings import Finding


@lint_rule("AMP409", "AMP410", reads=("GradScaler", "autocast", "bfloat16", "half", "float16", *READS))
def useless_scaler(facts: ScriptFacts) -> Iterator[Finding]:
    dtypes = {block.dtype for block in facts.autocasts if block.enabled}
    if not any(facts.calls_to(GRAD_SCALERS)):
        if not _FP8.search(facts.source):
            yield from _foreign_scalers(facts)
        return
    creations = [c for c in facts.calls_to(GRAD_SCALERS) if not c.disabled]
    # GradScaler.step() leaves an optimizer that does its own scaling to it: no unscale_(), no
    # crash - unless the script unscales it itself
    halves = [(model, cast) for model, cast in half_casts(facts)
              if not (handled(facts, model, cast, masters=False) and not unscales(facts, model))]
    for scaler in creations:
        if dtypes == {BFLOAT16}:
            yield finding(facts, "AMP409", scaler, fix="drop the GradScaler: bf16 has fp32's exponent range")
        elif halves:
            yield finding(facts, "AMP410", scaler, model=halves[0][0],
                          fix="keep the model in fp32 and use torch.autocast, or use ampaudit.convert")


def _foreign_scalers(facts: ScriptFacts) -> Iterator[Finding]:
    """AMP409 at the first ``scaler.scale(loss)`` of each scaler built outside the file, in a
    function whose own autocast blocks are all bf16 (an fp16 one in an eval function elsewhere
    in the file - VideoMAEv2's - scales no loss)."""
    said: set[str] = set()
    for scope in facts.scopes():
        if {b.dtype for b in facts.autocasts if b.enabled and b.scope is scope} != {BFLOAT16}:
            continue  # no autocast here: the loss may come from another file's, of another dtype
        scalers = facts.scalers(scope)
        for call in facts.calls_in(scope):
            scaler = backward_scaler(facts, call, scalers)
            if scaler is not None:
                at = next((c for c in facts.calls_in(scope) if c.method == "scale" and c.receiver == scaler), call)
            elif _wrapper_call(call):  # timm's NativeScaler: loss_scaler(loss, optimizer, ...)
                scaler, at = dotted(call.node.func), call
            if scaler is None or scaler in said:
                continue
            said.add(scaler)
            yield finding(facts, "AMP409", at, fix="drop the GradScaler: bf16 has fp32's exponent range")


# FP8 training (MS-AMP, Transformer Engine, torchao) scales FP8 gradients with the scaler whatever
# the autocast dtype: accelerate's MS-AMP benchmarks take theirs from a helper under bf16 autocast
_FP8 = re.compile(r"fp8|float8|msamp|transformer_engine", re.IGNORECASE)

# what timm-style trainers call the GradScaler wrapper they build elsewhere (NativeScaler):
# `loss_scaler(loss, optimizer, clip_grad=...)` scales, backwards and steps
_WRAPPER = re.compile(r"(^|[._])(loss_|amp_|grad_)?scaler$")


def _wrapper_call(call: Call) -> bool:
    return len(call.node.args) >= 2 and bool(_WRAPPER.search(dotted(call.node.func) or ""))
