"""Optimizers that handle fp16 parameters themselves: they keep fp32 master copies and do their
own loss scaling (NVIDIA's FusedLAMBAMP, apex's FP16_Optimizer, fairseq's and Megatron's fp16
optimizers, DeepSpeed's engine, apex FusedAdam/FusedLAMB with ``master_weights=True``, a class
of the file that sets ``_step_supports_amp_scaling = True``, an optimizer the script hands the
loss with ``optimizer.backward(loss)``), or at least step through a
GradScaler without unscaling (torch's ``fused=True`` optimizers).

A model cast to fp16 whose parameters go to one of them is trained the way those libraries
mean it to be: AMP410 (GradScaler.step() never unscales its fp16 gradients), AMP411 (the
masters are fp32) and AMP412 (Adam's eps meets fp32 masters) stay quiet about it. The
well-known names are data: rules.toml, ``[AMP411.params]``.
"""

from __future__ import annotations

import ast
import re
from typing import NamedTuple

from ampaudit.check.lint.facts import Call, ScriptFacts
from ampaudit.check.lint.memo import per_file
from ampaudit.check.lint.nodes import arguments, dotted
from ampaudit.check.lint.protocol import is_optimizer, named_like_optimizer, parameters_of
from ampaudit.core.rulebook import rule

# the source text that names such an optimizer: rules that ask `handled` read it
# (the optimizers themselves are built where `optim` is read anyway)
READS = ("_step_supports_amp_scaling", "master_weights", "deepspeed")

# `class Opt: _step_supports_amp_scaling = True`, `self._step_supports_amp_scaling = True`,
# `optimizer._step_supports_amp_scaling = True`: GradScaler.step() hands the scaling over
_SUPPORTS = re.compile(r"(?:([A-Za-z_][\w.]*)\.)?_step_supports_amp_scaling\s*=\s*True\b")


class Special(NamedTuple):
    """An optimizer built in the file that GradScaler.step() does not unscale."""

    call: Call  # where it is built
    target: str | None  # the name it is assigned to
    model: str | None  # the model whose parameters it gets, when the lint can tell
    masters: bool  # keeps fp32 master weights (not only fused scaling)


def _params() -> dict:
    return rule("AMP411").params


def _parts(call: Call) -> set[str]:
    """The names a callee is spelled with: ``FusedLAMBAMP``, and ``FP16Optimizer`` in fairseq's
    ``optim.FP16Optimizer.build_optimizer(cfg, params)``."""
    return {part for name in (*call.names, dotted(call.node.func) or "") for part in name.split(".")}


def _is_true(node: ast.expr | None) -> bool:
    return node.__class__ is ast.Constant and node.value is True


def _model_of(call: Call) -> str | None:
    for keyword in ("params", "model_parameters", "model"):
        value = call.kwarg(keyword)
        if value is not None:
            return parameters_of(value) or (dotted(value) if keyword == "model" else None)
    written = [a for a in arguments(call.node) if a.keyword is None]
    return parameters_of(written[0].value) if written else None


@per_file
def _supporting_classes(facts: ScriptFacts) -> frozenset[str]:
    """Classes of the file that set ``_step_supports_amp_scaling = True`` (in the body or
    on ``self``), and names of objects it is set on (``opt._step_supports_amp_scaling = True``)."""
    found: set[str] = set()
    if "_step_supports_amp_scaling" not in facts.source:
        return frozenset()
    spans = [(c.node.name, c.node.lineno, c.node.end_lineno or c.node.lineno) for c in facts.classes]
    for match in _SUPPORTS.finditer(facts.source):
        line = facts.source.count("\n", 0, match.start()) + 1
        owner = match.group(1)
        if owner is None or owner == "self":
            inside = [name for name, first, last in spans if first <= line <= last]
            if inside:
                found.add(inside[-1])  # the innermost class around it
        else:
            found.add(owner)
    return frozenset(found)


@per_file
def special_optimizers(facts: ScriptFacts) -> tuple[Special, ...]:
    params = _params()
    wrappers = frozenset(params["master_weight_optimizers"])
    engines = frozenset(params["master_weight_engines"])
    supporting = _supporting_classes(facts)
    targets = {id(a.call): a.target for a in facts.assignments}
    by_target: dict[str, list[Call]] = {}
    for a in facts.assignments:
        if is_optimizer(a.call):
            by_target.setdefault(a.target, []).append(a.call)
    found: dict[int, Special] = {}

    def add(call: Call, masters: bool, model: str | None = None) -> None:
        known = found.get(id(call))
        found[id(call)] = Special(call, targets.get(id(call)), model or _model_of(call),
                                  masters or (known is not None and known.masters))

    for call in facts.calls:
        parts = _parts(call)
        callee = dotted(call.node.func) or ""
        if call.names & engines:
            add(call, True)
        elif parts & wrappers or callee in supporting or _is_true(call.kwarg("master_weights")):
            add(call, True)
            # FP16_Optimizer(torch.optim.Adam(model.parameters())) or FP16_Optimizer(optimizer):
            # the wrapped optimizer updates the fp32 masters
            for arg in arguments(call.node)[:1]:
                inner = [c for c in facts.calls_in(call.scope) if c.node is arg.value and is_optimizer(c)]
                inner += [c for c in by_target.get(dotted(arg.value) or "", ()) if c.line <= call.line]
                for wrapped in inner:
                    add(wrapped, True)
        elif is_optimizer(call) and _is_true(call.kwarg("fused")):
            add(call, False)
    for owner in supporting:  # `optimizer._step_supports_amp_scaling = True`
        for call in by_target.get(owner, ()):
            add(call, True)
    # `optim.backward(loss)`: torch's optimizers have no backward - the fp16 wrappers do (apex
    # FP16_Optimizer, fairseq's FP16Optimizer), which scale the loss and keep fp32 masters; a
    # helper of another module may build one (NVIDIA's wav2vec2: `optim = get_optimizer(model, args)`)
    built = {a.target: a.call for a in facts.assignments}
    for call in facts.method_calls("backward"):
        owner = call.receiver
        if owner and call.arg(0) is not None and named_like_optimizer(owner) and owner in built:
            add(built[owner], True)
    return tuple(found.values())


def handled(facts: ScriptFacts, model: str, cast: Call, *, masters: bool) -> bool:
    """Whether ``model``, cast to fp16 at ``cast``, is trained by an optimizer that handles fp16
    parameters: keeps fp32 masters (``masters``), or at least is not unscaled by GradScaler.
    An optimizer whose parameters the lint cannot trace counts for a cast in its own function,
    or anywhere when the file builds no plain optimizer over that model."""
    specials = [s for s in special_optimizers(facts) if (s.masters or not masters) and _near(facts, s.call, cast)]
    if not specials:
        return False
    if any(s.model == model for s in specials):
        return True
    plain = any(parameters_of(a.value) == model for c in facts.calls if is_optimizer(c) and _near(facts, c, cast)
                and all(c is not s.call for s in special_optimizers(facts)) for a in arguments(c.node)[:1])
    return any(s.model is None and (s.call.scope is cast.scope or not plain) for s in specials)


def _near(facts: ScriptFacts, built: Call, cast: Call) -> bool:
    """Whether an optimizer built at ``built`` can train what ``cast`` cast: in the same
    function or at the top level - or anywhere, when the cast is in a model's own method or in
    a factory that returns the model (its name is given where the model is built)."""
    scopes = (built.scope, cast.scope)
    return built.scope is cast.scope or any(s.kind == "module" for s in scopes) \
        or cast.scope in facts.methods or bool(facts.returns.get(cast.scope))


def unscales(facts: ScriptFacts, model: str) -> bool:
    """Whether a ``scaler.unscale_(optimizer)`` may reach the special optimizers of ``model``:
    unscale_() refuses fp16 gradients whatever the optimizer."""
    named = {s.target for s in special_optimizers(facts) if s.model in (model, None)}
    for call in facts.method_calls("unscale_"):
        target = dotted(call.arg(0, "optimizer"))
        if target is None or target in named or None in named:
            return True
    return False
