"""``ampaudit.convert``: a model rewritten into explicit mixed precision (and, given an
optimizer, one that keeps fp32 master weights and scales the loss)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

from ampaudit.convert.checkpoints import keep_checkpoints
from ampaudit.convert.kernel_probe import low_sites_without_kernel, promote_missing_kernels
from ampaudit.convert.low_weights import fp32_copy, fp32_inputs, low_weight_dtypes, low_weight_notes
from ampaudit.convert.module_backend import ModulePlanner, apply_module_plan
from ampaudit.convert.plan import FP32, LOW, Decision, decide, plan_records
from ampaudit.convert.rewrite import cast_module_weights_at_use, rewrite
from ampaudit.convert.runtime import Retracer
from ampaudit.convert.train_check import DEFAULT_STEPS, train_check
from ampaudit.convert.verify import output_error, record_error, search_promotions
from ampaudit.core.arguments import require_module
from ampaudit.core.catalog import Catalog, build_catalog
from ampaudit.core.config import Config, load_config
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.errors import UsageError
from ampaudit.graph.declared import Declared, declared_precision
from ampaudit.graph.dtype_flow import non_float_in_code
from ampaudit.graph.forward import ExampleInputs, failures_explained, refuse_meta, run_model
from ampaudit.graph.fx_tracer import forward_location, fx_trace
from ampaudit.graph.measure import measure_ranges
from ampaudit.graph.model_copy import copy_model
from ampaudit.graph.module_calls import concrete_args, record_calls
from ampaudit.graph.range_probe import DTYPE, MEASURED, SHAPE
from ampaudit.graph.trace import SubGraph
from ampaudit.graph.view import GraphView

DEFAULT_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}  # relative L2 error of the outputs vs fp32


@dataclass
class ConversionSummary:
    dtype: str
    casts: int
    ops_fp32: int
    ops_low: int
    param_bytes: dict[str, int]  # dtype name -> bytes of parameters stored in it
    error_before: float | None = None  # output error vs fp32 before promotions (None: not verified)
    error_after: float | None = None
    promoted: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    train: dict[str, Any] | None = None  # the training check (train_check.TrainCheck), when one ran
    search: dict[str, int] | None = None  # the promotion search: forward passes made, promotion sets tried
    backend: str = "fx"  # "fx" or "modules"
    weights: str = "low"  # "low" (stored low, fp32 masters in the optimizer) or "fp32" (cast at each use)
    constants: str = "fp32"  # how it was made, so that ampaudit.apply can make it again
    keep_low_outputs: bool = False
    # children traced on their own with the plain non-tensor arguments they were called with
    # (path -> {argument: value}: lucidrains' block2(h) leaves scale_shift=None), so that
    # ampaudit.apply, which has no example inputs, traces them the same way
    fixed_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    # modules whose own forward torch.fx could not trace (fx backend): it runs in fp32 and none
    # of its own ops is in the plan, so the policies --emit writes keep it in fp32 whole
    untraced: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _split_args(optimizer_or_inputs: Any, example_inputs: Any) -> tuple[torch.optim.Optimizer | None, Any]:
    if isinstance(optimizer_or_inputs, torch.optim.Optimizer):
        return optimizer_or_inputs, example_inputs
    if optimizer_or_inputs is not None and example_inputs is not None:
        raise UsageError("convert(model, optimizer, example_inputs=...): the second argument is not an optimizer")
    return None, optimizer_or_inputs if optimizer_or_inputs is not None else example_inputs


def convert(
    model: torch.nn.Module,
    optimizer_or_inputs: Any = None,
    example_inputs: Any = None,
    *,
    dtype: LowDtype | torch.dtype | str = torch.float16,
    verify: bool = True,
    policy: str | Path | Mapping | None = None,
    keep_low_outputs: bool = False,
    constants: str = "fp32",
    tolerance: float | None = None,
    loss_scale: str | float | None = "auto",
    config: Config | None = None,
    train_steps: int = DEFAULT_STEPS,
    backend: str = "auto",
    weights: str = "auto",
):
    """Rewrite ``model`` into explicit mixed precision.

    ``convert(model, example_inputs)`` returns the converted module; ``convert(model,
    optimizer, example_inputs=...)`` also returns an :class:`MixedPrecisionOptimizer` that
    keeps fp32 master weights. With example inputs the value ranges are measured and, with
    ``verify``, ops are promoted to fp32 until the outputs match fp32 within ``tolerance``.
    ``constants``: "fp32" or "clamp" for constants the low dtype cannot hold.
    Given an optimizer and example inputs, ``verify`` also trains: ``train_steps`` steps of
    copies of both models compared loss by loss (``model_mp.summary.train``).
    ``backend``: "fx" rewrites the traced graph (where the top level does not trace, its
    children); "modules" keeps the model's own class and forward and applies the plan per
    module (convert/module_backend.py; needs example inputs); "auto": fx where the top level
    traces, else modules. ``weights``: "low" stores low-precision modules' parameters low (fp32
    masters in the optimizer); "fp32" keeps every parameter fp32 and casts it at each use, as
    autocast does - the memory of autocast + GradScaler, with the plan's fp32 ops; "auto" (the
    default): fp32 when an optimizer is given, low otherwise. A model converted already (an
    export loaded with ``ampaudit.apply``, to resume training) is returned as it is - with an
    optimizer, together with its loss scaling and fp32 masters.
    """
    require_module(model, "ampaudit.convert", eager=True)
    # a complex buffer (rotary frequencies) is kept as it is, as autocast keeps it; a complex
    # parameter would need complex master weights and a low complex dtype that does not exist
    complex_state = next((name for name, t in model.named_parameters() if t.is_complex()), None)
    if complex_state is not None:
        raise UsageError(f"{complex_state} is a complex parameter: ampaudit converts real floating-point models "
                         "(float16/bfloat16 have no complex counterpart to convert to)")
    optimizer, example_inputs = _split_args(optimizer_or_inputs, example_inputs)
    if converted_already(model):
        return _resume(model, optimizer, loss_scale)
    user_model, found_low = model, low_weight_dtypes(model)
    if found_low:  # bf16/fp16 weights: convert an fp32 copy (the optimizer still names the user's)
        model = fp32_copy(model)
    if constants not in ("fp32", "clamp"):
        raise UsageError(f"constants must be 'fp32' or 'clamp' (got {constants!r})")
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and 0 <= tolerance < math.inf):
        raise ValueError(f"ampaudit.convert() tolerance must be a finite relative error >= 0, not {tolerance!r}")
    if not isinstance(train_steps, int) or isinstance(train_steps, bool) or train_steps < 0:
        raise ValueError(f"ampaudit.convert() train_steps must be a whole number >= 0, not {train_steps!r}")
    low = LowDtype.parse(dtype)
    file = forward_location(model).file
    config = config if config is not None else load_config(Path(file) if Path(file).is_file() else None)
    catalog = build_catalog(config, policy)
    inputs = ExampleInputs.coerce(example_inputs, "example_inputs") if example_inputs is not None else None
    if inputs is not None and found_low:
        inputs = fp32_inputs(inputs)
    if inputs is not None and verify:
        refuse_meta(model, inputs, "verifying the conversion needs real values (or pass --no-verify, verify=False)")
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[low.name]
    if inputs is not None:  # bad inputs fail here, in one line - not deep inside a conversion's own run
        _run_in_eval(model, inputs)
    backend = _pick_backend(backend, model, catalog, inputs)
    weights = _pick_weights(weights, optimizer)
    if backend == "modules":
        model_mp = _convert_modules(model, catalog, low, inputs, constants=constants,
                                    keep_low_outputs=keep_low_outputs, verify=verify, weights=weights, tolerance=tol)
        model_mp.summary.notes += low_weight_notes(found_low, low)
        return _finish(user_model, model_mp, optimizer, inputs, low, verify=verify, loss_scale=loss_scale,
                       train_steps=train_steps)

    kernels: dict[str, Decision] = {}  # ops with no low-precision kernel here: fp32 in every build
    seen = _Measured()  # what the example inputs showed, measured by the first build only

    def build(promoted: Mapping[str, str | Decision]) -> fx.GraphModule:
        return _convert_once(model, catalog, low, inputs, promoted={**promoted, **kernels}, constants=constants,
                             keep_low_outputs=keep_low_outputs, weights=weights, measured=seen)

    was_training = model.training
    model.eval()  # compare deterministic outputs: dropout off on both sides
    try:
        if inputs is not None:
            model_mp, moved = promote_missing_kernels(build, inputs, low.name)
            kernels.update(moved)
        else:
            model_mp = build({})
        if inputs is not None and verify:
            model_mp = search_promotions(model, model_mp, build, inputs, tol)
        elif inputs is not None:
            error = output_error(model, model_mp, inputs)
            record_error(model_mp.summary, error, error)
    finally:
        model.train(was_training)
    model_mp.train(was_training)  # nn.Dropout / BatchNorm modules follow the mode as usual
    model_mp.summary.notes += low_weight_notes(found_low, low)
    return _finish(user_model, model_mp, optimizer, inputs, low, verify=verify, loss_scale=loss_scale,
                   train_steps=train_steps)


def _run_in_eval(model: torch.nn.Module, inputs: ExampleInputs) -> None:
    """One forward in eval mode, as every run of the conversion: a LoadError where it fails."""
    was_training = model.training
    model.eval()
    try:
        with failures_explained(model, inputs):
            run_model(model, inputs)
    finally:
        model.train(was_training)


def converted_already(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a conversion (``ampaudit.convert``'s or ``ampaudit.apply``'s result)."""
    return isinstance(getattr(model, "summary", None), ConversionSummary) and hasattr(model, "plan")


def _resume(model_mp: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_scale: Any):
    """A model converted already (an export loaded with ``ampaudit.apply``, to train on) is
    not converted again: it is returned as it is, with, given an optimizer built on its
    parameters, loss scaling and fp32 masters of its low-precision weights - made from those
    weights, so an export with ``weights="low"`` resumes from fp16-rounded masters unless
    ``opt_mp.load_state_dict`` brings the saved ones back."""
    if optimizer is None:
        return model_mp
    from ampaudit.convert.optimizer import MixedPrecisionOptimizer

    dtype = LowDtype.parse(model_mp.summary.dtype).torch
    return model_mp, MixedPrecisionOptimizer.from_optimizer(optimizer, model_mp, model_mp, dtype=dtype,
                                                            loss_scale=loss_scale)


def _pick_weights(weights: str, optimizer: torch.optim.Optimizer | None) -> str:
    """"auto": fp32 when training (an optimizer is given: what autocast + GradScaler holds, no
    second copy of the weights), low otherwise (inference: half the weights' bytes)."""
    if weights not in ("auto", "low", "fp32"):
        raise UsageError(f"weights must be 'auto', 'low' or 'fp32' (got {weights!r})")
    if weights == "auto":
        return "fp32" if optimizer is not None else "low"
    return weights


def _pick_backend(backend: str, model: torch.nn.Module, catalog: Catalog, inputs: ExampleInputs | None) -> str:
    if backend not in ("fx", "modules", "auto"):
        raise UsageError(f"backend must be 'fx', 'modules' or 'auto' (got {backend!r})")
    if backend == "modules" and inputs is None:
        raise UsageError("the modules backend records the model running: give example inputs")
    if backend == "auto":
        return "fx" if inputs is None or fx_trace(model, catalog, functions_as_leaves=True)[0] is not None \
            else "modules"
    return backend


def _convert_modules(model: torch.nn.Module, catalog: Catalog, low: LowDtype, inputs: ExampleInputs, *,
                     constants: str, keep_low_outputs: bool, verify: bool, weights: str,
                     tolerance: float) -> torch.nn.Module:
    was_training = model.training
    model.eval()
    try:
        planner = ModulePlanner(model, catalog, low, inputs, constants=constants)

        kernels: dict[str, Decision] = {}  # ops whose low call has no kernel here: fp32 in every build

        def build(promoted: Mapping[str, str | Decision]) -> torch.nn.Module:
            promoted = {**promoted, **kernels}
            records = planner.records(promoted)
            built = apply_module_plan(model, records, low, keep_low_outputs=keep_low_outputs, weights=weights,
                                      catalog=catalog)
            built.ampaudit_sources = planner.sources
            return _with_plan(built, records, low, promoted, casts=0, constants=constants,
                              keep_low_outputs=keep_low_outputs, backend="modules", weights=weights,
                              notes=["modules backend: the model's own forward under autocast, the plan applied "
                                     "per module"])

        model_mp, moved = low_sites_without_kernel(build, inputs, low.name)
        kernels.update(moved)
        if verify:
            model_mp = search_promotions(model, model_mp, build, inputs, tolerance)
    finally:
        model.train(was_training)
    model_mp.train(was_training)
    return model_mp


def _finish(model: torch.nn.Module, model_mp: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            inputs: ExampleInputs | None, low: LowDtype, *, verify: bool, loss_scale: Any, train_steps: int):
    """The converted model alone, or with its optimizer after the training check."""
    if optimizer is None:
        return model_mp
    if inputs is not None and verify and train_steps > 0:
        model_mp.summary.train = train_check(model, model_mp, optimizer, inputs, dtype=low, loss_scale=loss_scale,
                                             steps=train_steps).to_dict()
    from ampaudit.convert.optimizer import MixedPrecisionOptimizer

    return model_mp, MixedPrecisionOptimizer.from_optimizer(optimizer, model, model_mp, dtype=low.torch,
                                                            loss_scale=loss_scale)


def convert_by_plan(model: torch.nn.Module, summary: Mapping[str, Any], records: list[Mapping[str, Any]], *,
                    config: Config | None = None) -> torch.nn.Module:
    """``model`` converted as an earlier conversion was (``plan.json``'s summary and records):
    every op it ran in fp32 - by the catalog, a constant, a measured overflow or verification -
    is fp32 again, without example inputs or a search."""
    try:
        low = LowDtype.parse(summary["dtype"])
        constants, keep = str(summary.get("constants", "fp32")), bool(summary.get("keep_low_outputs", False))
        # what depended on the example inputs: verification's promotions, measured overflows
        forced = {str(r["node"]): Decision(FP32, str(r["reason"]), r["rule"]) for r in records
                  if r.get("compute") == "float32" and r.get("rule") in ("verify", "AMP301", "kernel")}
        forced |= {str(r["node"]): Decision(LOW, str(r["reason"]), "measured") for r in records
                   if r.get("rule") == "measured"}
        fixed_args = {str(k): dict(v) for k, v in (summary.get("fixed_args") or {}).items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"not an ampaudit plan: {exc}") from None
    if low_weight_dtypes(model):  # a bf16/fp16 model: its fp32 copy, as convert made it
        model = fp32_copy(model)
    file = forward_location(model).file
    config = config if config is not None else load_config(Path(file) if Path(file).is_file() else None)
    if summary.get("backend") == "modules":  # the records say what each module does: nothing to trace
        model_mp = apply_module_plan(model, records, low, keep_low_outputs=keep,
                                     weights=str(summary.get("weights", "low")), catalog=build_catalog(config))
        model_mp.train(model.training)
        model_mp.plan, model_mp.summary = [dict(r) for r in records], ConversionSummary(**dict(summary))
        return model_mp
    was_training = model.training
    try:
        model_mp = _convert_once(model, build_catalog(config), low, None, promoted=forced, constants=constants,
                                 keep_low_outputs=keep, weights=str(summary.get("weights", "low")),
                                 fixed_args=fixed_args)
    finally:
        model.train(was_training)
    model_mp.train(was_training)
    return model_mp


@dataclass
class _Measured:
    """What the example inputs showed, kept across the builds of one conversion: each build
    (one per promotion set the search tries) traces the same graphs, so the recorded calls
    and the measured ranges are taken from the first build instead of running the model again."""

    calls: dict[str, ExampleInputs] | None = None
    graphs: dict[str, tuple[list[str], dict[str, dict[str, Any]]]] = field(default_factory=dict)

    def measure(self, prefix: str, gm: fx.GraphModule, inputs: ExampleInputs, catalog: Catalog, low: LowDtype) -> None:
        names = [n.name for n in gm.graph.nodes]
        known = self.graphs.get(prefix)
        if known is not None and known[0] == names:
            for node in gm.graph.nodes:
                node.meta.update(known[1].get(node.name, {}))
            return
        measure_ranges(gm, inputs, catalog, low)
        self.graphs[prefix] = (names, {n.name: {k: n.meta[k] for k in (MEASURED, SHAPE, DTYPE) if k in n.meta}
                                       for n in gm.graph.nodes})


@dataclass
class _Conversion:
    """What every module of one conversion shares, and what it gathers."""

    catalog: Catalog
    low: LowDtype
    promoted: Mapping[str, str | Decision]
    constants: str
    keep_low_outputs: bool
    weights: str = "low"  # "low": stored low (fp32 masters in the optimizer); "fp32": cast at each use
    calls: Mapping[str, ExampleInputs] = field(default_factory=dict)  # how each submodule was called
    declared: Declared = field(default_factory=Declared)  # what the model keeps in fp32 itself
    records: list[dict[str, Any]] = field(default_factory=list)  # the plan, op by op
    notes: list[str] = field(default_factory=list)
    casts: int = 0
    measured: _Measured = field(default_factory=_Measured)
    fixed_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # see ConversionSummary.fixed_args
    untraced: list[str] = field(default_factory=list)  # see ConversionSummary.untraced


def _convert_once(model: torch.nn.Module, catalog: Catalog, low: LowDtype,
                  inputs: ExampleInputs | None, *, promoted: Mapping[str, str | Decision], constants: str,
                  keep_low_outputs: bool, weights: str = "low", measured: _Measured | None = None,
                  fixed_args: Mapping[str, dict[str, Any]] | None = None) -> torch.nn.Module:
    work = copy_model(model).eval()  # never touch the user's model
    measured = measured if measured is not None else _Measured()
    if measured.calls is None:  # how each child is called, for children traced on their own
        measured.calls = record_calls(work, inputs) if inputs is not None else {}
    run = _Conversion(catalog, low, promoted, constants, keep_low_outputs, weights, calls=measured.calls,
                      declared=declared_precision(work, low), measured=measured,
                      fixed_args={k: dict(v) for k, v in (fixed_args or {}).items()})
    converted = _with_plan(_convert_tree(work, "", inputs, run), run.records, low, promoted, casts=run.casts,
                           notes=run.notes, constants=constants, keep_low_outputs=keep_low_outputs,
                           weights=weights, fixed_args=run.fixed_args, untraced=run.untraced)
    if not isinstance(converted, fx.GraphModule):
        converted.code = f"# {type(model).__name__}.forward is not traceable: its submodules were converted\n"
    return converted


def _convert_tree(module: torch.nn.Module, prefix: str, inputs: ExampleInputs | None,
                  run: _Conversion, *, keep_low_outputs: bool | None = None) -> torch.nn.Module:
    """Convert ``module``; where torch.fx cannot trace a forward, keep that forward in fp32
    and convert the submodules it calls, recursively."""
    call = run.calls.get(prefix) if prefix else None  # the model itself is traced as the user calls it
    fixed = concrete_args(module, call) if call is not None else run.fixed_args.get(prefix) if prefix else None
    if prefix and fixed and all(_plain(v) for v in fixed.values()):
        run.fixed_args[prefix] = dict(fixed)
    gm, failure = fx_trace(module, run.catalog, concrete_args=fixed, functions_as_leaves=True)
    opaque: list[str] = []
    while gm is None and failure.module and failure.module not in opaque:
        opaque.append(failure.module)  # keep the failing submodule whole; trace the rest
        gm, failure = fx_trace(module, run.catalog, opaque, concrete_args=fixed, functions_as_leaves=True)
    label = prefix or type(module).__name__
    if gm is None:
        run.untraced.append(prefix)
        run.notes.append(f"{label}: forward not traceable by torch.fx ({failure.message}); kept in fp32, "
                         "its submodules converted")
        _convert_children(module, prefix, run)
        return module
    _keep_untraced_state(gm, module)
    _keep_plain_attributes(gm, module)
    _follow_order(gm, module)
    if inputs is not None:
        run.measured.measure(prefix, gm, inputs, run.catalog, run.low)
    if any(n.op == "call_function" and getattr(n.target, "__name__", "") == "dropout" for n in gm.graph.nodes):
        run.notes.append(f"{label}: F.dropout(..., training=self.training) was traced in eval mode and stays off "
                         "in the converted model; nn.Dropout modules follow model_mp.train() as usual")
    view = GraphView.build(SubGraph(prefix, gm), run.catalog, run.low, frozenset(_join(prefix, p) for p in opaque),
                           declared=run.declared)
    plan = decide(view, constants=run.constants, promoted=run.promoted)
    keep = run.keep_low_outputs if keep_low_outputs is None else keep_low_outputs
    stats = rewrite(gm, plan, run.low.torch, keep_low_outputs=keep, weights=run.weights,
                    non_float=non_float_in_code(gm, view.kinds, run.catalog, python=view.python))
    gm._tracer_cls = Retracer  # torch.save(model): the load traces the code again, with this
    run.records += plan_records(view, plan, stats.produced)
    if run.weights == "fp32":
        cast_module_weights_at_use(gm, plan, run.low.torch)
    if kept := keep_checkpoints(gm):
        run.notes.append(f"{label}: {kept} torch.utils.checkpoint call(s) kept: their ops, converted, are "
                         "recomputed in backward")
    run.casts += stats.casts
    for path in opaque:
        run.untraced.append(_join(prefix, path))
        run.notes.append(f"{_join(prefix, path)}: forward not traceable by torch.fx; kept in fp32, its submodules "
                         "converted")
        _convert_children(gm.get_submodule(path), _join(prefix, path), run)
    return gm


def _keep_untraced_state(gm: fx.GraphModule, module: torch.nn.Module) -> None:
    """Give ``gm`` back the parameters and buffers of ``module`` its graph does not read: a
    GraphModule holds only what the forward uses, but the state_dict keys and ties are the
    model's (transformers' BERT keeps ``cls.predictions.bias``, tied to ``decoder.bias``,
    which its forward never reads: dropped, the tie would be lost and the optimizer would
    train a tensor the converted model does not hold)."""
    for name, _ in module.named_buffers():  # a buffer the graph reads is registered persistent
        path, _, attr = name.rpartition(".")
        if attr in module.get_submodule(path)._non_persistent_buffers_set:
            try:
                owner = gm.get_submodule(path)
            except AttributeError:
                continue
            if attr in owner._buffers:  # BERT's position_ids had become a state_dict key
                owner._non_persistent_buffers_set.add(attr)
    held = dict(_state(gm))
    for name, tensor in _state(module):
        if name in held:
            continue
        path, _, attr = name.rpartition(".")
        source = module.get_submodule(path)
        try:
            owner = gm.get_submodule(path)
        except AttributeError:  # a whole submodule the forward never calls: keep it as it is
            gm.add_submodule(path, source)
            held |= {f"{path}.{n}": t for n, t in _state(source)}
            continue
        if attr in source._parameters:
            owner.register_parameter(attr, tensor)
        else:
            owner.register_buffer(attr, tensor, persistent=attr not in source._non_persistent_buffers_set)
        held[name] = tensor


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
_PRESERVED = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")


def _keep_plain_attributes(gm: fx.GraphModule, module: torch.nn.Module) -> None:
    """Give ``gm`` (and each submodule it holds in a new object) the plain attributes of the
    module it replaces, which a parent whose own forward is not traced may read: Whisper's
    encoder computes its length from ``self.conv1.stride``, and a converted Conv1d had none
    ("'Conv1d' object has no attribute 'stride'")."""
    for path, source in module.named_modules():
        try:
            target = gm.get_submodule(path) if path else gm
        except AttributeError:
            continue
        if target is source:
            continue
        for name, value in vars(source).items():
            if name.startswith("_") or name in vars(target) or name == "training":
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                setattr(target, name, value)
                if isinstance(target, fx.GraphModule):  # what GraphModule's deepcopy sets again
                    target.meta.setdefault(_PRESERVED, {})[name] = value


def _follow_order(gm: fx.GraphModule, module: torch.nn.Module) -> None:
    """Put ``gm``'s submodules, parameters and buffers in ``module``'s order, level by level: a
    GraphModule holds them in the order the graph first reads them (and ``_keep_untraced_state``
    adds the rest at the end), but ``state_dict()`` and ``named_parameters()`` keys come in the
    model's order (a checkpoint written from one is read by position in some tools)."""
    originals = dict(module.named_modules(remove_duplicate=False))
    for path, owner in gm.named_modules(remove_duplicate=False):
        original = originals.get(path)
        if original is None:
            continue
        for slot in ("_modules", "_parameters", "_buffers"):
            mine, theirs = getattr(owner, slot), getattr(original, slot)
            order = {name: i for i, name in enumerate(theirs)}
            ordered = sorted(mine.items(), key=lambda item: order.get(item[0], len(order)))  # stable: ties kept
            mine.clear()
            mine.update(ordered)


def _state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name (a tied tensor once per name)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _convert_children(owner: torch.nn.Module, prefix: str, run: _Conversion) -> None:
    """Replace each child of an untraceable module by its conversion. Children get fp32 in
    and give fp32 out, so the untraceable forward around them works unchanged."""
    for child_name, child in list(owner.named_children()):
        if not any(True for _ in child.parameters()):
            continue  # nothing to store in low precision
        path = _join(prefix, child_name)
        converted = _convert_tree(child, path, run.calls.get(path), run, keep_low_outputs=False)
        setattr(owner, child_name, converted)


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _with_plan(model_mp: torch.nn.Module, records: list[dict[str, Any]], low: LowDtype,
               promoted: Mapping[str, str | Decision], **fields: Any) -> torch.nn.Module:
    """Attach the plan and its summary (op counts, parameter bytes, promotions) - either backend."""
    calls = [r for r in records if r["op"].startswith("call_")]
    model_mp.plan = records
    model_mp.summary = ConversionSummary(
        dtype=low.name, ops_fp32=sum(r["compute"] == "float32" for r in calls),
        ops_low=sum(r["compute"] == low.name for r in calls), param_bytes=_param_bytes(model_mp),
        promoted=[{"node": k, "reason": getattr(v, "reason", v)} for k, v in promoted.items()], **fields)
    return model_mp


def _plain(value: Any) -> bool:
    """A value plan.json holds as it is (JSON's scalars)."""
    return value is None or isinstance(value, (bool, int, float, str))


def _param_bytes(module: torch.nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in module.parameters():
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out
