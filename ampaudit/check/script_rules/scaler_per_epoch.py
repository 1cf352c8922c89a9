"""AMP448: a GradScaler built anew every epoch (or every step): inside the loop that trains
with it, or in a one-epoch function that a loop calls (doctr's ``fit_one_epoch``). Its loss
scale restarts at its initial value each time, so the steps that find the scale again are
skipped, every epoch, while a per-step schedule moves on."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ampaudit.check.lint.facts import GRAD_SCALERS, Assignment, Call, Scope, ScriptFacts
from ampaudit.check.lint.nodes import dotted
from ampaudit.check.lint.protocol import finding
from ampaudit.check.script_rules import lint_rule
from ampaudit.core.findings import Finding

_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_TRAINS = frozenset({"scale", "step"})
_ONE_EPOCH = re.compile(r"(?<![a-z])epoch(?![a-z])", re.IGNORECASE)  # train_one_epoch, _train_epoch: not train_epochs


@lint_rule("AMP448", reads=("GradScaler", "epoch"))
def grad_scaler_built_per_epoch(facts: ScriptFacts) -> Iterator[Finding]:
    for built in facts.assigned(GRAD_SCALERS):
        call = built.call
        if call.disabled or _built_once(facts, built):
            continue
        uses = [c for c in facts.calls_in(call.scope) if c.receiver == built.target and c.method in _TRAINS
                and c.line > call.line]
        if not uses:
            continue
        if call.loop is not None:
            # in the loop that trains with it, or one level above the loop that does (the epoch loop);
            # deeper, the loop runs whole trainings (a sweep, folds) and a fresh scaler is right
            if any(u.loop is not None and _contains(call.loop, u.loop) and _depth(call.loop, u.loop) <= 1
                   for u in uses):
                yield finding(facts, "AMP448", call, scaler=built.target,
                              where=f"inside the loop at line {call.loop.lineno}",
                              fix=f"build {built.target} once, before the loop at line {call.loop.lineno}")
            continue
        if call.scope.kind != "function" or any(_nested(facts, call.scope, u) for u in uses):
            continue  # a function that runs every epoch itself keeps one scaler across them
        caller = next((c for c in _calls_of(facts, call.scope) if c.loop is not None), None)
        if caller is not None:
            yield finding(facts, "AMP448", call, scaler=built.target,
                          where=f"in `{call.scope.name}()`, which the loop at line {caller.loop.lineno} calls on "
                                "every iteration",
                          fix=f"build {built.target} once, outside the loop, and pass it to {call.scope.name}()")
        elif _ONE_EPOCH.search(call.scope.name):
            # the epoch loop that calls it is in another file (DINO's engine.train_one_epoch,
            # StarGANv2-VC's Trainer._train_epoch): the name says it runs once per epoch
            yield finding(facts, "AMP448", call, scaler=built.target,
                          where=f"in `{call.scope.name}()`, a function that runs one epoch per call",
                          fix=f"build {built.target} once, outside the epoch loop, and pass it to "
                              f"{call.scope.name}()")


def _built_once(facts: ScriptFacts, built: Assignment) -> bool:
    """``if scaler is None: scaler = GradScaler()``: the condition names the scaler."""
    return any(built.target in facts.code(test) for test, _ in built.call.guards)


def _contains(outer: ast.stmt, inner: ast.stmt) -> bool:
    return outer.lineno <= inner.lineno and inner.end_lineno <= outer.end_lineno


def _depth(outer: ast.stmt, inner: ast.stmt) -> int:
    """How many loops below ``outer`` ``inner`` is: 0 for the same loop."""
    if outer is inner:
        return 0
    return sum(1 for node in ast.walk(outer) if isinstance(node, _LOOPS) and node is not outer
               and _contains(node, inner))


def _nested(facts: ScriptFacts, scope: Scope, use: Call) -> bool:
    """``use`` runs in a loop inside another loop of its function (epochs around batches)."""
    if use.loop is None:
        return False
    loops = {id(c.loop): c.loop for c in facts.calls_in(scope) if c.loop is not None}
    return any(loop is not use.loop and _contains(loop, use.loop) for loop in loops.values())


def _calls_of(facts: ScriptFacts, scope: Scope) -> Iterator[Call]:
    """Calls of the function ``scope`` from the rest of the file: ``name(...)``, ``self.name(...)``."""
    for call in facts.calls:
        if call.scope is scope:
            continue
        func = call.node.func
        by_name = isinstance(func, ast.Name) and func.id == scope.name
        if by_name or (isinstance(func, ast.Attribute) and func.attr == scope.name and dotted(func.value) == "self"):
            yield call
