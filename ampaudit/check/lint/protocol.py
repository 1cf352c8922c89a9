"""What the AMP training protocol rules share: findings at a call, and who is who in a scope
(optimizers, scalers, backward calls, models cast to fp16).

Protocol rules look at the calls that run when AMP is on: a call in the branch of an AMP
switch that turns it off (``else: loss.backward()`` after ``if use_amp:``) is the fp32 path
and follows fp32 rules. A finding on a guarded path says which guard it assumed; one that
rests on a GradScaler built with ``enabled=<expression>`` (on in some runs only) is never
more severe than a warning.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ampaudit.check.lint import edits
from ampaudit.check.lint.facts import FLOAT16_NAMES, GRAD_SCALERS, Assignment, Call, Scope, ScriptFacts
from ampaudit.check.lint.guards import OFF, amp_state
from ampaudit.check.lint.memo import per_file
from ampaudit.check.lint.nodes import arguments, dotted, unstarred, unwrap_cast
from ampaudit.core.findings import Autofix, Edit, Finding, Severity
from ampaudit.core.paths import display_path
from ampaudit.core.rulebook import rule

CLIPS = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_",
                   "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_"})
ADAMS = frozenset({"torch.optim.Adam", "torch.optim.AdamW", "torch.optim.Adamax", "torch.optim.NAdam",
                   "torch.optim.RAdam", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW"})


def clips(facts: ScriptFacts, call: Call) -> bool:
    """``call`` clips gradients: torch's clip_grad_norm_ / clip_grad_value_, or a function of
    this file that calls one and does not unscale_ first - ``self._clip_gradients(max_norm)``
    (ClassyVision's classification task), ``clip(parameters, max_norm)``."""
    if call.names & CLIPS:
        return True
    func = call.node.func
    if func.__class__ is ast.Name:
        owner, name = None, func.id  # a function of the module
    elif func.__class__ is ast.Attribute and func.value.__class__ is ast.Name and func.value.id == "self":
        owner, name = facts.methods.get(call.scope), func.attr  # a method of the caller's class
        if owner is None:
            return False
    else:
        return False
    return (owner, name) in _clip_helpers(facts)


@per_file
def _clip_helpers(facts: ScriptFacts) -> frozenset[tuple[str | None, str]]:
    """(class or None, name) of the functions that clip gradients they do not unscale."""
    found = set()
    for scope in facts.scopes():
        if scope.kind != "function":
            continue
        calls = facts.calls_in(scope)
        if any(c.names & CLIPS for c in calls) and not any(c.method == "unscale_" for c in calls):
            found.add((facts.methods.get(scope), scope.name))
    return frozenset(found)


def finding(facts: ScriptFacts, code: str, at: Any, *, fix: str | None = None,
            autofix: Autofix | None = None, **fields: Any) -> Finding:
    """A finding at a fact (anything with ``line`` and ``column``)."""
    return rule(code).finding(display_path(facts.path), at.line, column=at.column, fix=fix, autofix=autofix,
                              **fields)


def on_path(facts: ScriptFacts, code: str, call: Call, *, via: str | None = None, **fields: Any) -> Finding:
    """A protocol finding at ``call``, on the AMP path: names the guard it assumed, and is at
    most a warning when it rests on a scaler (``via``) that is on in some runs only."""
    result = finding(facts, code, call, **fields)
    state, guard = amp_state(facts, call)
    if state is not None and guard:
        return replace(result, message=f"{result.message} (on the path where {guard})")
    if via is not None and maybe_scaler(facts, call.scope, via) and result.severity is Severity.ERROR:
        return softened(result, f"when {via} is enabled")
    return result


def softened(found: Finding, condition: str | None = None) -> Finding:
    """``found`` as a warning: it holds only under ``condition`` (said in the message) or only
    in some runs."""
    message = f"{found.message} ({condition})" if condition else found.message
    return replace(found, severity=Severity.WARNING, message=message)


def maybe_scaler(facts: ScriptFacts, scope: Scope, name: str) -> bool:
    """``name`` is built only as ``GradScaler(enabled=<expression>)``: on in some runs only."""
    built = [a.call for a in facts.assigned(GRAD_SCALERS, scope) if a.target == name]
    return bool(built) and all(c.maybe_enabled for c in built)


def amp_path(facts: ScriptFacts, call: Call) -> bool:
    """Whether ``call`` can run with AMP on (it is not in a branch that turns AMP off)."""
    return amp_state(facts, call)[0] != OFF


def guard_prefix(facts: ScriptFacts, call: Call, scaler: str) -> str:
    """``if scaler is not None: `` when code that uses ``scaler`` must not run where it may be
    None - it was built conditionally (``GradScaler() if amp else None``, inside an ``if``) -
    and ``call`` is not already on a guarded path; else nothing."""
    if amp_state(facts, call)[0] is not None:
        return ""
    if any(a.call.guards for a in facts.assigned(GRAD_SCALERS) if a.target == scaler):
        return f"if {scaler} is not None: "
    return ""


def is_optimizer(call: Call) -> bool:
    return any(n.startswith("torch.optim.") and ".lr_scheduler" not in n and ".swa_utils" not in n
               for n in call.names)


# A receiver named like an optimizer (a function parameter, say): `optimizer.step()`,
# `opt.step()`, `self.optim.step()` - but not `env.step()` or `scheduler.step()`.
_OPTIMIZER_NAME = re.compile(r"(^|[._])(opt|optim|optimizer|optimiser)s?(_\w+)?$")


def optimizers(facts: ScriptFacts, scope: Scope) -> set[str]:
    """Names that hold an optimizer here: built from torch.optim, handed to a scaler, or
    named like one."""
    names = {a.target for a in _built_optimizers(facts) if a.call.scope is scope or a.call.scope.kind == "module"}
    names |= {c.receiver for c in facts.method_calls("step", scope)
              if c.receiver and _OPTIMIZER_NAME.search(c.receiver)}
    scalers = facts.scalers(scope)
    for call in facts.calls_in(scope):
        if call.method in ("step", "unscale_") and call.receiver in scalers:
            target = dotted(call.arg(0, "optimizer"))
            if target:
                names.add(target)
    return names


def named_like_optimizer(name: str) -> bool:
    """``optimizer``, ``opt``, ``self.optim_g``: a parameter or attribute named like one."""
    return bool(_OPTIMIZER_NAME.search(name))


@per_file
def _built_optimizers(facts: ScriptFacts) -> tuple[Assignment, ...]:
    return tuple(a for a in facts.assignments if is_optimizer(a.call))


def scaler_for(facts: ScriptFacts, call: Call, scalers: set[str], optimizer: str | None = None) -> str:
    """Which of the scope's scalers ``call`` belongs with, when there are several (a GAN's
    d_scaler and g_scaler): the one that steps or unscales ``optimizer`` elsewhere, else the
    one used nearest to the call."""
    ordered = sorted(scalers)
    if len(ordered) == 1:
        return ordered[0]
    uses = [c for c in facts.calls_in(call.scope) if c.receiver in scalers and amp_path(facts, c)]
    if optimizer is not None:
        paired = {c.receiver for c in uses if c.method in ("step", "unscale_")
                  and dotted(c.arg(0, "optimizer")) == optimizer}
        if len(paired) == 1:
            return paired.pop()
    nearest = min(uses, key=lambda c: (abs(c.line - call.line), c.line), default=None)
    return nearest.receiver if nearest is not None and nearest.receiver else ordered[0]


def backward_scaler(facts: ScriptFacts, call: Call, scalers: frozenset[str]) -> str | None:
    """The scaler whose scaled loss this backward runs on: ``s.scale(loss).backward()``,
    ``cast(T, s.scale(loss)).backward()``, or ``scaled = s.scale(loss)`` ... ``scaled.backward()``."""
    func = call.node.func
    if call.method != "backward" or not isinstance(func, ast.Attribute):
        return None
    scaled = unwrap_cast(func.value)
    if isinstance(scaled, ast.Call):
        inner = scaled.func
        if isinstance(inner, ast.Attribute) and inner.attr == "scale" and dotted(inner.value) in scalers:
            return dotted(inner.value)
        return None
    scaler = facts.scaled_values.get((id(call.scope), dotted(scaled) or ""))
    return scaler if scaler in scalers else None


def loops_over(call: Call, value: ast.expr | None) -> bool:
    """Whether ``call`` sits in a ``for`` loop whose variable is ``value``: ``for opt in
    optimizers: scaler.unscale_(opt)`` handles each optimizer once, not one many times."""
    loop = call.loop
    return isinstance(loop, (ast.For, ast.AsyncFor)) and value is not None \
        and dotted(loop.target) == dotted(value) is not None


def lacks_update(facts: ScriptFacts, step: Call, scaler: str, optimizer: ast.expr | None) -> bool:
    """Whether nothing calls ``scaler.update()`` for ``step`` (a ``scaler.step(optimizer)``, or
    the ``optimizer.step()`` a fix turns into one): not in the step's loop (after a loop over
    the optimizers is right too), and not in another method of the same object (a trainer's
    after-step hook)."""
    per_optimizer = loops_over(step, optimizer)
    if any(u.receiver == scaler and (step.loop is None or u.loop is step.loop or per_optimizer) and amp_path(facts, u)
           for u in facts.method_calls("update", step.scope)):
        return False
    if not scaler.startswith("self."):
        return True
    attribute = scaler.rsplit(".", 1)[-1]
    return not any(c.scope is not step.scope and c.receiver.rsplit(".", 1)[-1] == attribute
                   for c in _self_updates(facts))


@per_file
def _self_updates(facts: ScriptFacts) -> tuple[Call, ...]:
    """``self.x.update()`` calls, in every method: a scaler updated in another method of the
    object (a trainer's after-step hook)."""
    return tuple(c for c in facts.method_calls("update") if (c.receiver or "").startswith("self."))


def insert_update(facts: ScriptFacts, step: Call, scaler: str) -> Edit:
    """``scaler.update()`` on the line after the step's statement, guarded as the step is."""
    return edits.insert_line_after(facts, step.statement, f"{guard_prefix(facts, step, scaler)}{scaler}.update()")


def scaled_backward(facts: ScriptFacts, call: Call, scalers: frozenset[str]) -> bool:
    return backward_scaler(facts, call, scalers) is not None


def is_raw_backward(facts: ScriptFacts, call: Call) -> bool:
    """torch's own ``loss.backward()`` - not a wrapper that scales for you
    (``accelerator.backward(loss)``, any ``x.backward(loss)`` given the loss, apex's
    ``scaled_loss.backward()`` inside ``amp.scale_loss``) and not a class's own ``backward``."""
    if "torch.autograd.backward" in call.names:
        return True
    if call.method != "backward" or call.in_scale_loss or call.arg(0) is not None:
        return False
    receiver = call.receiver or ""
    root = receiver.split(".")[0]
    return root != "self" and receiver not in facts.instances


def backward_calls(facts: ScriptFacts, scope: Scope) -> list[Call]:
    """Raw backward calls in ``scope`` that can run with AMP on."""
    return [c for c in facts.calls_in(scope) if is_raw_backward(facts, c) and amp_path(facts, c)]


def scaler_in_use(facts: ScriptFacts, scope: Scope) -> set[str]:
    """Scalers this scope actually uses (scale / step / unscale_ / update)."""
    scalers = facts.scalers(scope)
    return {c.receiver for c in facts.calls_in(scope) if c.receiver in scalers
            and c.method in ("scale", "step", "unscale_", "update") and amp_path(facts, c)}


def scopes_with_scalers(facts: ScriptFacts) -> Iterator[tuple[Scope, set[str]]]:
    """Each scope that uses a GradScaler (``scaler_in_use``), with those scalers."""
    for scope in facts.scopes():
        scalers = scaler_in_use(facts, scope)
        if scalers:
            yield scope, scalers


def is_float16(facts: ScriptFacts, node: ast.expr | None) -> bool:
    return node is not None and bool(facts.qualified(node) & FLOAT16_NAMES)


def _to_half(facts: ScriptFacts, call: Call) -> bool:
    return call.method == "half" or (call.method == "to" and (
        is_float16(facts, call.arg(0, "dtype")) or is_float16(facts, call.arg(1))))


_PARAMETERS = frozenset({"parameters", "named_parameters"})


def parameters_of(value: ast.expr, depth: int = 0) -> str | None:
    """The model whose parameters an optimizer gets: ``model.parameters()``, and through
    wrappers - ``filter(lambda p: p.requires_grad, model.parameters())``,
    ``get_trainable_params(model)``, ``[{"params": model.parameters()}]``."""
    if depth > 4:
        return None
    if isinstance(value, ast.Call):
        if isinstance(value.func, ast.Attribute) and value.func.attr in _PARAMETERS:
            return dotted(value.func.value)
        written = arguments(value)
        inner = [parameters_of(a.value, depth + 1) for a in written]
        found = next((n for n in inner if n), None)
        if found:
            return found
        plain = [dotted(a.value) for a in written if a.keyword is None]
        return plain[-1] if len(plain) == 1 else None  # helper(model): its one argument
    if isinstance(value, (ast.List, ast.Tuple)):
        return next((n for e in value.elts if (n := parameters_of(unstarred(e), depth + 1))), None)
    if isinstance(value, ast.Dict):
        return next((n for k, v in zip(value.keys, value.values, strict=True) if k is not None
                     and (n := parameters_of(v, depth + 1))), None)
    return None


@per_file
def half_casts(facts: ScriptFacts) -> tuple[tuple[str, Call], ...]:
    """(model name, call) for ``m.half()`` / ``m.to(torch.float16)`` whose model is trained
    afterwards: its parameters go to an optimizer, or it is put in train mode, on a later
    line. Not a cast straight back (``m.half().float()``, which rounds the weights), nor one
    in a block that returns before training (an inference-only branch). Three rules ask."""
    trained = set()
    last = 0  # the last line that trains: an optimizer built, train mode, backward or step
    for call in facts.calls:
        if is_optimizer(call) and (written := arguments(call.node)):
            name = parameters_of(written[0].value)
            if name:
                trained.add(name)
        if call.method == "train" and call.receiver:
            trained.add(call.receiver)
        if is_optimizer(call) or call.method in ("train", "backward", "step"):
            last = max(last, call.line)
    targets = {id(a.call.node): a.target for a in facts.assignments}
    back_to_fp32 = {id(c.node.func.value) for c in facts.calls if c.method in ("float", "double")
                    and isinstance(c.node.func.value, ast.Call)}
    casts = []
    for call in facts.calls:
        if not _to_half(facts, call) or id(call.node) in back_to_fp32 or call.block_exits:
            continue
        name = targets.get(id(call.node), call.receiver)  # model = Net().half() or model.half()
        name = _loop_owner(call) or name  # for m in model.modules(): m.half()
        for model in _models_named(facts, call, name):
            if model in trained and call.line < last:
                casts.append((model, call))
                break
    return tuple(casts)


_SUBMODULES = frozenset({"modules", "children", "named_modules", "named_children"})


def _loop_owner(call: Call) -> str | None:
    """``model`` when ``call`` casts the variable of ``for m in model.modules():`` (or
    ``for name, m in model.named_modules()``): each module cast in turn is the model cast -
    the loop usually keeps BatchNorm in fp32 (cifar10-airbench)."""
    loop = call.loop
    if not isinstance(loop, (ast.For, ast.AsyncFor)) or call.receiver is None:
        return None
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in _SUBMODULES):
        return None
    target = loop.target
    variables = [dotted(e) for e in target.elts] if isinstance(target, ast.Tuple) else [dotted(target)]
    return dotted(it.func.value) if call.receiver in variables else None


def _models_named(facts: ScriptFacts, call: Call, name: str | None) -> list[str]:
    """What a cast of ``name`` casts, by the names it is trained under: the name itself; for
    ``self`` in a method of class C, what ``x = C(...)`` builds; for a name a factory function
    returns (``def make_net(): net = net.half(); return net``), what ``x = make_net()`` gets."""
    if name is None:
        return []
    builders = set()
    if name == "self" and call.scope in facts.methods:
        builders.add(facts.methods[call.scope])
    elif name in facts.returns.get(call.scope, ()):
        builders.add(call.scope.name)
    if not builders:
        return [name]
    return [name, *(a.target for a in facts.assignments if _built_by(a.call.node) in builders)]


def _built_by(node: ast.Call) -> str | None:
    """``Net`` for ``Net(...)``, ``Net(...).cuda().to(memory_format=...)``, ``make_net()``."""
    while isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call):
        node = node.func.value
    return dotted(node.func)
