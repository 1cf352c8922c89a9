"""AMP401: deprecated torch.cuda.amp / torch.cpu.amp APIs, in calls, decorators and imports.

Fix (safe): the torch.amp spelling with the device made explicit -
``torch.cuda.amp.autocast(...)`` -> ``torch.amp.autocast("cuda", ...)``,
``@torch.cuda.amp.custom_fwd`` -> ``@torch.amp.custom_fwd(device_type="cuda")``. A name
imported from the old module, or the module under an alias (``from torch.cuda import amp``,
``import torch.cuda.amp as amp``), is fixed together with the import and every use of it -
or, when some use cannot be fixed, not at all. A reference that is not called
(``ac = torch.cuda.amp.autocast``, ``partial(torch.cuda.amp.GradScaler, ...)``) is reported
without a fix. Code in a fallback for old torch (``try``/``except ImportError``, a branch
on the torch version or on a flag assigned from it, a name spelled as a torch version flag:
lint/versions.py) is left alone: it is there on purpose. In a file that shows it runs on
older torch (``versions.supports_old_torch``), a rewrite to ``torch.amp.GradScaler`` (torch
2.3) or ``torch.amp.custom_fwd``/``custom_bwd`` (2.4) is unsafe: it fails there.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ampaudit.check.lint import edits, versions
from ampaudit.check.lint.facts import Import, ScriptFacts
from ampaudit.check.lint.imports import amp_public_name
from ampaudit.check.lint.memo import per_file
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Autofix, Edit, Finding
from ampaudit.core.listing import IN_A_MESSAGE, listed

# old qualified name -> (new qualified name, device, device passed positionally?)
_DEPRECATED = {
    "torch.cuda.amp.autocast": ("torch.amp.autocast", "cuda", True),
    "torch.cpu.amp.autocast": ("torch.amp.autocast", "cpu", True),
    "torch.cuda.amp.GradScaler": ("torch.amp.GradScaler", "cuda", True),
    "torch.cpu.amp.GradScaler": ("torch.amp.GradScaler", "cpu", True),
    "torch.cuda.amp.custom_fwd": ("torch.amp.custom_fwd", "cuda", False),
    "torch.cuda.amp.custom_bwd": ("torch.amp.custom_bwd", "cuda", False),
}
# the new spellings torch added late: a file that still runs on older torch cannot take them
# safely (torch.amp.autocast("cuda", ...) runs on every torch 2)
_SINCE = {"torch.amp.GradScaler": "2.3", "torch.amp.custom_fwd": "2.4", "torch.amp.custom_bwd": "2.4"}
_OLD_MODULES = ("torch.cuda.amp", "torch.cpu.amp")
# the modules that define the old classes: imported from, they are the same deprecated classes
# (nerfstudio's `from torch.cuda.amp.grad_scaler import GradScaler`); torch.amp has its own
_OLD_SUBMODULES = {f"torch.{device}.amp.{module}": f"torch.amp.{module}"
                   for device in ("cuda", "cpu") for module in ("grad_scaler", "autocast_mode")}


@dataclass
class _Use:
    at: Any  # the call or decorator fact: where the finding goes
    callee: ast.expr
    call: ast.Call | None  # None for a bare decorator
    old: str


def _needs(olds: Iterable[str]) -> str | None:
    """The newest torch the rewrite of ``olds`` needs, where it is one torch added late."""
    since = [_SINCE[new] for old in olds if (new := _DEPRECATED.get(old, ("",))[0]) in _SINCE]
    return max(since, key=lambda v: tuple(map(int, v.split(".")))) if since else None


def _needs(olds: Iterable[str]) -> str | None:
    """The torch a rewrite of ``olds`` needs, where one of them is a spelling torch added late."""
    since = [_SINCE[new] for old in olds if (new := _DEPRECATED.get(old, ("",))[0]) in _SINCE]
    return max(since, key=lambda v: tuple(map(int, v.split(".")))) if since else None


def _public(name: str) -> str:
    """``torch.cuda.amp.grad_scaler.GradScaler`` as ``torch.cuda.amp.GradScaler``."""
    return amp_public_name(name) or name


def _device(old: str) -> str:
    _, device, positional = _DEPRECATED[old]
    return f'"{device}"' if positional else f'device_type="{device}"'


def _uses(facts: ScriptFacts) -> list[_Use]:
    uses, seen = [], set()
    for deco in facts.decorators:
        old = next((n for n in deco.names if n in _DEPRECATED), None)
        if old is not None:
            call = deco.node if isinstance(deco.node, ast.Call) else None
            uses.append(_Use(deco, call.func if call is not None else deco.node, call, old))
            seen.add(id(call))
    for c in facts.calls:
        old = next((n for n in c.names if n in _DEPRECATED), None)
        if old is not None and id(c.node) not in seen and not c.compat:
            uses.append(_Use(c, c.node.func, c.node, old))
    return uses


def _module_aliases(facts: ScriptFacts) -> dict[str, Import]:
    """Names bound to an old amp module: ``from torch.cuda import amp``, ``import torch.cuda.amp as amp``."""
    found = {}
    for imp in facts.imports:
        if imp.compat:
            continue
        for name, bound in imp.names:
            full = f"{imp.module}.{name}" if isinstance(imp.node, ast.ImportFrom) else name
            if full in _OLD_MODULES and (isinstance(imp.node, ast.ImportFrom) or bound != name.split(".")[0]):
                found[bound] = imp
    return found


def _alias_fix(facts: ScriptFacts, imp: Import, bound: str, uses: list[_Use]) -> tuple[Edit, ...] | None:
    """Point the alias at torch.amp and give every use its device - if every reference to
    the alias is such a use, and the import binds nothing else."""
    members = [u for u in uses if isinstance(u.callee, ast.Attribute) and dotted(u.callee.value) == bound]
    bases = {id(u.callee.value) for u in members}
    named = facts.annotation_references | _class_tests(facts)  # `amp.GradScaler` as a class: renamed too
    if len(imp.names) != 1 or not members or any(id(r) not in bases and id(r) not in named
                                                  for r in facts.references(bound)):
        return None
    node = imp.node
    if isinstance(node, ast.ImportFrom):  # from torch.cuda import amp -> from torch import amp
        fixed = edits.rename_module(facts, node, "torch")
    else:  # import torch.cuda.amp as amp -> import torch.amp as amp
        name, bound = imp.names[0]
        alias = next(a for a in node.names if a.name == name and a.asname == bound)
        fixed = edits.rename_module(facts, node, "torch.amp", alias)
    return _all_edits(facts, fixed, members)


# torch.cuda.amp.autocast(enabled, dtype, cache_enabled) but torch.amp.autocast(device_type,
# dtype, enabled, cache_enabled): a positional argument is named, or `autocast(True)` would
# become `autocast("cuda", True)` - dtype=True, a TypeError when the block is entered
_AUTOCAST_POSITIONAL = ("enabled", "dtype", "cache_enabled")


def _device_edits(facts: ScriptFacts, use: _Use) -> tuple[Edit, ...] | None:
    """The edits that pass the device to one use, or None when they cannot be made."""
    if use.call is None:
        _, end = facts.span(use.callee)
        return (edits.insert_at(end, f"({_device(use.old)})"),)  # a bare decorator becomes a call
    if use.old.endswith(".autocast"):
        return edits.positional_as_keywords(facts, use.call, _AUTOCAST_POSITIONAL, f"{_device(use.old)}, ")
    if not _DEPRECATED[use.old][2]:  # device_type= after the positional arguments: custom_fwd(fn)
        return (edits.keyword_insertion(facts, use.call, _device(use.old)),)
    return (edits.first_argument_insertion(facts, use.call, _device(use.old)),)


def _all_edits(facts: ScriptFacts, first: Edit, uses: list[_Use]) -> tuple[Edit, ...] | None:
    """``first`` and every use's device edits - or None when one use cannot be fixed."""
    out = [first]
    for use in uses:
        more = _device_edits(facts, use)
        if more is None:
            return None
        out += more
    return tuple(out)


def _bound_names(imp: Import) -> set[str]:
    """The names an import of an old module binds - of a module defining an old class, the
    deprecated ones only (``OptState`` stays what it is in torch.amp.grad_scaler)."""
    if imp.module in _OLD_SUBMODULES:
        return {bound for name, bound in imp.names if amp_public_name(f"{imp.module}.{name}") in _DEPRECATED}
    return {bound for _, bound in imp.names}


def _imports_old_class(imp: Import) -> bool:
    return imp.module in _OLD_SUBMODULES and bool(_bound_names(imp))


def _spelled_out(node: ast.expr, old: str) -> bool:
    """``node`` spells the deprecated name in full: ``torch.cuda.amp.autocast``, or through the
    module defining it, ``torch.cuda.amp.autocast_mode.autocast``."""
    name = dotted(node)
    return name is not None and (name == old or amp_public_name(name) == old)


def _all_uses_fixable(facts: ScriptFacts, imp: Import, uses: list[_Use]) -> bool:
    """Every reference to the imported names is a call or decorator we rewrite, a type
    annotation or an isinstance()'s class (the torch.amp class once the import names it)."""
    fixed = {id(u.callee) for u in uses} | facts.annotation_references | _class_tests(facts)
    return all(id(ref) in fixed for name in _bound_names(imp) for ref in facts.references(name))


@lint_rule("AMP401", reads=("autocast", "GradScaler", "custom_[fb]wd", r"\bamp\b"))
def deprecated_amp_api(facts: ScriptFacts) -> Iterator[Finding]:
    # One finding per deprecated binding - the import (or alias) of the old module, or a name
    # spelled out in full - at its first appearance, naming the other lines: a trainer uses
    # `autocast` a dozen times (type annotations too) and one migration fixes them all. Its
    # fix still rewrites every use.
    groups: dict[object, list[Finding]] = {}
    rewritten: dict[object, set[str]] = {}  # the deprecated names each binding's fix rewrites
    for key, found, olds in _each_use(facts):
        groups.setdefault(key, []).append(found)
        rewritten.setdefault(key, set()).update(olds)
    for key, found in groups.items():
        found.sort(key=lambda f: (f.line, f.column or 0))
        first, rest = found[0], found[1:]
        lines = sorted({f.line for f in rest} - {first.line})
        more = f" (also at line{'s' if len(lines) > 1 else ''} {listed(list(map(str, lines)), IN_A_MESSAGE)})" \
            if lines else ""
        fixes = list(dict.fromkeys(e for f in found if f.autofix is not None for e in f.autofix.edits))
        # an annotation first (no fix of its own) still carries the fix of the calls after it
        autofix, fix = Autofix(tuple(fixes)) if fixes else None, first.fix
        # a file that still runs on older torch: the new spelling may not be there (unsafe)
        needs = _needs(rewritten[key]) if fixes and versions.supports_old_torch(facts) else None
        if autofix is not None and needs is not None:
            autofix = replace(autofix, safe=False)
            fix = f"{fix} (torch >= {needs}; this file also runs on older torch)"
        yield replace(first, message=first.message + more, fix=fix, autofix=autofix)


@per_file  # asked for each deprecated import, alias and reference of a file
def _class_tests(facts: ScriptFacts) -> frozenset[int]:
    """The classes ``isinstance(x, C)`` / ``issubclass(x, (C, D))`` test against (node ids)."""
    found = set()
    for call in facts.calls:
        if call.names & {"builtins.isinstance", "builtins.issubclass"} and len(call.node.args) == 2:
            classes = call.node.args[1]
            found.update(id(n) for n in (classes.elts if isinstance(classes, ast.Tuple) else [classes]))
    return frozenset(found)


def _each_use(facts: ScriptFacts) -> Iterator[tuple[object, Finding, tuple[str, ...]]]:
    """Every deprecated spelling, with the binding it belongs to and the deprecated names its
    fix rewrites."""
    uses = _uses(facts)
    imports = [i for i in facts.imports if isinstance(i.node, ast.ImportFrom) and not i.compat
               and (i.module in _OLD_MODULES or _imports_old_class(i))]
    by_name = {bound: imp for imp in imports for bound in _bound_names(imp)}
    groups: dict[int, tuple[Edit, ...] | None] = {}
    for imp in imports:
        members = [u for u in uses if isinstance(u.callee, ast.Name) and by_name.get(u.callee.id) is imp]
        fixable = _all_uses_fixable(facts, imp, uses)
        module = _OLD_SUBMODULES.get(imp.module, "torch.amp")
        groups[id(imp)] = _all_edits(facts, edits.rename_module(facts, imp.node, module), members) \
            if fixable else None
        yield id(imp), finding(facts, "AMP401", imp, old=f"from {imp.module} import", new=f"from {module} import",
                               fix=f"import from {module} and pass the device to each use",
                               autofix=Autofix(groups[id(imp)]) if groups[id(imp)] else None), \
            tuple(_public(f"{imp.module}.{name}") for name, _ in imp.names)
    aliases = _module_aliases(facts)
    for bound, imp in aliases.items():
        groups[id(imp)] = _alias_fix(facts, imp, bound, uses)
        old = f"from {imp.module} import {bound}" if isinstance(imp.node, ast.ImportFrom) \
            else f"import {imp.names[0][0]} as {bound}"
        new = f"from torch import {bound}" if isinstance(imp.node, ast.ImportFrom) else f"import torch.amp as {bound}"
        # what the alias's uses are: `amp.GradScaler` in calls, annotations, isinstance()
        olds = tuple(n for ref in facts.amp_references if (dotted(ref.node) or "").split(".")[0] == bound
                     for n in ref.names) + tuple(u.old for u in uses if isinstance(u.callee, ast.Attribute)
                                                 and dotted(u.callee.value) == bound)
        yield id(imp), finding(facts, "AMP401", imp, old=old, new=new,
                               fix="import torch.amp and pass the device to each use",
                               autofix=Autofix(groups[id(imp)]) if groups[id(imp)] else None), olds
    for use in uses:
        new = _DEPRECATED[use.old][0]
        imp = by_name.get(use.callee.id) if isinstance(use.callee, ast.Name) else None
        alias = aliases.get(dotted(use.callee.value) or "") if isinstance(use.callee, ast.Attribute) else None
        key: object = use.old
        if imp is not None:
            fix_edits, key = groups[id(imp)], id(imp)
        elif alias is not None:
            fix_edits, key = groups[id(alias)], id(alias)
        elif _spelled_out(use.callee, use.old):  # rename in place
            fix_edits = _all_edits(facts, edits.replace(facts, use.callee, new), [use])
        else:
            fix_edits = None
        yield key, finding(facts, "AMP401", use.at, old=use.old, new=f"{new}({_device(use.old)}, ...)",
                           fix=f"use {new} and pass {_device(use.old)}",
                           autofix=Autofix(fix_edits) if fix_edits else None), (use.old,)
    used = {id(u.callee) for u in uses}
    class_tests = _class_tests(facts)
    for ref in facts.amp_references:
        old = next((n for n in ref.names if n in _DEPRECATED), None)
        if old is not None and id(ref.node) not in used and not ref.compat:
            new = _DEPRECATED[old][0]
            root = (dotted(ref.node) or "").split(".")[0]
            owner = by_name.get(root) or aliases.get(root)
            # an annotation or an isinstance() names the class: torch.amp's is the old one's
            # base, and what the fixed calls build (an isinstance of the old class would now be
            # False); a value (`ac = torch.cuda.amp.autocast`) needs the device
            named = ref.annotation or (id(ref.node) in class_tests and not old.endswith(("_fwd", "_bwd")))
            rename = named and owner is None and _spelled_out(ref.node, old)
            yield (id(owner) if owner is not None else old), finding(
                facts, "AMP401", ref, old=old, new=f"{new} with {_device(old)}",
                fix=f"use {new} and pass {_device(old)} where it is called",
                autofix=Autofix((edits.replace(facts, ref.node, new),)) if rename else None), (old,)
