"""Decide each op's compute dtype - the conversion plan.

Like TF's auto-mixed-precision painting: ops the catalog puts in fp16 run in the low dtype,
fp32 ops in fp32, and everything else (neutral, promote, unknown) follows its inputs, so
casts land only where an fp16 op meets an fp32 one. Then the safety overrides: an op
holding a constant the low dtype cannot represent, or whose measured output overflowed it,
runs in fp32 (or has its constant clamped), and ops promoted by verification do too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import fx

from ampaudit.core.findings import Precision
from ampaudit.core.paths import display_path
from ampaudit.graph.constants import constant_values
from ampaudit.graph.fx_tracer import LOC, autograd_function_of, custom_fwd_cast
from ampaudit.graph.range_probe import MEASURED
from ampaudit.graph.view import STRUCTURAL_OPS, GraphView

LOW, FP32, FOLLOW = "low", "fp32", "follow"


@dataclass
class Decision:
    compute: str  # LOW, FP32 or FOLLOW (inputs' promoted dtype, no cast inserted)
    reason: str
    rule: str | None = None  # the finding code behind an override
    clamp: dict[int | str, float] | None = None  # argument -> clamped constant (constants="clamp")


def decide(
    view: GraphView, *, constants: str = "fp32", promoted: Mapping[str, str | Decision] | None = None
) -> dict[fx.Node, Decision]:
    """``constants``: "fp32" keeps an op with an out-of-range constant in fp32; "clamp"
    clamps the constant to the dtype's finite limit instead. ``promoted``: node name ->
    reason, for ops verification moved to fp32 (or the decision itself, for a plan made again)."""
    promoted = promoted or {}
    limit = view.dtype.max
    plan: dict[fx.Node, Decision] = {}
    for node in view.nodes:
        name = view.name(node)
        policy = view.policy(node)
        if node.op in STRUCTURAL_OPS:
            plan[node] = Decision(FOLLOW, "graph input, parameter or output")
        elif view.is_opaque(node):
            plan[node] = Decision(FP32, "not traced by torch.fx: kept in fp32")
        elif node in view.fp32_declared:
            declared = view.fp32_declared[node]
            plan[node] = Decision(FP32, f"{view.declared.owner or 'the model'} keeps {declared.path} in fp32 "
                                        f"({declared.attribute})", "declared")
        elif (function := autograd_function_of(node)) is not None:
            plan[node] = _function_decision(function, view)
        elif name in promoted:
            given = promoted[name]
            plan[node] = replace(given) if isinstance(given, Decision) else Decision(FP32, given, "verify")
        elif policy is not None and policy.precision is Precision.LOW:
            plan[node] = Decision(LOW, policy.reason)
        elif policy is not None and policy.precision is Precision.FP32:
            plan[node] = _within_range(node, policy, view) or Decision(FP32, policy.reason)
        else:
            plan[node] = Decision(FOLLOW, policy.reason if policy else "not in the catalog: follows its inputs")
        decision = plan[node]
        if decision.compute == FP32 or node.op in STRUCTURAL_OPS:
            continue
        bad = {where: c for where, c in constant_values(view, node) if abs(c) > limit}
        if bad and constants == "clamp":
            clamped = {where: (limit if c > 0 else -limit) for where, c in bad.items()}
            shown = ", ".join(f"{c:g} -> {clamped[w]:g}" for w, c in bad.items())
            decision.clamp = clamped
            decision.reason += f"; constant clamped to {view.dtype}'s finite range ({shown})"
            decision.rule = "AMP201"
            continue
        if bad:  # the static cause first: the measured overflow below is its consequence
            shown = ", ".join(f"{c:g}" for c in bad.values())
            plan[node] = Decision(FP32, f"constant {shown} does not fit {view.dtype}: kept in fp32", "AMP201")
            continue
        measured = node.meta.get(MEASURED)
        if measured is not None and measured.overflow > 0:
            plan[node] = Decision(FP32, f"measured max |x| = {measured.absmax:.3g} exceeds {view.dtype} max "
                                        f"{limit:.6g}", "AMP301")
    _agree_on_shared_modules(plan)
    return plan


def _within_range(node: fx.Node, policy: Any, view: GraphView) -> Decision | None:
    """An fp32 op whose hazard is range alone (``low_within`` in the catalog: pow), kept low
    where the example inputs show its output far inside the dtype's range and its low-dtype
    error no worse than rounding: tanh GELU's ``pow(x, 3)`` of a bounded activation. Run whole
    in fp32, such a leaf module saved fp32 copies of the 4x-wide MLP activation (HF GPT-2's
    NewGELUActivation: a training step's peak 1.36x autocast's)."""
    measured = node.meta.get(MEASURED)
    exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
    if policy.low_within is None or measured is None or not isinstance(exponent, (int, float)) \
            or isinstance(exponent, bool) or measured.overflow > 0 or measured.bits_lost is None \
            or measured.bits_lost > 1 or measured.absmax * policy.low_within > view.dtype.max:
        return None
    return Decision(LOW, f"{policy.reason}; measured max |x| = {measured.absmax:.3g}, at least "
                         f"{policy.low_within:g}x below {view.dtype} max, no error beyond rounding: kept in "
                         f"{view.dtype}", "measured")


def _function_decision(function: type, view: GraphView) -> Decision:
    """A custom autograd Function runs whole - its own forward, its own backward - in the dtype
    its ``custom_fwd(cast_inputs=...)`` names, else in its inputs' (as it would under autocast)."""
    cast = custom_fwd_cast(function)
    what = f"custom autograd Function {function.__name__}: its own forward and backward run"
    if cast is None:
        return Decision(FOLLOW, f"{what}, in its inputs' dtype")
    compute = LOW if str(cast).removeprefix("torch.") == view.dtype.name else FP32
    return Decision(compute, f"{what}, in {str(cast).removeprefix('torch.')} (custom_fwd(cast_inputs=...))")


def _agree_on_shared_modules(plan: dict[fx.Node, Decision]) -> None:
    """A module called at several places has one set of weights: if its calls disagree on
    the dtype, all of them run in fp32."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in plan:
        if node.op == "call_module":
            calls[node.target].append(node)
    for nodes in calls.values():
        if len({plan[n].compute for n in nodes}) > 1:
            for n in nodes:
                plan[n] = Decision(FP32, plan[n].reason + "; shared with a call that needs fp32", plan[n].rule)


def plan_records(view: GraphView, plan: dict[fx.Node, Decision], produced: dict[fx.Node, str]) -> list[dict[str, Any]]:
    """The plan as data (``model_mp.plan`` and plan.json): one entry per op."""
    names = {LOW: view.dtype.name, FP32: "float32"}
    records = []
    for node, decision in plan.items():
        loc = node.meta[LOC]
        records.append({
            "node": view.name(node), "op": node.op, "kind": view.kinds[node], "module": view.module(node),
            "dtype": names.get(produced.get(node, FOLLOW), "follows"),
            "compute": {LOW: view.dtype.name, FP32: "float32", FOLLOW: "follows its inputs"}[decision.compute],
            "reason": decision.reason, "rule": decision.rule, "file": display_path(loc.file), "line": loc.line,
        })
    return records
