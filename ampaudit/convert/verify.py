"""Verify a converted model against fp32 and promote what breaks it.

Each forward pass of the search is counted (``summary.search``). First per-op attribution:
the range probe measured each op's low-precision error; an op computing in the low dtype is
its own unit, any other op's unit is the low-dtype ops that feed it (its error, measured on
rounded inputs, is theirs: a cancellation, an fp32 LayerNorm of values near 1000). All units
over the tolerance are promoted together first, then the worst 1, 2, 4, ... units until the
output matches, then the shortest prefix that matches; then each unit is dropped in turn to
see if it is needed. If no prefix is enough (or the model's top level did not trace), a
search over the module tree: promote every top-level module, then drop the modules not
needed, then look inside each kept module the same way. Trimming an answer stops once the
search has made ``MAX_FORWARDS`` forward passes; finding one costs at most
2 + log2(ops) + 1 passes, and what is returned always matched fp32 when it was tried.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.tensors import iter_tensors
from ampaudit.graph.forward import ExampleInputs
from ampaudit.graph.range_probe import MEASURED, untrained_batch_norm

Build = Callable[[dict[str, str]], fx.GraphModule]
MAX_FORWARDS = 20  # forward passes one search makes before it stops trimming what it promotes


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def output_error(reference: torch.nn.Module | list[torch.Tensor], converted: torch.nn.Module,
                 inputs: ExampleInputs) -> float:
    """Worst relative L2 error over the float outputs; inf when the conversion is non-finite.
    ``reference``: the fp32 model, or its outputs already computed (``reference_outputs``)."""
    ref = reference if isinstance(reference, list) else reference_outputs(reference, inputs)
    with torch.no_grad(), attributes_kept(converted), untrained_norms_use_batch_statistics(converted):
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


# Said where the converted outputs equal fp32's to the bit: an error measured so is no measure.
ZERO_REFERENCE = ("error vs fp32 not measured: the converted model's outputs equal fp32's exactly on the example "
                  "inputs - no low-precision rounding reaches them (a zero-initialised last layer or gain, as DiT's "
                  "adaLN-Zero or EDM2's out_gain)")


def record_error(summary: Any, before: float, after: float, compared: bool = True) -> None:
    """The output error vs fp32 into ``summary`` - or, where the converted outputs equal fp32's
    to the bit (and any were ``compared``), ``ZERO_REFERENCE`` in its notes and no error."""
    if compared and before == 0.0 and after == 0.0:
        summary.error_before = summary.error_after = None
        summary.notes.append(ZERO_REFERENCE)
    else:
        summary.error_before, summary.error_after = before, after


def reference_outputs(reference: torch.nn.Module, inputs: ExampleInputs) -> list[torch.Tensor]:
    """The fp32 model's float outputs, computed once for every comparison of a search."""
    with torch.no_grad(), attributes_kept(reference), untrained_norms_use_batch_statistics(reference):
        return _tensors(reference(*inputs.args, **inputs.kwargs))


@contextmanager
def untrained_norms_use_batch_statistics(model: torch.nn.Module) -> Iterator[None]:
    """A BatchNorm that never saw a batch (running mean 0, variance 1: a model built, not yet
    trained) does not normalise at all in eval mode, and the outputs it leads to can be far
    from anything training sees - timm's efficientnet_b0 gives logits near 2e-6 at 32 x 32,
    below fp16's normal range. Compared that way, verification would promote ops for an error
    training never has. Such norms normalise with the batch's own statistics here, as
    training does and as the range audit measures (running statistics untouched)."""
    handles = [m.register_forward_hook(_batch_normalised) for m in model.modules() if untrained_batch_norm(m)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _batch_normalised(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or x.dim() < 2 \
            or x.numel() <= x.shape[1]:  # one value per channel: no batch statistics
        return output
    weight, bias = module.weight, module.bias
    out = torch.nn.functional.batch_norm(x.float(), None, None, None if weight is None else weight.float(),
                                         None if bias is None else bias.float(), True, 0.0, module.eps)
    return out.to(output.dtype)


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
                      inputs: ExampleInputs, tolerance: float, *, budget: int = MAX_FORWARDS) -> fx.GraphModule:
    """Promote what keeps ``converted`` from matching ``reference`` within ``tolerance``.
    ``converted.summary.search`` counts the forward passes it made (the fp32 reference, the
    first comparison, one per promotion set tried)."""
    return _Search(reference, converted, build, inputs, tolerance, budget).run()


class _Search:
    def __init__(self, reference: torch.nn.Module, converted: fx.GraphModule, build: Build, inputs: ExampleInputs,
                 tolerance: float, budget: int) -> None:
        self.converted, self.build, self.inputs, self.tolerance, self.budget = (converted, build, inputs,
                                                                                 tolerance, budget)
        self.reference = reference_outputs(reference, inputs)  # one fp32 forward for the whole search
        self.forwards = 1
        self.tried: dict[tuple[str, ...], tuple[float, fx.GraphModule]] = {}
        self.op_units: dict[str, dict[str, str]] = {}  # "#op" unit -> the ops it promotes, with why

    def compare(self, gm: fx.GraphModule) -> float:
        self.forwards += 1
        return output_error(self.reference, gm, self.inputs)

    def attempt(self, units: list[str]) -> tuple[float, fx.GraphModule]:
        key = tuple(sorted(units))
        if key not in self.tried:
            chosen: dict[str, str] = {}
            for unit in units:
                chosen.update(self.op_units.get(unit) or _members(self.converted, unit))
            gm = self.build(chosen)
            self.tried[key] = (self.compare(gm), gm)
        return self.tried[key]

    def fixes(self, units: list[str]) -> bool:
        return self.attempt(units)[0] <= self.tolerance

    def spare(self, units: list[str]) -> bool:
        """Whether ``units`` fixes the output, tried only while the budget lasts (else: no)."""
        if tuple(sorted(units)) not in self.tried and self.forwards >= self.budget:
            return False
        return self.fixes(units)

    def run(self) -> fx.GraphModule:
        before = self.compare(self.converted)
        if before <= self.tolerance:
            return self.finish(self.converted, before, before)
        # 1. The ops whose own low-precision error is worst, as units that remove it: the ops
        # over the tolerance first, then twice as many each round; then the shortest prefix.
        ranked, over = self.ranked_units()
        found, known_bad, k = None, 0, max(1, over)
        while ranked:
            k = min(k, len(ranked))
            if self.fixes(ranked[:k]):
                found = ranked[:k]
                break
            known_bad = k
            if k == len(ranked):
                break
            k *= 2
        if found is not None:
            if k > max(1, over):  # doubled past it: halve the gap
                while k - known_bad > 1 and self.forwards < self.budget:
                    middle = (known_bad + k) // 2
                    if self.fixes(ranked[:middle]):
                        k = middle
                    else:
                        known_bad = middle
                found = ranked[:k]
            necessary = {found[-1]} if known_bad == k - 1 else set()  # the prefix without it failed
            units = self.drop_unneeded(found, necessary)
        else:
            # 2. Otherwise the module tree, from the top-level modules down.
            top = _units(self.converted, None)
            if not self.fixes(top):  # even all of it in fp32 does not reach the tolerance: keep the best seen
                error, gm = min(self.tried.values(), key=lambda pair: pair[0])
                return self.finish(gm, before, error)
            units = _minimize(self.converted, top, self.spare)
        error, gm = self.attempt(units)
        return self.finish(gm, before, error)

    def drop_unneeded(self, units: list[str], necessary: set[str]) -> list[str]:
        """Try the set without each unit, least suspect first, while the budget lasts."""
        for unit in reversed(list(units)):
            trial = [u for u in units if u != unit]
            if unit not in necessary and trial and self.spare(trial):
                units = trial
        return units

    def ranked_units(self) -> tuple[list[str], int]:
        """Op units, worst measured error first, and how many are over the tolerance.

        An op that computes in the low dtype is its own unit. Any other op was measured on
        inputs already rounded, so its error may be theirs - a subtraction of 1000 from fp16
        values near 1000, an fp32 LayerNorm of them: its unit is the low-dtype ops that feed it
        (through ops that follow their inputs' dtype), whose promotion gives it fp32 inputs, or
        nothing when it reads fp32 values only."""
        sources = error_sources_of(self.converted)
        records = {r["node"]: r for r in self.converted.plan}
        low = self.converted.summary.dtype

        def feeding(name: str) -> list[str]:
            found: list[str] = []
            stack, seen = list(sources.inputs.get(name, ())), set()
            while stack:
                node = stack.pop()
                if node in seen:
                    continue
                seen.add(node)
                record = records.get(node)
                if record is None:  # a cast the rewrite inserted: look through it
                    stack.extend(sources.inputs.get(node, ()))
                elif not record["op"].startswith("call_") or record["compute"] == "float32":
                    continue
                elif record["compute"] == low:
                    found.append(node)
                else:
                    stack.extend(sources.inputs.get(node, ()))
            return sorted(found)

        ranked, over, covered = [], 0, set()
        for error, name in sorted(((e, n) for n, e in sources.errors.items()), key=lambda pair: -pair[0]):
            record = records.get(name)
            if record is None or not record["op"].startswith("call_"):
                continue
            if record["compute"] == low:
                members = {name: "promoted by verification: its low-precision error breaks the output"}
            else:
                members = {op: f"promoted by verification: its low-precision output feeds {name}, whose "
                               "error on rounded inputs breaks the output" for op in feeding(name)}
            if not members or set(members) <= covered:
                continue
            covered |= set(members)
            self.op_units[f"#{name}"] = members
            ranked.append(f"#{name}")
            over += error > self.tolerance
        return ranked, over

    def finish(self, gm: fx.GraphModule, before: float, after: float) -> fx.GraphModule:
        record_error(gm.summary, before, after, compared=any(t.numel() for t in self.reference))
        gm.summary.search = {"forwards": self.forwards, "tried": len(self.tried)}
        return gm


@dataclass
class ErrorSources:
    """What the search ranks by: each measured op's low-precision error (the range probe's,
    with its inputs rounded) and the ops each op reads, by plan name."""

    errors: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)


def error_sources(gm: fx.GraphModule, name: Callable[[fx.Node], str] = lambda n: n.name) -> ErrorSources:
    sources = ErrorSources()
    for node in gm.graph.nodes:
        sources.inputs[name(node)] = tuple(name(p) for p in node.all_input_nodes)
        m = node.meta.get(MEASURED)
        if m is not None and m.rel_error is not None:
            sources.errors[name(node)] = m.rel_error
    return sources


def error_sources_of(converted: torch.nn.Module) -> ErrorSources:
    """The converted graph's (fx backend), or the recorded run's the modules backend attached;
    none for a model whose top level did not trace (the search goes by modules there)."""
    attached = getattr(converted, "ampaudit_sources", None)
    if attached is not None:
        return attached
    return error_sources(converted) if isinstance(converted, fx.GraphModule) else ErrorSources()


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
