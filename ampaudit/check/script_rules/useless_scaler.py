"""AMP409 / AMP410: a GradScaler that cannot help - with bf16 autocast, or fp16 parameters."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, ScriptFacts
from ampaudit.check.lint.masters import READS, handled, unscales
from ampaudit.check.lint.protocol import finding, half_casts
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.dtypes import BFLOAT16
from ampaudit.core.findings import Finding


@lint_rule("AMP409", "AMP410", reads=("GradScaler", "autocast", "bfloat16", "half", "float16", *READS))
def useless_scaler(facts: ScriptFacts) -> Iterator[Finding]:
    creations = [c for c in facts.calls_to(GRAD_SCALERS) if not c.disabled]
    if not creations:
        return
    dtypes = {block.dtype for block in facts.autocasts if block.enabled}
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
