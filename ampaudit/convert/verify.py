"""Verify a converted model against fp32 and promote what breaks it.

First per-node attribution: the ops whose own low-precision error (measured by the range
probe) is worst are promoted, a few more each round. If that is not enough, a search over
the module tree: promote every top-level module, then drop the modules not needed, then
look inside each kept module the same way - so the answer is as small as the tree allows,
and not an arbitrary slice of node order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ampaudit.graph.forward import ExampleInputs, iter_tensors
from ampaudit.graph.range_probe import MEASURED

Build = Callable[[dict[str, str]], fx.GraphModule]
MAX_ROUNDS = 6  # attribution rounds: 1, 2, 4, ... ops promoted


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def output_error(reference: torch.nn.Module | list[torch.Tensor], converted: torch.nn.Module,
                 inputs: ExampleInputs) -> float:
    """Worst relative L2 error over the float outputs; inf when the conversion is non-finite.
    ``reference``: the fp32 model, or its outputs already computed (``reference_outputs``)."""
    ref = reference if isinstance(reference, list) else reference_outputs(reference, inputs)
    with torch.no_grad():
        out = _tensors(converted(*inputs.args, **inputs.kwargs))
    worst = 0.0
    for r, o in zip(ref, out, strict=False):
        o = o.float()
        if not torch.isfinite(o).all():
            return math.inf
        scale = float(r.float().norm())
        diff = float((o - r.float()).norm())
        worst = max(worst, diff / scale if scale else diff)
    return worst


def reference_outputs(reference: torch.nn.Module, inputs: ExampleInputs) -> list[torch.Tensor]:
    """The fp32 model's float outputs, computed once for every comparison of a search."""
    with torch.no_grad():
        return _tensors(reference(*inputs.args, **inputs.kwargs))


def _ranked_ops(gm: torch.nn.Module) -> list[str]:
    """Low-precision ops, worst measured error first (the plan knows their names)."""
    computes = {r["node"]: r for r in gm.plan}
    if not isinstance(gm, fx.GraphModule):  # the modules backend ranked its recorded ops
        return [name for name in getattr(gm, "ampaudit_ranked", []) if computes.get(name, {}).get(
            "compute") not in (None, "float32")]
    scored = []
    for node in gm.graph.nodes:
        record = computes.get(node.name)
        m = node.meta.get(MEASURED)
        if record is None or record["compute"] == "float32" or m is None or m.rel_error is None:
            continue
        scored.append((m.rel_error, node.name))
    return [name for _, name in sorted(scored, reverse=True)]


def _units(gm: fx.GraphModule, prefix: str | None) -> list[str]:
    """Child modules of ``prefix`` (None: the model) that hold ops, in order; plus the ops
    written directly in that module, as "#node" units."""
    units: list[str] = []
    depth = 0 if prefix is None else prefix.count(".") + 1
    for record in gm.plan:
        module = record["module"]
        if not record["op"].startswith("call_"):
            continue
        inside = prefix is None or module == prefix or (module or "").startswith(prefix + ".")
        if not inside:
            continue
        if module is None or module == prefix:
            unit = f"#{record['node']}"
        else:
            unit = ".".join(module.split(".")[: depth + 1])
        if unit not in units:
            units.append(unit)
    return units


def _members(gm: fx.GraphModule, unit: str) -> dict[str, str]:
    if unit.startswith("#"):
        return {unit[1:]: "promoted by verification: its fp16 error breaks the output"}
    return {r["node"]: f"promoted by verification: module {unit} needs fp32 for the output to match"
            for r in gm.plan if r["op"].startswith("call_") and r["module"]
            and (r["module"] == unit or r["module"].startswith(unit + "."))}


def search_promotions(reference: torch.nn.Module, converted: fx.GraphModule, build: Build,
                      inputs: ExampleInputs, tolerance: float) -> fx.GraphModule:
    reference = reference_outputs(reference, inputs)  # one fp32 forward for the whole search
    before = output_error(reference, converted, inputs)
    if before <= tolerance:
        return _finish(converted, before, before)
    tried: dict[tuple[str, ...], tuple[float, fx.GraphModule]] = {}

    def attempt(units: list[str]) -> tuple[float, fx.GraphModule]:
        key = tuple(sorted(units))
        if key not in tried:
            chosen: dict[str, str] = {}
            for unit in units:
                chosen.update(_members(converted, unit))
            gm = build(chosen)
            tried[key] = (output_error(reference, gm, inputs), gm)
        return tried[key]

    def fixes(units: list[str]) -> bool:
        return attempt(units)[0] <= tolerance

    # 1. Per-node attribution: the worst measured ops, 1, 2, 4, ... of them.
    ranked = [f"#{name}" for name in _ranked_ops(converted)]
    found = None
    for round_ in range(MAX_ROUNDS):
        units = ranked[: 2 ** round_]
        if units and fixes(units):
            found = units
            break
        if len(units) == len(ranked):
            break
    # 2. Otherwise the module tree, from the top-level modules down.
    if found is None:
        top = _units(converted, None)
        if not fixes(top):  # even all of it in fp32 does not reach the tolerance: keep the best seen
            error, gm = min(tried.values(), key=lambda pair: pair[0])
            return _finish(gm, before, error)
        found = top
    units = _minimize(converted, found, fixes)
    error, gm = attempt(units)
    return _finish(gm, before, error)


def _minimize(converted: fx.GraphModule, units: list[str], fixes: Callable[[list[str]], bool]) -> list[str]:
    """Drop the units not needed; replace each kept module by its children when they suffice."""
    changed = True
    while changed:
        changed = False
        for unit in list(units):
            trial = [u for u in units if u != unit]
            if trial and fixes(trial):
                units, changed = trial, True
        for unit in [u for u in units if not u.startswith("#")]:
            inner = _units(converted, unit)
            if inner and inner != [unit]:
                trial = [u for u in units if u != unit] + inner
                if fixes(trial):
                    units, changed = trial, True
    return units


def _finish(gm: fx.GraphModule, before: float, after: float) -> fx.GraphModule:
    gm.summary.error_before, gm.summary.error_after = before, after
    return gm
