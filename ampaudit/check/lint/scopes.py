"""What each scope of a file holds, indexed once when the visit ends: its calls in order,
its assignments, and the names that hold a GradScaler there. Protocol rules ask these per
scope, many times; ``ScriptFacts`` answers from the tables built here, so the lint stays
linear in the number of scopes instead of scanning every call for each one."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TypeVar

from ampaudit.check.lint.facts import GRAD_SCALERS, Assignment, Call, Scope

T = TypeVar("T")

# built elsewhere (a parameter, a helper's result, self.scaler from __init__), a scaler is
# known by its use: step/update/scale/get_scale on an object named like one
_SCALER_NAME = re.compile(r"(^|[._])(grad_|amp_|loss_|amp_grad_|d_|g_)?scaler(_\w+)?$", re.IGNORECASE)


def grouped(items: Iterable[T], scope_of: Callable[[T], Scope]) -> Mapping[Scope, tuple[T, ...]]:
    """``items`` per scope, in order; the scopes in the order their first item appears."""
    groups: dict[Scope, list[T]] = {}
    for item in items:
        groups.setdefault(scope_of(item), []).append(item)
    return MappingProxyType({scope: tuple(group) for scope, group in groups.items()})


def scalers(scopes: Iterable[Scope], module_scope: Scope, calls: Iterable[Call],
            assignments: Iterable[Assignment]) -> Mapping[Scope, frozenset[str]]:
    """Per scope, the names holding a GradScaler there: assigned one in the scope or at module
    level, or used as one (``x.scale(loss).backward()``; ``unscale_()`` is GradScaler's
    alone; step/update/scale on a scaler-named object - not ``update(found_inf)``, the
    Megatron/DeepSpeed loss scaler's own, which has no step()). ``GradScaler(enabled=False)`` is not
    one."""
    held: dict[Scope, set[str]] = {}  # assigned a GradScaler, or used as one, in the scope itself
    for a in assignments:
        if a.call.names & GRAD_SCALERS and not a.call.disabled:
            held.setdefault(a.call.scope, set()).add(a.target)
    module = frozenset(held.get(module_scope, ()))  # a function sees the module's assignments, not its uses
    for c in calls:
        method = c.method
        if method in _SCALER_METHODS and (receiver := c.receiver) and (
                method == "unscale_" or (method == "scale" and c.feeds_backward)
                or (_SCALER_NAME.search(receiver) and not (method == "update" and c.has_arguments))):
            held.setdefault(c.scope, set()).add(receiver)
    return MappingProxyType({scope: module | held[scope] if scope in held else module for scope in scopes})


_SCALER_METHODS = frozenset({"scale", "unscale_", "step", "update", "get_scale"})
