"""The module backend: any model, traced or not, keeps its own class and forward.

torch.fx cannot trace most real models at the top level (every transformers model, nanoGPT).
This backend records what runs once (graph/recorder.py), decides every op as the fx backend
does (convert/plan.py), and applies the decisions per module instead of rewriting a graph:

- the forward runs under ``torch.autocast`` in the low dtype (so the user's own functional
  code follows autocast's rules), its float outputs returned in fp32; the plan's fp32 ops that
  autocast does not upcast on the device (softmax on a CPU, ``mean`` anywhere) get fp32
  inputs (convert/fp32_ops.py);
- a module whose ops all compute in the low dtype stores its parameters there (fp32 masters
  live in the optimizer, as with the fx backend);
- a leaf module with an op that needs fp32 (a norm, say), and any module holding one of the
  plan's overrides (a declared fp32 module, a missing kernel, verification, a constant the
  dtype cannot hold made by a factory), runs with autocast off on fp32 inputs; everything
  under such a module keeps fp32 parameters, and the plan says so: each op there is recorded
  as computing in float32 (the plan is what runs);
- a constant the dtype cannot hold, or a measured overflow, in a module with children
  (``scores.masked_fill(mask == 0, -1e9)`` in the Annotated Transformer's attention) is
  upcast at its own op, as the CPU's softmax is: the attention's Linears stay low.

The result is the user's model object - same class, same state_dict keys, ties kept (weights
are cast in place, as ``Module.to`` does).
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ampaudit.convert.emit import OVERRIDES, device_type, run_in_fp32
from ampaudit.convert.fp32_ops import Fp32Ops
from ampaudit.convert.function_backward import backward_as_forward
from ampaudit.convert.plan import FOLLOW, FP32, Decision, decide, plan_records
from ampaudit.convert.verify import error_sources
from ampaudit.core.catalog import Catalog, builtin_catalog
from ampaudit.core.dtypes import LowDtype
from ampaudit.graph import dtype_flow as flow
from ampaudit.graph.declared import declared_precision
from ampaudit.graph.forward import ExampleInputs, run_model
from ampaudit.graph.measure import measure_ranges
from ampaudit.graph.model_copy import copied_whole, copy_model
from ampaudit.graph.recorder import record_trace
from ampaudit.graph.trace import SubGraph
from ampaudit.graph.view import GraphView


class ModulePlanner:
    """One recorded run of the model, decided again for each set of promotions (the search)."""

    def __init__(self, model: torch.nn.Module, catalog: Catalog, low: LowDtype, inputs: ExampleInputs, *,
                 constants: str) -> None:
        # the model's own error on these inputs is one line, as check says it (not an ampaudit bug)
        gm, _ = run_model(model, inputs, runner=lambda: record_trace(model, inputs.args, inputs.kwargs, catalog))
        measure_ranges(gm, inputs, catalog, low)
        self.view = GraphView.build(SubGraph("", gm), catalog, low, frozenset(),
                                    declared=declared_precision(model, low))
        self.constants = constants
        self.sources = error_sources(gm, self.view.name)  # each op's measured error: where the search starts
        self.leaves = frozenset(name for name, module in model.named_modules() if _is_leaf(module))

    def records(self, promoted: Mapping[str, str | Decision]) -> list[dict[str, Any]]:
        view = self.view
        plan = decide(view, constants=self.constants, promoted=promoted)
        for node, decision in plan.items():
            # An override matters where the op would compute in the low dtype: an op on fp32
            # values (a mask built from finfo(float32).min) stays fp32 under autocast without help.
            if decision.rule in ("AMP201", "AMP301") and view.flow.get(node) != flow.LOW:
                plan[node] = Decision(FOLLOW, f"{decision.reason} - its inputs stay fp32 under autocast",
                                      decision.rule)
            elif decision.clamp:  # a constant can only be clamped in a rewritten graph: fp32 here
                plan[node] = Decision(FP32, f"{decision.reason}; the modules backend cannot rewrite a constant: "
                                            "it runs in fp32", "AMP201")
        return _what_runs(plan_records(view, plan, {}), self.leaves)


def _what_runs(records: list[dict[str, Any]], leaves: frozenset[str]) -> list[dict[str, Any]]:
    """The records with every op of a module that runs whole in fp32 computing in float32: a
    child Linear of an attention module kept in fp32 was planned low but ran in fp32."""
    whole = whole_fp32_modules(records, leaves)
    for record in records:
        module = record.get("module")
        if module and _under(module, whole) and record["op"].startswith("call_") \
                and record["compute"] not in ("float32", "follows its inputs"):
            owner = next(p for p in sorted(whole) if _under(module, {p}))
            record.update(compute="float32", reason=f"runs in fp32: module {owner} runs whole in fp32")
    return records


def whole_fp32_modules(records: Iterable[Mapping[str, Any]], leaves: frozenset[str]) -> set[str]:
    """The modules run whole in fp32 (autocast off, fp32 inputs): the outermost holding an
    override not upcast at its own op, and the leaves with an fp32 op no upcast at its own
    site can keep fp32 - a torch.nn leaf recorded whole (a norm), an in-place op, a factory.
    A leaf of the user's whose own ops were recorded (EDM2's ``MPConv``: the weight normalised
    in fp32, then a conv) has its fp32 ops upcast where they are (``fp32_ops``): run whole in
    fp32, its conv and matmul were fp32 too."""
    ops: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("op", "").startswith("call_") and record.get("module"):
            ops.setdefault(record["module"], []).append(record)
    overridden = _outermost({m for m, rs in ops.items()
                             if any(_override(r) and not _by_site(r, leaves) for r in rs)})
    leaves_fp32 = {m for m, rs in ops.items()
                   if m in leaves and any(r["compute"] == "float32" and _whole(r) for r in rs)}
    return overridden | leaves_fp32


# Ops that make a tensor from sizes and a value alone: upcasting their (no) tensor inputs
# cannot keep a constant in range, so their module runs in fp32.
_FACTORIES = frozenset({"full", "ones", "zeros", "empty", "tensor", "as_tensor", "arange", "linspace", "scalar_tensor"})


def _by_site(record: Mapping[str, Any], leaves: frozenset[str]) -> bool:
    """An override upcast at its own op (convert/fp32_ops.py), its module's other ops left as
    planned: a constant or measured overflow in a module with children, on a tensor input."""
    return record.get("rule") in ("AMP201", "AMP301") and record.get("compute") == "float32" \
        and record.get("module") not in leaves and record.get("kind") not in _FACTORIES and not _in_place(record)


def _whole(record: Mapping[str, Any]) -> bool:
    """An fp32 op of a leaf that only running the leaf whole in fp32 keeps fp32: a module
    recorded whole (its ops unseen), an in-place op or a factory, an override."""
    return record.get("op") == "call_module" or _in_place(record) or record.get("kind") in _FACTORIES \
        or _override(record)


def _in_place(record: Mapping[str, Any]) -> bool:
    """An in-place op (``scores.masked_fill_(mask, -1e9)``: node masked_fill_ or masked_fill__1),
    whose low tensor an upcast of its inputs cannot reach: its module runs in fp32."""
    base = re.sub(r"_\d+$", "", str(record.get("node", "")).rpartition(":")[2])
    return base.endswith("_") and not base.endswith("__")


def apply_module_plan(model: torch.nn.Module, records: Iterable[Mapping[str, Any]], low: LowDtype,
                      *, keep_low_outputs: bool = False, weights: str = "low",
                      catalog: Catalog | None = None) -> torch.nn.Module:
    """A copy of ``model`` converted by ``records``; the user's model is untouched.
    ``weights="fp32"``: parameters stay fp32 and autocast casts them at each use - no fp32
    masters needed, so training holds exactly what autocast + GradScaler holds. ``catalog``:
    the conversion's, to tell which of the plan's fp32 ops autocast upcasts itself."""
    records = list(records)
    work = copy_model(model).eval()
    ops: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("op", "").startswith("call_") and record.get("module") is not None:
            ops.setdefault(record["module"], []).append(record)
    modules = dict(work.named_modules())
    leaves = frozenset(name for name, module in modules.items() if _is_leaf(module))
    whole = {path for path in whole_fp32_modules(records, leaves) if path in modules}
    overridden = _outermost(whole)
    leaves_fp32 = whole - overridden
    for path in sorted(whole):
        if path:
            run_in_fp32(modules[path])
    for path, records_here in ops.items():
        module = modules.get(path)
        if weights != "low" or module is None or not path or _under(path, overridden) or path in leaves_fp32:
            continue
        if all(r["compute"] != "float32" for r in records_here) and any(r["compute"] == low.name for r in records_here):
            with torch.no_grad():
                for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    if tensor.is_floating_point():
                        tensor.data = tensor.data.to(low.torch)  # in place: ties stay ties
    work.ampaudit_low = (low.torch, keep_low_outputs)
    # sites outside the modules run whole in fp32 (a child Linear recorded fp32 there is no site:
    # nn.Linear's line is every Linear's)
    sites = [r for r in records if (r.get("rule") is None or _by_site(r, leaves))
             and not (r.get("module") and _under(r["module"], whole))]
    fp32_ops = Fp32Ops(sites, catalog if catalog is not None else builtin_catalog(),
                       ran={str(r["kind"]) for r in records if r.get("op") in ("call_function", "call_method")})
    for path in fp32_ops.modules():
        module = modules.get(path)
        if path and module is not None and not _under(path, overridden | leaves_fp32):
            module.ampaudit_fp32_ops = fp32_ops
            module.forward = types.MethodType(_fp32_ops_forward, module)
            copied_whole(module)
    work.ampaudit_fp32_ops = fp32_ops
    work.forward = types.MethodType(_autocast_forward, work)
    copied_whole(work)
    return work


# The wrappers are methods bound to their module (not closures over its forward), so a deep
# copy of the converted model - the training check makes one - calls its own modules.
def _autocast_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    dtype, keep_low_outputs = self.ampaudit_low
    device = device_type(args, kwargs)
    entered = functools.partial(_under_autocast, self, device, dtype)
    # a custom Function's backward (a recomputing checkpoint) runs again under what forward ran in
    with entered(), backward_as_forward(entered):
        out = type(self).forward(self, *args, **kwargs)
    return out if keep_low_outputs else _to_fp32(out)


@contextlib.contextmanager
def _under_autocast(self: torch.nn.Module, device: str, dtype: torch.dtype) -> Iterator[None]:
    """Autocast in the low dtype, and the plan's fp32 ops it leaves low on ``device`` upcast."""
    with torch.autocast(device, dtype=dtype), self.ampaudit_fp32_ops.entered(device):
        yield


def _fp32_ops_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module holding one of the plan's fp32 ops: its forward enters the upcast itself, as it
    runs again in backward under activation checkpointing."""
    with self.ampaudit_fp32_ops.entered(device_type(args, kwargs)):
        return type(self).forward(self, *args, **kwargs)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):  # HF's ModelOutput is an OrderedDict subclass: set items in place
        for key in list(value.keys()):
            value[key] = _to_fp32(value[key])
        return value
    return value


def _override(record: Mapping[str, Any]) -> bool:
    return record.get("compute") == "float32" and record.get("rule") in OVERRIDES


def _is_leaf(module: torch.nn.Module) -> bool:
    return next(module.children(), None) is None


def _outermost(paths: set[str]) -> set[str]:
    return {p for p in paths if not _under(p, paths - {p})}


def _under(path: str, parents: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in parents if p)
