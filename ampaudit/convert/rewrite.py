"""Apply a plan to a GraphModule: casts at dtype boundaries, low-precision weight copies.

Casts go in front of an op only where its input arrives in another dtype than the op
computes in; ops that follow their inputs get none. Modules and parameters used only by
low-precision ops are stored in the low dtype; everything else (norm weights, BatchNorm,
buffers of fp32 ops) stays fp32 - or, with ``weights="fp32"``, every parameter stays fp32
and is cast where a low-precision op reads it, as autocast does (cast nodes in the graph).
``cast`` leaves non-float values alone, so token ids and masks pass through untouched even
where the graph cannot tell their dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ampaudit.convert.plan import FP32, LOW, Decision
from ampaudit.convert.runtime import call_with, cast
from ampaudit.graph.python_values import python_values


@dataclass
class RewriteStats:
    casts: int
    produced: dict[fx.Node, str]  # dtype each node's output has: LOW, FP32 (FOLLOW never remains)


def _promote(dtypes: list[str]) -> str:
    return FP32 if FP32 in dtypes or not dtypes else LOW


def _low_parameters(gm: fx.GraphModule, plan: dict[fx.Node, Decision]) -> set[str]:
    """get_attr targets whose every reader computes in the low dtype, and that no fp32
    module call also owns (tied weights stay fp32, cast at the low-precision use)."""
    fp32_owned = set()
    for node, decision in plan.items():
        if node.op == "call_module" and decision.compute != LOW:
            fp32_owned |= {id(t) for t in gm.get_submodule(node.target).parameters()}
            fp32_owned |= {id(t) for t in gm.get_submodule(node.target).buffers()}
    low = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        value = _attr(gm, node.target)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or id(value) in fp32_owned:
            continue
        if all(plan[user].compute == LOW for user in node.users):
            low.add(node.target)
    return low


def _attr(gm: fx.GraphModule, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _store_low(gm: fx.GraphModule, target: str, dtype: torch.dtype) -> None:
    """Store a tensor in the low dtype in place, as ``Module.to`` does: a tensor tied to other
    modules (``lm_head.weight = wte.weight``) stays one tensor, whichever graph holds them."""
    value = _attr(gm, target)
    with torch.no_grad():
        value.data = value.data.to(dtype)


def rewrite(gm: fx.GraphModule, plan: dict[fx.Node, Decision], dtype: torch.dtype, *,
            keep_low_outputs: bool = False, weights: str = "low") -> RewriteStats:
    graph = gm.graph
    targets = {LOW: dtype, FP32: torch.float32}
    low_params = _low_parameters(gm, plan) if weights == "low" else set()
    for target in low_params:
        _store_low(gm, target, dtype)
    for node, decision in plan.items():
        if node.op == "call_module" and decision.compute == LOW and weights == "low":
            gm.get_submodule(node.target).to(dtype)

    produced: dict[fx.Node, str] = {}
    casts: dict[tuple[fx.Node, str], fx.Node] = {}
    # sizes and shapes (x.size(-1), math.sqrt of it) are Python values: they do not promote
    # a tensor they meet (linear_out.view(size, -1) stays in the linear's dtype)
    python = python_values(gm)

    def cast_to(value, want: str, before: fx.Node):
        if not isinstance(value, fx.Node) or produced.get(value) == want:
            return value
        key = (value, want)
        if key not in casts:
            with graph.inserting_before(before):
                casts[key] = graph.call_function(cast, (value, targets[want]))
            produced[casts[key]] = want
        return casts[key]

    for node in list(graph.nodes):
        if node in produced:  # a cast inserted above
            continue
        decision = plan.get(node)
        if node.op == "placeholder":
            produced[node] = FP32
        elif node.op == "get_attr":
            produced[node] = LOW if node.target in low_params else FP32
        elif node.op == "output":
            if not keep_low_outputs:
                node.args = fx.node.map_arg(node.args, lambda n, at=node: cast_to(n, FP32, at))
        elif decision.compute in (LOW, FP32):
            node.args = fx.node.map_arg(node.args, lambda n, at=node, d=decision: cast_to(n, d.compute, at))
            node.kwargs = fx.node.map_arg(node.kwargs, lambda n, at=node, d=decision: cast_to(n, d.compute, at))
            produced[node] = decision.compute
        else:
            produced[node] = _promote([produced[n] for n in node.all_input_nodes if n in produced and n not in python])
        if decision is not None and decision.clamp:
            _apply_clamp(node, decision.clamp)
    graph.lint()
    gm.recompile()
    return RewriteStats(len(casts), {n: d for n, d in produced.items() if n.op != "output"})


def cast_module_weights_at_use(gm: fx.GraphModule, plan: dict[fx.Node, Decision], dtype: torch.dtype) -> None:
    """``weights="fp32"``, after the plan is recorded: each low-precision module call
    ``m(x)`` becomes ``call_with(m, names, casts, x)`` - the module called with its parameters
    cast, by explicit cast nodes in the graph - so they stay fp32 and are cast at use, as
    autocast does. The module is still called (its hooks, ``ampaudit.watch``'s included,
    fire); the node keeps its name and users. One cast per tensor and forward (autocast's
    cache): a tied weight used by two modules is cast once."""
    graph = gm.graph
    casts: dict[int, fx.Node] = {}  # id(tensor) -> its cast, for ties across modules
    for node in graph.nodes:  # casts the rewrite already made of get_attr tensors
        if node.target is cast and node.args[0].op == "get_attr" and node.args[1] == dtype:
            casts.setdefault(id(_attr(gm, node.args[0].target)), node)

    def cast_of(target: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
        if id(tensor) not in casts:
            with graph.inserting_before(before):
                casts[id(tensor)] = graph.call_function(cast, (graph.get_attr(target), dtype))
        return casts[id(tensor)]

    for node, decision in plan.items():
        if node.op != "call_module" or decision.compute != LOW:
            continue
        module = gm.get_submodule(node.target)
        state = {name: cast_of(f"{node.target}.{name}", t, node)
                 for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_floating_point()}
        with graph.inserting_before(node):
            owner = graph.get_attr(node.target)
        node.op, node.target = "call_function", call_with
        node.args = (owner, tuple(state), tuple(state.values()), *node.args)
    graph.lint()
    gm.recompile()


def _apply_clamp(node: fx.Node, clamp: dict[int | str, float]) -> None:
    args, kwargs = list(node.args), dict(node.kwargs)
    for where, value in clamp.items():
        if isinstance(where, int) and where < len(args):
            args[where] = value
        elif isinstance(where, str) and where in kwargs:
            kwargs[where] = value
    node.args, node.kwargs = tuple(args), kwargs
