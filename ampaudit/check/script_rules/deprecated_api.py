"""AMP401: deprecated torch.cuda.amp / torch.cpu.amp APIs, in calls, decorators and imports.

Fix (safe): the torch.amp spelling with the device made explicit -
``torch.cuda.amp.autocast(...)`` -> ``torch.amp.autocast("cuda", ...)``,
``@torch.cuda.amp.custom_fwd`` -> ``@torch.amp.custom_fwd(device_type="cuda")``. A name
imported from the old module is fixed together with the import and every use of it - or,
when some use cannot be fixed, not at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import libcst as cst

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import Import, ScriptFacts, dotted
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Edit, Finding

# old qualified name -> (new qualified name, device, device passed positionally?)
_DEPRECATED = {
    "torch.cuda.amp.autocast": ("torch.amp.autocast", "cuda", True),
    "torch.cpu.amp.autocast": ("torch.amp.autocast", "cpu", True),
    "torch.cuda.amp.GradScaler": ("torch.amp.GradScaler", "cuda", True),
    "torch.cuda.amp.custom_fwd": ("torch.amp.custom_fwd", "cuda", False),
    "torch.cuda.amp.custom_bwd": ("torch.amp.custom_bwd", "cuda", False),
}
_OLD_MODULES = ("torch.cuda.amp", "torch.cpu.amp")


@dataclass
class _Use:
    at: Any  # the call or decorator fact: where the finding goes
    callee: cst.BaseExpression
    call: cst.Call | None  # None for a bare decorator
    old: str


def _device(old: str) -> str:
    _, device, positional = _DEPRECATED[old]
    return f'"{device}"' if positional else f'device_type="{device}"'


def _uses(facts: ScriptFacts) -> list[_Use]:
    uses, seen = [], set()
    for deco in facts.decorators:
        old = next((n for n in deco.names if n in _DEPRECATED), None)
        if old is not None:
            call = deco.node.decorator if isinstance(deco.node.decorator, cst.Call) else None
            uses.append(_Use(deco, call.func if call is not None else deco.node.decorator, call, old))
            seen.add(id(call))
    for c in facts.calls:
        old = next((n for n in c.names if n in _DEPRECATED), None)
        if old is not None and id(c.node) not in seen:
            uses.append(_Use(c, c.node.func, c.node, old))
    return uses


def _device_edit(facts: ScriptFacts, use: _Use) -> Edit:
    if use.call is not None:
        return edits.first_argument_insertion(facts, use.call, _device(use.old))
    _, end = facts.span(use.callee)
    return edits.insert_at(end, f"({_device(use.old)})")  # a bare decorator becomes a call


def _bound_names(imp: Import) -> set[str]:
    return {bound for _, bound in imp.names}


def _all_uses_fixable(facts: ScriptFacts, imp: Import, uses: list[_Use]) -> bool:
    """Every reference to the imported names is a call or decorator we rewrite."""
    fixed = {id(u.callee) for u in uses}
    return all(id(ref) in fixed for name in _bound_names(imp) for ref in facts.references(imp.node, name))


@lint_rule("AMP401", reads=("autocast", "GradScaler", "custom_[fb]wd", r"\bamp\b"))
def deprecated_amp_api(facts: ScriptFacts) -> Iterator[Finding]:
    uses = _uses(facts)
    imports = [i for i in facts.imports if i.module in _OLD_MODULES and isinstance(i.node, cst.ImportFrom)]
    by_name = {bound: imp for imp in imports for bound in _bound_names(imp)}
    groups: dict[int, tuple[Edit, ...] | None] = {}
    for imp in imports:
        members = [u for u in uses if isinstance(u.callee, cst.Name) and by_name.get(u.callee.value) is imp]
        fixable = _all_uses_fixable(facts, imp, uses)
        groups[id(imp)] = (edits.replace(facts, imp.node.module, "torch.amp"),
                           *(_device_edit(facts, u) for u in members)) if fixable else None
        yield finding(facts, "AMP401", imp, old=f"from {imp.module} import", new="from torch.amp import",
                      fix="import from torch.amp and pass the device to each use",
                      autofix=Autofix(groups[id(imp)]) if groups[id(imp)] else None)
    for use in uses:
        new = _DEPRECATED[use.old][0]
        imp = by_name.get(use.callee.value) if isinstance(use.callee, cst.Name) else None
        if imp is not None:
            fix_edits = groups[id(imp)]
        elif dotted(use.callee) == use.old:  # spelled out in full: rename in place
            fix_edits = (edits.replace(facts, use.callee, new), _device_edit(facts, use))
        else:
            fix_edits = None  # an alias such as `amp.autocast`: left to the user
        yield finding(facts, "AMP401", use.at, old=use.old, new=f"{new}({_device(use.old)}, ...)",
                      fix=f"use {new} and pass {_device(use.old)}",
                      autofix=Autofix(fix_edits) if fix_edits else None)
