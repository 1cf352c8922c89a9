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

from ampaudit.core.catalog import Catalog, builtin_catalog
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.graph.tree import map_tensors

MEASURED = "ampaudit_measured"  # node.meta key: Measured
SHAPE = "ampaudit_shape"  # node.meta key: output shape (tuple of ints)
DTYPE = "ampaudit_dtype"  # node.meta key: output torch.dtype, where the output is a tensor

_SAMPLE_ROWS = 64  # rows of a linear layer's input re-run in low precision to estimate its error


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


def exponent_histogram(a: torch.Tensor) -> torch.Tensor:
    """Counts of |x| (fp32, non-negative) per fp32 biased exponent: 0 holds zeros, 255 inf/nan.

    One pass over the bits instead of a comparison pass per statistic.
    """
    return torch.bincount((a.reshape(-1).view(torch.int32) >> 23), minlength=256)


def _stats(x: torch.Tensor, limits: LowDtype) -> tuple[int, float, float | None, float, float, float]:
    a = x.detach().float().abs()
    numel = a.numel()
    if numel == 0:
        return 0, 0.0, None, 0.0, 0.0, 0.0
    hist = exponent_histogram(a).tolist()
    finite_count = numel - hist[255]
    nonzero = finite_count - hist[0]
    if hist[255]:  # inf or nan present: statistics over the finite values
        a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))
    absmax = float(a.max())
    lowest = next((e for e in range(1, 255) if hist[e]), None)
    bits = None
    min_nonzero = None
    if lowest is not None:
        bits = a.view(torch.int32) >> 23
        min_nonzero = float(torch.where(bits == lowest, a, math.inf).min())
    over = sum(hist[limits.overflow_exponent + 1:255])
    if hist[limits.overflow_exponent]:
        over += int((a >= limits.overflow_at).sum()) - sum(hist[limits.overflow_exponent + 1:255])
    flush = sum(hist[1:max(1, limits.flush_exponent)])
    sub = sum(hist[max(1, limits.flush_exponent):max(1, limits.normal_exponent)])
    return (numel, absmax, min_nonzero, over / numel, flush / nonzero if nonzero else 0.0,
            sub / nonzero if nonzero else 0.0)


def _error(low: torch.Tensor, ref: torch.Tensor, limits: LowDtype) -> tuple[float | None, int | None]:
    ref = ref.detach().float()
    low = low.detach().float()
    diff = torch.linalg.vector_norm(low - ref)
    scale = torch.linalg.vector_norm(ref)
    if not (math.isfinite(float(diff)) and math.isfinite(float(scale))):
        # inf or nan (an overflow the probe reports on its own): compare the finite part
        finite = torch.isfinite(ref) & torch.isfinite(low)
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
    return map_tensors(value, lambda t: t.to(dtype).to(t.dtype) if t.is_floating_point() else t)


_NOT_RUN = object()  # no low-precision run made ahead of the fp32 one


def writes_in_place(node: fx.Node, root: torch.nn.Module) -> bool:
    """Whether the op overwrites its first input: an ``inplace=True`` module or argument, a
    trailing-underscore method or function (``relu_``, ``add_``), an in-place operator (``__iadd__``)."""
    if node.op == "call_module":
        return getattr(root.get_submodule(node.target), "inplace", False) is True
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("inplace") is True:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if not isinstance(name, str):
        return False
    if name.startswith("__i") and name.endswith("__"):
        return True
    return name.endswith("_") and not name.startswith("_")


def _input_versions(node: fx.Node, env: dict[fx.Node, Any]) -> list[tuple[torch.Tensor, int]]:
    """The input tensors and their version counters (bumped by every in-place write)."""
    out: list[tuple[torch.Tensor, int]] = []
    for arg in node.all_input_nodes:
        map_tensors(env.get(arg), lambda t: out.append((t, t._version)))
    return out


def untrained_batch_norm(module: torch.nn.Module) -> bool:
    """A BatchNorm whose running statistics were never updated (a model built, not trained):
    in eval mode it would normalise with mean 0 and variance 1, that is not at all."""
    if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm) or not module.track_running_stats:
        return False
    mean, var, count = module.running_mean, module.running_var, module.num_batches_tracked
    return (mean is not None and var is not None and (count is None or int(count) == 0)
            and not bool(mean.any()) and bool((var == 1).all()))


def _batch_statistics(module: torch.nn.Module, x: Any, state: dict[str, torch.Tensor] | None = None) -> Any:
    """An untrained BatchNorm normalising with the batch's own statistics, as training does
    (the running statistics are left alone); None when the batch has one value per channel."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() <= x.shape[1]:
        return None
    state = state if state is not None else dict(module.named_parameters())
    return torch.nn.functional.batch_norm(x, None, None, state.get("weight"), state.get("bias"), True, 0.0,
                                          module.eps)


class RangeProbe(fx.Interpreter):
    """Runs the graph in fp32, recording per node its range and its low-precision error.

    ``catalog`` (default: the builtin one) gives the op traits it reads: ``same_values`` ops
    inherit their input's measurements, ``random`` ones are not compared across runs."""

    def __init__(self, gm: fx.GraphModule, dtype: LowDtype | torch.dtype, kinds: dict[fx.Node, str],
                 catalog: Catalog | None = None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.limits = LowDtype.parse(dtype)
        self.kinds = kinds
        catalog = builtin_catalog() if catalog is None else catalog
        self._same_values = catalog.trait("same_values")
        self._random = catalog.trait("random")
        self._rounded_state: dict[str, dict[str, torch.Tensor]] = {}
        self._rounded: dict[fx.Node, Any] = {}  # node -> its output rounded to the low dtype
        self._untrained: dict[str, bool] = {}  # module target -> an untrained BatchNorm

    def run_node(self, n: fx.Node) -> Any:
        # An in-place op (nn.SiLU(inplace=True), F.relu(x, inplace=True), x.add_(y)) overwrites
        # its input: its low-precision twin runs first, on the values it really receives.
        early = self._run_low(n, copy=True) if self._writes_float_in_place(n) else _NOT_RUN
        inputs = _input_versions(n, self.env)
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise ProbeError(n, exc) from exc
        mutated = any(t._version != version for t, version in inputs)
        if mutated or early is not _NOT_RUN:
            # Rounded copies made before the write are stale (for the input and its views).
            self._rounded.clear()
        if isinstance(result, torch.Tensor):
            n.meta[SHAPE] = tuple(result.shape)
            n.meta[DTYPE] = result.dtype
            if result.is_floating_point():
                # A write the op's name did not announce: its input is gone, nothing to compare.
                n.meta[MEASURED] = self._measure(n, result, early, comparable=early is not _NOT_RUN or not mutated)
        for done in self.user_to_last_uses.get(n, ()):  # mirror the interpreter's freeing
            self._rounded.pop(done, None)
        return result

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        module = self.fetch_attr(target)
        if self._untrained_norm(target, module) and not kwargs:
            out = _batch_statistics(module, args[0] if args else None)
            if out is not None:
                return out
        return super().call_module(target, args, kwargs)

    def _untrained_norm(self, target: str, module: torch.nn.Module) -> bool:
        if target not in self._untrained:
            self._untrained[target] = untrained_batch_norm(module)
        return self._untrained[target]

    def _measure(self, n: fx.Node, result: torch.Tensor, early: Any = None, *, comparable: bool = True) -> Measured:
        source = n.args[0] if n.args else None
        if self.kinds.get(n) in self._same_values and isinstance(source, fx.Node) and MEASURED in source.meta:
            m = source.meta[MEASURED]
            return Measured(result.numel(), m.absmax, m.min_nonzero, m.overflow, m.flush, m.subnormal, 0.0, 0)
        numel, absmax, min_nz, overflow, flush, sub = _stats(result, self.limits)
        rel, lost = None, None
        if not comparable or not n.op.startswith("call_") or self.kinds.get(n) in self._random:
            pass
        elif early is not _NOT_RUN:
            if isinstance(early, torch.Tensor) and early.shape == result.shape:
                rel, lost = _error(early, result, self.limits)
        elif self.kinds.get(n) == "linear":
            rel, lost = self._linear_error(n, result)
        else:
            rel, lost = self._generic_error(n, result)
        return Measured(numel, absmax, min_nz, overflow, flush, sub, rel, lost)

    def _linear_error(self, n: fx.Node, result: torch.Tensor) -> tuple[float | None, int | None]:
        """A linear layer's rows are independent: estimate its error on a sample of rows.

        Linear layers carry most of a model's compute; re-running every row would double
        the audit's cost for no better estimate of a relative error.
        """
        if n.op == "call_module":
            module = self.module.get_submodule(n.target)
            state = self._state(n.target, module) if isinstance(module, torch.nn.Linear) else {}
            if "weight" not in state:  # weight_norm's weight is an attribute its hook computes: run the module
                return self._generic_error(n, result)
            weight, bias = state["weight"], state.get("bias")
            x = self.env[n.args[0]] if isinstance(n.args[0], fx.Node) else n.args[0]
        else:
            # F.linear(x, weight=w, bias=b): BEiT's and EVA's qkv pass their tensors by keyword
            x, weight, bias = (self._argument(n, i, name) for i, name in enumerate(("input", "weight", "bias")))
            weight, bias = _round(weight, self.limits.torch), _round(bias, self.limits.torch)
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return self._generic_error(n, result)
        rows = x.reshape(-1, x.shape[-1])[:_SAMPLE_ROWS]
        low = _round(torch.nn.functional.linear(_round(rows, self.limits.torch), weight, bias), self.limits.torch)
        return _error(low, result.reshape(-1, result.shape[-1])[: rows.shape[0]], self.limits)

    def _argument(self, n: fx.Node, index: int, name: str) -> Any:
        """The value of ``n``'s argument at ``index``, or passed as ``name``."""
        a = n.args[index] if len(n.args) > index else n.kwargs.get(name)
        return self.env[a] if isinstance(a, fx.Node) else a

    def _generic_error(self, n: fx.Node, result: torch.Tensor) -> tuple[float | None, int | None]:
        low = self._run_low(n)
        if isinstance(low, torch.Tensor) and low.shape == result.shape:
            return _error(low, result, self.limits)
        return None, None

    def _rounded_value(self, node: fx.Node) -> Any:
        if node not in self._rounded:
            self._rounded[node] = _round(self.env[node], self.limits.torch)
        return self._rounded[node]

    def _writes_float_in_place(self, n: fx.Node) -> bool:
        first = n.args[0] if n.args else None
        value = self.env.get(first) if isinstance(first, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.is_floating_point() and writes_in_place(n, self.module)

    def _run_low(self, n: fx.Node, *, copy: bool = False) -> Any:
        """The op on its inputs rounded to the low dtype. ``copy``: an in-place op, run on
        copies so that it writes into none of the probe's values (integer tensors are not rounded)."""
        dtype = self.limits.torch
        value = self._rounded_value
        if copy:
            def value(node: fx.Node) -> Any:
                return map_tensors(self._rounded_value(node), lambda t: t.clone())
        args = fx.node.map_arg(n.args, value)  # node values, each rounded once
        kwargs = fx.node.map_arg(n.kwargs, value)
        try:
            with torch.no_grad():
                if n.op == "call_module":
                    module = self.module.get_submodule(n.target)
                    state = self._state(n.target, module)
                    out = None
                    if self._untrained_norm(n.target, module) and not kwargs:
                        out = _batch_statistics(module, args[0] if args else None, state)
                    if out is None:
                        out = functional_call(module, state, tuple(args), kwargs)
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
            self._rounded_state[target] = {k: _round(v.detach(), self.limits.torch) for k, v in state.items()}
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


def probe(gm: fx.GraphModule, dtype: LowDtype | torch.dtype, kinds: dict[fx.Node, str], args: tuple,
          kwargs: dict, catalog: Catalog | None = None) -> Any:
    """Run ``gm`` on the inputs, leaving a :class:`Measured` in each float node's meta."""
    values = placeholder_values(gm, args, kwargs)
    with torch.no_grad(), attributes_kept(gm):
        return RangeProbe(gm, dtype, kinds, catalog).run(*values)
