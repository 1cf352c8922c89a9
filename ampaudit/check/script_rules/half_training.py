"""AMP411: model.half() on a model that is then trained: no fp32 master weights, and
BatchNorm statistics in fp16."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.masters import READS, handled
from ampaudit.check.lint.protocol import finding, half_casts
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding


@lint_rule("AMP411", reads=("half", "float16", r"\.train\(", "optim", *READS))
def half_model_training(facts: ScriptFacts) -> Iterator[Finding]:
    for model, call in half_casts(facts):
        if handled(facts, model, call, masters=True):
            continue  # an optimizer that keeps fp32 masters (FP16_Optimizer, FusedLAMBAMP...)
        batchnorm = " (BatchNorm kept in fp32)" if _keeps_norms(facts, call) else ", BatchNorm statistics in fp16"
        yield finding(facts, "AMP411", call, model=model, batchnorm=batchnorm,
                      fix="keep the model fp32 and train under torch.autocast, or use ampaudit.convert")


_NORM = re.compile(r"norm|\bbn", re.IGNORECASE)


def _keeps_norms(facts: ScriptFacts, cast: Call) -> bool:
    """The cast leaves normalisation layers in fp32: it runs only for the modules that are not
    (``if not isinstance(m, nn.BatchNorm2d): m.half()``), or the same function casts them back
    (``if isinstance(m, BatchNorm): m.float()``)."""
    if any(_NORM.search(facts.text(test)) for test, _ in cast.guards):
        return True
    return any(c.method == "float" and any(_NORM.search(facts.text(test)) for test, _ in c.guards)
               for c in facts.calls_in(cast.scope))
