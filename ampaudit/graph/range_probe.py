"""Measure real value ranges: run a traced graph once in fp32 and, node by node, again in
the low-precision dtype on the fp32 inputs cast down.

The low-precision run is emulated: inputs and weights are rounded to fp16/bf16, the op
computes with fp32 accumulation (what tensor cores and PyTorch's reductions do on GPUs),
and the output is rounded to fp16/bf16. That measures what a GPU would lose - rounding,
overflow, underflow - at fp32 speed on any device, and never mutates the reference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx
from torch.func import functional_call

MEASURED = "ampaudit_measured"  # node.meta key: Measured
SHAPE = "ampaudit_shape"  # node.meta key: output shape (tuple of ints)

# Ops whose output is random by design: comparing two runs of them measures nothing.
_RANDOM = frozenset({"rand", "randn", "rand_like", "randn_like", "randint", "bernoulli", "multinomial",
                     "normal", "dropout", "uniform"})


@dataclass(frozen=True)
class Measured:
    numel: int
    absmax: float
    min_nonzero: float | None  # smallest nonzero |x|
    overflow: float  # fraction of elements beyond the low dtype's max
    flush: float  # fraction of nonzero elements that round to 0 in the low dtype
    subnormal: float  # fraction of nonzero elements in the low dtype's subnormal range
    rel_error: float | None  # ||y_low - y_fp32|| / ||y_fp32|| with inputs cast down; None if not comparable
    bits_lost: int | None  # mantissa bits lost to that error (0 = as good as rounding the output)

    @property
    def sqnr_db(self) -> float | None:
        if self.rel_error is None:
            return None
        return math.inf if self.rel_error == 0 else -20.0 * math.log10(self.rel_error)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        sqnr = self.sqnr_db
        data["sqnr_db"] = None if sqnr is None or math.isinf(sqnr) else round(sqnr, 2)
        return data


class _Limits:
    def __init__(self, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.max = info.max
        self.normal = info.smallest_normal
        self.tiniest = info.smallest_normal * info.eps
        self.mantissa = -int(math.log2(info.eps))


def _stats(x: torch.Tensor, limits: _Limits) -> tuple[int, float, float | None, float, float, float]:
    a = x.detach().abs().float()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
    numel = a.numel()
    if numel == 0:
        return 0, 0.0, None, 0.0, 0.0, 0.0
    nonzero = a > 0
    count = int(nonzero.sum())
    absmax = float(a.max())
    min_nonzero = float(torch.where(nonzero, a, torch.full((), math.inf)).min()) if count else None
    overflow = float((a > limits.max).sum()) / numel
    flush = float((nonzero & (a < limits.tiniest / 2)).sum()) / count if count else 0.0
    sub = float(((a >= limits.tiniest / 2) & (a < limits.normal)).sum()) / count if count else 0.0
    return numel, absmax, min_nonzero, overflow, flush, sub


def _error(low: torch.Tensor, ref: torch.Tensor, limits: _Limits) -> tuple[float | None, int | None]:
    ref = ref.detach().float()
    low = low.detach().float()
    finite = torch.isfinite(ref) & torch.isfinite(low)
    if not bool(finite.any()):
        return None, None
    diff = torch.linalg.vector_norm(torch.where(finite, low - ref, 0.0))
    scale = torch.linalg.vector_norm(torch.where(finite, ref, 0.0))
    if float(scale) == 0.0:
        return None, None
    rel = float(diff / scale)
    if rel == 0.0:
        return 0.0, 0
    # Rounding the output alone leaves about mantissa + 1 good bits; count what is lost beyond that.
    lost = round(limits.mantissa + 1 + math.log2(rel))
    return rel, max(0, min(limits.mantissa, lost))


def _round(value: Any, dtype: torch.dtype) -> Any:
    """Float tensors (anywhere in args) rounded through the low dtype, back in fp32."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).to(value.dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_round(v, dtype) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {k: _round(v, dtype) for k, v in value.items()}
    return value


class RangeProbe(fx.Interpreter):
    """Runs the graph in fp32, recording per node its range and its low-precision error."""

    def __init__(self, gm: fx.GraphModule, dtype: torch.dtype, kinds: dict[fx.Node, str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.limits = _Limits(dtype)
        self.kinds = kinds
        self._rounded_state: dict[str, dict[str, torch.Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise ProbeError(n, exc) from exc
        if isinstance(result, torch.Tensor):
            n.meta[SHAPE] = tuple(result.shape)
            if result.is_floating_point():
                n.meta[MEASURED] = self._measure(n, result)
        return result

    def _measure(self, n: fx.Node, result: torch.Tensor) -> Measured:
        numel, absmax, min_nz, overflow, flush, sub = _stats(result, self.limits)
        rel, lost = None, None
        if n.op.startswith("call_") and self.kinds.get(n) not in _RANDOM:
            low = self._run_low(n)
            if isinstance(low, torch.Tensor) and low.shape == result.shape:
                rel, lost = _error(low, result, self.limits)
        return Measured(numel, absmax, min_nz, overflow, flush, sub, rel, lost)

    def _run_low(self, n: fx.Node) -> Any:
        dtype = self.limits.dtype
        args = _round(self.map_nodes_to_values(n.args, n), dtype)
        kwargs = _round(self.map_nodes_to_values(n.kwargs, n), dtype)
        try:
            with torch.no_grad():
                if n.op == "call_module":
                    module = self.module.get_submodule(n.target)
                    out = functional_call(module, self._state(n.target, module), tuple(args), kwargs)
                elif n.op == "call_method":
                    out = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    out = n.target(*args, **kwargs)
        except Exception:  # an op with no fp32 path for these inputs: nothing to compare
            return None
        return _round(out, dtype)

    def _state(self, target: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        if target not in self._rounded_state:
            state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            self._rounded_state[target] = {k: _round(v.detach(), self.limits.dtype) for k, v in state.items()}
        return self._rounded_state[target]


def placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """Positional values for the graph's placeholders from a call's args and kwargs
    (placeholders the call leaves out take their default, as in the model's signature)."""
    values = []
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        name = str(node.target).lstrip("*")
        if index < len(args):
            values.append(args[index])
        elif name in kwargs:
            values.append(kwargs[name])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"forward() missing a value for its argument {name!r}")
    return values


class ProbeError(Exception):
    """A node raised while the probe ran the graph: carries the node for its user line."""

    def __init__(self, node: fx.Node, error: Exception) -> None:
        super().__init__(str(error))
        self.node = node
        self.error = error


def probe(gm: fx.GraphModule, dtype: torch.dtype, kinds: dict[fx.Node, str], args: tuple, kwargs: dict) -> Any:
    """Run ``gm`` on the inputs, leaving a :class:`Measured` in each float node's meta."""
    values = placeholder_values(gm, args, kwargs)
    with torch.no_grad():
        return RangeProbe(gm, dtype, kinds).run(*values)
