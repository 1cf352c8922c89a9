"""What fp8 training would do to each ``nn.Linear`` of a model, measured on its example inputs.

One fp32 forward and backward records every Linear's input, weight and output gradient
(hooks; the loss is the model's own, or the mean square of its output). Each operand is then
cast as every recipe casts it (``graph/fp8_casts.py``) - statistics per recipe: SQNR against
fp32 over the whole tensor and over the ordinary elements only (outside outlier tokens and
channels: a few huge tokens hold nearly all the energy and hide what the others lost), the
shares flushed to zero and saturated. The chosen recipe's GEMMs are also run: SQNR of the
output, grad-input and grad-weight products. Last, two forwards without grad say whether one
layer's fp8 error dominates the model output: every candidate layer in fp8, then all but the
worst one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ampaudit.core.errors import USER_CODE_ERRORS, LoadError
from ampaudit.core.tensors import iter_tensors
from ampaudit.graph.forward import ExampleInputs, describe_exception
from ampaudit.graph.fp8_casts import RECIPES, CastResult, Recipe, cast, linear_gemms, output_gemm
from ampaudit.graph.kept_attributes import attributes_kept

OUTLIER_RATIO = 20.0  # a token (row) or channel (column) whose amax exceeds this x the median one's
OPERANDS = ("input", "weight", "grad_output")
DIVISOR = 16  # torch._scaled_mm takes dims divisible by 16


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x)) ** 2


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """10 log10(signal / noise) of ``value`` against ``reference``: inf when exact."""
    return _db(_norm(reference), _norm(reference - value))


@dataclass
class OperandStats:
    sqnr_db: float
    sqnr_rest_db: float  # outside outlier tokens and channels
    flushed: float  # share of the nonzero elements cast to 0
    saturated: float  # share clamped at the format's max

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in asdict(self).items()}


@dataclass
class Fp8Layer:
    """One Linear: where it is, its shape and what each recipe does to it."""

    name: str  # fully qualified module name
    in_features: int
    out_features: int
    rows: int  # M: tokens in the example batch
    file: str | None
    line: int
    outlier_ratio: dict[str, float]  # operand -> amax / 99.9th percentile of |x|
    outlier_tokens: int  # rows of the input whose amax is OUTLIER_RATIO x the median row's
    outlier_channels: int  # input columns likewise
    token_ratio: float = 1.0  # the input's largest row amax over the median row's
    channel_ratio: float = 1.0  # and its columns'
    operands: dict[str, dict[str, OperandStats]] = field(default_factory=dict)  # recipe -> operand -> stats
    gemms: dict[str, float] = field(default_factory=dict)  # the chosen recipe: output/grad_input/grad_weight SQNR
    has_grad: bool = True

    @property
    def divisible(self) -> bool:
        return self.in_features % DIVISOR == 0 and self.out_features % DIVISOR == 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "in_features": self.in_features, "out_features": self.out_features,
                "rows": self.rows, "divisible_by_16": self.divisible, "line": self.line,
                "outlier_ratio": {k: _num(v) for k, v in self.outlier_ratio.items()},
                "outlier_tokens": self.outlier_tokens, "outlier_channels": self.outlier_channels,
                "token_ratio": _num(self.token_ratio), "channel_ratio": _num(self.channel_ratio),
                "operands": {r: {o: s.to_dict() for o, s in ops.items()} for r, ops in self.operands.items()},
                "gemms": {k: _num(v) for k, v in self.gemms.items()}}


@dataclass
class Fp8Measurement:
    recipe: str
    layers: list[Fp8Layer]
    output_sqnr_db: float | None = None  # model output with every candidate layer in fp8
    dominant: str | None = None  # the layer whose fp8 error dominates it
    output_sqnr_without_db: float | None = None  # the same without the dominant layer in fp8
    seconds: dict[str, float] = field(default_factory=dict)
    reference: torch.Tensor | None = None  # the fp32 model output (flat), for ``dominance``


def _num(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def outlier_masks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns of ``x`` (M,K) whose amax exceeds OUTLIER_RATIO x the median one's."""
    a = x.abs()
    rows, cols = a.amax(dim=1), a.amax(dim=0)
    return rows > OUTLIER_RATIO * rows.median(), cols > OUTLIER_RATIO * cols.median()


def _spread(x: torch.Tensor) -> tuple[float, float]:
    a = x.abs()
    out = []
    for amax in (a.amax(dim=1), a.amax(dim=0)):
        median = float(amax.median())
        out.append(float(amax.max()) / median if median > 0 else math.inf)
    return out[0], out[1]


def outlier_ratio(x: torch.Tensor) -> float:
    a = x.detach().abs().flatten().float()
    k = max(1, math.ceil(0.999 * a.numel()))
    p = float(a.kthvalue(k).values)
    amax = float(a.max())
    return amax / p if p > 0 else (math.inf if amax > 0 else 1.0)


def operand_stats(x: torch.Tensor, q: CastResult, rest: torch.Tensor | None, energy: float) -> OperandStats:
    """``energy``: ``x``'s sum of squares; ``rest``: the mask of its ordinary elements, None
    where it has no outlier tokens or channels (then the rest is the whole)."""
    error = x - q.value
    whole = _db(energy, _norm(error))
    rest_db = whole if rest is None else _db(_norm(x * rest), _norm(error.mul_(rest)))
    total = max(q.nonzero, 1)
    return OperandStats(whole, rest_db, q.flushed / total, q.saturated / max(x.numel(), 1))


@dataclass
class _Record:
    module: nn.Linear
    x: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    out: torch.Tensor | None = None  # x @ W.T as fp32 computed it (the output less the bias)
    grad_weight: torch.Tensor | None = None  # the weight's gradient from this run, when no other module shares it
    calls: int = 0
    file: str | None = None
    line: int = 0


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` (subclasses too) by fully qualified name, once each."""
    seen, found = set(), []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in seen:
            seen.add(id(module))
            found.append((name, module))
    return found


def model_loss(output: Any) -> torch.Tensor:
    """The model's own loss (a scalar, or ``.loss``), else the mean square of its outputs."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.float()
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.requires_grad:
        return output.float()
    parts = [t.float().square().mean() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise LoadError("the model's output has no tensor that depends on its weights: nothing to train in fp8")
    return torch.stack(parts).sum()


def _outputs(output: Any) -> torch.Tensor:
    parts = [t.detach().float().flatten() for t in iter_tensors(output) if t.is_floating_point()]
    return torch.cat(parts) if parts else torch.empty(0)


def record(model: nn.Module, inputs: ExampleInputs) -> tuple[dict[str, _Record], torch.Tensor]:
    """One fp32 forward and backward: each Linear's input and output gradient (first call)."""
    import sys

    from ampaudit.core.userframe import user_location

    records = {name: _Record(module) for name, module in linears(model)}
    by_id = {id(r.module): r for r in records.values()}
    handles = []

    def pre(module: nn.Module, args: tuple) -> None:
        rec = by_id[id(module)]
        rec.calls += 1
        if rec.x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            rec.x = x.detach().float().reshape(-1, x.shape[-1])
            loc = user_location(sys._getframe(1))
            if loc is not None:
                rec.file, rec.line = loc.file, loc.line

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        rec = by_id[id(module)]
        if rec.calls != 1 or not isinstance(output, torch.Tensor):
            return
        out = output.detach().float().reshape(-1, output.shape[-1])
        rec.out = out - module.bias.detach().float() if module.bias is not None else out
        if output.requires_grad:
            def keep(g: torch.Tensor, rec: _Record = rec) -> None:
                if rec.grad is None:
                    rec.grad = g.detach().float().reshape(-1, g.shape[-1])
            output.register_hook(keep)

    for rec in records.values():
        handles.append(rec.module.register_forward_pre_hook(pre))
        handles.append(rec.module.register_forward_hook(post))
    params = list(model.parameters())
    saved = [p.grad for p in params]  # the user's gradients stay as they were
    for p in params:
        p.grad = None
    try:
        with attributes_kept(model), torch.enable_grad():
            try:
                output = model(*inputs.args, **inputs.kwargs)
                loss = model_loss(output)
                loss.backward()
            except LoadError:
                raise
            except USER_CODE_ERRORS as exc:
                raise LoadError(f"the fp8 audit's forward and backward on the example inputs ({inputs.origin}) "
                                f"failed: {describe_exception(exc)}") from exc
        owners: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
        for rec in records.values():
            g = rec.module.weight.grad
            if g is not None and owners.get(id(rec.module.weight)) == 1:  # a tied weight's gradient is a sum
                rec.grad_weight = g.detach().float()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return records, _outputs(output)


def measure_fp8(model: nn.Module, inputs: ExampleInputs, recipe: str) -> Fp8Measurement:
    """Every Linear of ``model`` under every recipe; the GEMMs under ``recipe``."""
    import time

    start = time.perf_counter()
    records, reference = record(model, inputs)
    recorded = time.perf_counter()
    empty = next((name for name, rec in records.items() if rec.x is not None and rec.x.numel() == 0), None)
    if empty is not None:  # amax over no elements: torch raises IndexError
        raise LoadError(f"the example inputs give nn.Linear {empty or '(model)'!r} no rows (a batch of 0?): "
                        "nothing to measure in fp8")
    # a Linear never called on the example inputs has nothing to measure
    layers = [_measure_layer(name, rec, RECIPES[recipe]) for name, rec in records.items() if rec.x is not None]
    done = time.perf_counter()
    return Fp8Measurement(recipe, layers, seconds={"forward_backward": recorded - start, "casts": done - recorded},
                          reference=reference)


class _Casts:
    """One layer's operands, each cast at most once per way of casting it: rowwise and
    rowwise_with_gw_hp share casts, and the chosen recipe's GEMMs reuse the statistics' ones."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.nonzero = {op: int(torch.count_nonzero(t)) for op, t in tensors.items()}
        self.by_storage = {t.data_ptr(): op for op, t in tensors.items()}  # the GEMMs pass w.t(): a fresh view
        self.memo: dict[tuple, CastResult] = {}

    def get(self, op: str, how: Any, dim: int, pow2: bool) -> CastResult:
        key = (op, how, dim, pow2 and how.granularity != "block")
        if key not in self.memo:
            self.memo[key] = cast(self.tensors[op], how, dim, pow2=pow2, nonzero=self.nonzero[op])
        return self.memo[key]

    def for_recipe(self, recipe: Recipe) -> Callable[[torch.Tensor, Any, int], CastResult]:
        return lambda t, how, dim: self.get(self.by_storage[t.data_ptr()], how, dim, recipe.pow2_scales)


def _measure_layer(name: str, rec: _Record, chosen: Recipe) -> Fp8Layer:
    w = rec.module.weight.detach().float()
    layer = Fp8Layer(name, rec.module.in_features, rec.module.out_features, rec.x.shape[0], rec.file,
                     rec.line, {}, 0, 0, has_grad=rec.grad is not None)
    tokens, channels = outlier_masks(rec.x)
    layer.outlier_tokens, layer.outlier_channels = int(tokens.sum()), int(channels.sum())
    tensors = {"input": rec.x, "weight": w.t()}
    if rec.grad is not None:
        tensors["grad_output"] = rec.grad
    layer.outlier_ratio = {op: outlier_ratio(t) for op, t in tensors.items()}
    layer.token_ratio, layer.channel_ratio = _spread(rec.x)
    energy = {op: _norm(t) for op, t in tensors.items()}
    casts = _Casts(tensors)
    rest = (~(tokens[:, None] | channels[None, :])).float() if tokens.any() or channels.any() else None
    for rname, r in RECIPES.items():
        hows = {"input": (r.input, -1), "weight": (r.weight, 0), "grad_output": (r.grad_output, -1)}
        layer.operands[rname] = {
            op: operand_stats(t, casts.get(op, *hows[op], r.pow2_scales), rest if op == "input" else None,
                              energy[op])
            for op, t in tensors.items()}
    gemms = linear_gemms(rec.x, w, rec.grad, chosen, casts.for_recipe(chosen))
    once = rec.calls == 1  # called more than once: the recorded products are the first call's, recomputed
    reference = rec.out if once and rec.out is not None else rec.x @ w.t()
    layer.gemms["output"] = sqnr_db(reference, gemms.output)
    if tokens.any():  # the ordinary tokens' output rows: what their lost input bits cost
        ordinary = ~tokens
        layer.gemms["output_ordinary_tokens"] = sqnr_db(reference[ordinary], gemms.output[ordinary])
    if rec.grad is not None:
        # not the gradient autograd gave x: x may feed other layers too (q, k and v share theirs)
        layer.gemms["grad_input"] = sqnr_db(rec.grad @ w, gemms.grad_input)
        grad_weight = rec.grad_weight if once and rec.grad_weight is not None else rec.grad.t() @ rec.x
        layer.gemms["grad_weight"] = sqnr_db(grad_weight, gemms.grad_weight)
    return layer


def fp8_forward(model: nn.Module, inputs: ExampleInputs, names: set[str], recipe: Recipe) -> torch.Tensor:
    """The model's output (no grad) with the Linears named in ``names`` computing in fp8."""
    modules = {id(m): n for n, m in linears(model) if n in names}

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if id(module) not in modules or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        out, _ = output_gemm(x.detach().float().reshape(-1, x.shape[-1]), module.weight.detach().float(), recipe)
        if module.bias is not None:
            out = out + module.bias.detach().float()
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(output.dtype)

    handles = [m.register_forward_hook(hook) for _, m in linears(model) if id(m) in modules]
    try:
        with attributes_kept(model), torch.no_grad():
            return _outputs(model(*inputs.args, **inputs.kwargs))
    finally:
        for h in handles:
            h.remove()


def dominance(model: nn.Module, inputs: ExampleInputs, measurement: Fp8Measurement, candidates: list[str],
              min_layers: int = 2) -> None:
    """Whether one of ``candidates``' fp8 error dominates the model output: the output SQNR
    with every candidate in fp8, and without the one whose own GEMM output is the worst."""
    import time

    reference = measurement.reference
    if not candidates or reference is None or reference.numel() == 0:
        return
    start = time.perf_counter()
    recipe = RECIPES[measurement.recipe]
    measurement.output_sqnr_db = sqnr_db(reference, fp8_forward(model, inputs, set(candidates), recipe))
    by_name = {layer.name: layer for layer in measurement.layers}
    if len(candidates) >= max(2, min_layers):  # with fewer, no one layer is said to dominate: no second run
        worst = min(candidates, key=lambda n: by_name[n].gemms.get("output", math.inf))
        measurement.dominant = worst
        rest = set(candidates) - {worst}
        measurement.output_sqnr_without_db = sqnr_db(reference, fp8_forward(model, inputs, rest, recipe))
    measurement.seconds["dominance"] = time.perf_counter() - start
