"""AMP411: model.half() on a model that is then trained: no fp32 master weights, and
BatchNorm statistics in fp16."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.masters import READS, handled
from ampaudit.check.lint.protocol import finding, half_casts
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP411", reads=("half", "float16", r"\.train\(", "optim", *READS))
def half_model_training(facts: ScriptFacts) -> Iterator[Finding]:
    for model, call in half_casts(facts):
        if handled(facts, model, call, masters=True):
            continue  # an optimizer that keeps fp32 masters (FP16_Optimizer, FusedLAMBAMP...)
        yield finding(facts, "AMP411", call, model=model,
                      fix="keep the model fp32 and train under torch.autocast, or use ampaudit.convert")
