"""AMP103: a model whose config says it was trained in bfloat16, audited for float16."""

from __future__ import annotations

from collections.abc import Iterator

from ampaudit.check.graph_rules import graph_rule
from ampaudit.core.findings import Finding
from ampaudit.core.listing import IN_A_MESSAGE, listed
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule
from ampaudit.graph.view import GraphView


@graph_rule("AMP103")
def bf16_pretrained_in_fp16(view: GraphView) -> Iterator[Finding]:
    declared, info = view.declared, rule("AMP103")
    if (not view.model_wide or declared.loc is None or declared.trained_dtype not in info.params["trained"]
            or view.dtype.name not in info.params["audited"]):
        return
    if declared.fp32:
        names = listed([f"`{p}`" for p in declared.patterns], IN_A_MESSAGE)
        fix = (f"fine-tune in bfloat16 (audit with --dtype bfloat16), or keep {names} in fp32 as the model "
               "declares (the audit classifies them fp32)")
    else:
        fix = "fine-tune in bfloat16 (audit with --dtype bfloat16), or run the modules that overflow in fp32"
    yield info.finding(display_path(declared.loc.file), declared.loc.line, owner=declared.owner,
                       trained=declared.trained_dtype, dtype=view.dtype, fix=fix)
