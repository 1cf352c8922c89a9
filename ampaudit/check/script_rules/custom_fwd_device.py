"""AMP418: ``torch.amp.custom_fwd`` / ``custom_bwd`` without ``device_type=``, a TypeError
when the class is defined. Fix (unsafe: it picks the device): ``device_type="cuda"``."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Finding

_NEW = frozenset({"torch.amp.custom_fwd", "torch.amp.custom_bwd", "torch.amp.autocast_mode.custom_fwd",
                  "torch.amp.autocast_mode.custom_bwd"})


@lint_rule("AMP418", reads=(r"custom_[fb]wd",))
def custom_fwd_without_device_type(facts: ScriptFacts) -> Iterator[Finding]:
    for deco in facts.decorators:
        if not deco.names & _NEW:
            continue
        node = deco.node
        if isinstance(node, ast.Call):
            if any(k.arg == "device_type" for k in node.keywords):
                continue
            edit = edits.keyword_insertion(facts, node, 'device_type="cuda"')
            name = facts.text(node.func)
        else:
            _, end = facts.span(node)
            edit = edits.insert_at(end, '(device_type="cuda")')
            name = facts.text(node)
        yield finding(facts, "AMP418", deco, decorator=name, fix=f'@{name}(device_type="cuda")',
                      autofix=Autofix((edit,), safe=False))
