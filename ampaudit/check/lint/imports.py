"""What the imports of a file bind each name to, for qualified names."""

from __future__ import annotations

import ast
import builtins
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ampaudit.check.lint.nodes import dotted


@dataclass(frozen=True, eq=False)
class ImportMap:
    """What each imported name stands for: ``F`` -> ``torch.nn.functional``, ``amp`` ->
    ``torch.cuda.amp``, ``autocast`` -> ``torch.cuda.amp.autocast`` (after ``from torch.cuda.amp
    import *`` too: ``STAR_EXPORTS``). Read from every import
    in the file (module level, functions, ``try`` blocks alike, skipped code too) - the lint
    only asks about torch's, apex's and the frameworks' names, which scripts do not rebind -
    so no scope analysis is needed."""

    bound: Mapping[str, str]  # name -> what it stands for

    @classmethod
    def of(cls, tree: ast.Module) -> ImportMap:
        bound: dict[str, str] = {}
        for node, fallback in _statements_breadth_first(tree):
            # an import in `except ImportError:` binds what the `try` did not: on the torch
            # the script is linted for, the `try` imported
            bind = bound.setdefault if fallback else bound.__setitem__
            if node.__class__ is ast.Import:
                for alias in node.names:
                    if alias.asname:
                        bind(alias.asname, alias.name)
                    else:
                        root = alias.name.split(".")[0]
                        bound.setdefault(root, root)
            elif node.__class__ is ast.ImportFrom and node.module is not None:
                module = "." * node.level + node.module
                for alias in node.names:
                    if alias.name != "*":
                        bind(alias.asname or alias.name, f"{module}.{alias.name}")
                    else:
                        for name in star_names(module):
                            bind(name, f"{module}.{name}")
        return cls(MappingProxyType(bound))

    def name_for(self, module: str) -> str | None:
        """The name the file binds to ``module`` itself (``torch``, or ``th`` after ``import
        torch as th``), for code a fix writes; None when nothing does (``from torch import nn``)."""
        if self.bound.get(module) == module:
            return module
        return next((name for name, target in self.bound.items() if target == module), None)

    def qualify(self, node: ast.AST) -> frozenset[str]:
        """``{"torch.cuda.amp.autocast"}`` for ``amp.autocast`` after ``from torch.cuda import
        amp``; a name nothing imports keeps its own spelling (``scaler.step``)."""
        name = dotted(node)
        if name is None:
            return frozenset()
        root, dot, rest = name.partition(".")
        target = self.bound.get(root)
        if target is None:
            return frozenset({f"builtins.{name}" if name in _BUILTINS else name})
        full = target + dot + rest
        public = amp_public_name(full)
        return frozenset({full, public}) if public else frozenset({full})


def amp_public_name(name: str) -> str | None:
    """The public spelling of an AMP name read through the module that defines it -
    ``torch.cuda.amp.grad_scaler.GradScaler`` is ``torch.cuda.amp.GradScaler``,
    ``torch.amp.autocast_mode.autocast`` is ``torch.amp.autocast`` - so that the rules, which ask
    for the public names, know it; None for any other name."""
    parts = name.split(".")
    if len(parts) == 5 and parts[:1] == ["torch"] and parts[1:3] in _AMP_PACKAGES and parts[3] in _AMP_SUBMODULES:
        return ".".join([*parts[:3], parts[4]])
    if len(parts) == 4 and parts[:2] == ["torch", "amp"] and parts[2] in _AMP_SUBMODULES:
        return f"torch.amp.{parts[3]}"
    return None


_AMP_PACKAGES = (["cuda", "amp"], ["cpu", "amp"])
_AMP_SUBMODULES = frozenset({"grad_scaler", "autocast_mode"})


# What `from M import *` binds, for the AMP modules the rules ask about: each one's
# `__all__`, or its public names where it has none (torch.cpu.amp). The lint imports nothing,
# so a star import of any other module binds no name it knows.
STAR_EXPORTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "torch.amp": ("autocast", "custom_bwd", "custom_fwd", "is_autocast_available", "GradScaler"),
    "torch.cuda.amp": ("amp_definitely_not_available", "autocast", "custom_bwd", "custom_fwd", "GradScaler"),
    "torch.cpu.amp": ("autocast", "autocast_mode", "grad_scaler", "GradScaler"),
})


def star_names(module: str) -> tuple[str, ...]:
    """The names ``from module import *`` binds, as far as the lint knows (none for a module
    outside ``STAR_EXPORTS``)."""
    return STAR_EXPORTS.get(module, ())


def catches_compat(handler: ast.ExceptHandler) -> bool:
    """``except ImportError`` / ``except (ImportError, AttributeError)``: a fallback for an
    API an older (or newer) torch lacks."""
    kind = handler.type
    if kind is None:
        return False
    names = kind.elts if kind.__class__ is ast.Tuple else [kind]
    return any((dotted(n) or "").rsplit(".", 1)[-1] in _COMPAT_ERRORS for n in names)


def _statements_breadth_first(tree: ast.Module) -> Iterator[tuple[ast.AST, bool]]:
    """Every statement, in ``ast.walk``'s order (a later import of a name wins), without
    walking the expressions - no import is in one; and whether it is in a fallback (a
    ``catches_compat`` handler)."""
    queue: deque[tuple[ast.AST, bool]] = deque((node, False) for node in tree.body)
    while queue:
        node, fallback = queue.popleft()
        yield node, fallback
        inner = fallback or (node.__class__ is ast.ExceptHandler and catches_compat(node))
        for name in _NESTED.get(node.__class__, ()):
            queue.extend((child, inner) for child in getattr(node, name))


_NESTED = {  # the fields that hold statements (or the handlers and cases that do)
    ast.FunctionDef: ("body",), ast.AsyncFunctionDef: ("body",), ast.ClassDef: ("body",),
    ast.If: ("body", "orelse"), ast.For: ("body", "orelse"), ast.AsyncFor: ("body", "orelse"),
    ast.While: ("body", "orelse"), ast.With: ("body",), ast.AsyncWith: ("body",),
    ast.Try: ("body", "handlers", "orelse", "finalbody"), ast.ExceptHandler: ("body",),
    ast.Match: ("cases",), ast.match_case: ("body",),
}
if hasattr(ast, "TryStar"):
    _NESTED[ast.TryStar] = ("body", "handlers", "orelse", "finalbody")

_BUILTINS = frozenset(dir(builtins))
_COMPAT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "AttributeError"})
