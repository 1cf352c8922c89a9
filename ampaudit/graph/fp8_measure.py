"""What fp8 training would do to each ``nn.Linear`` of a model, measured on its example inputs.

One fp32 forward and backward records every Linear's input, weight and output gradient
(hooks; the loss is the model's own, or the mean square of its output; the Linears' weight
gradients are not computed). Each operand is then
cast as every recipe casts it (``graph/fp8_casts.py``) - statistics per recipe: SQNR against
fp32 over the whole tensor and over the ordinary elements only (outside outlier tokens and
channels: a few huge tokens hold nearly all the energy and hide what the others lost), the
shares flushed to zero and saturated; where the input has outlier tokens, the SQNR of the
ordinary tokens' part of the weight gradient with the input cast as each recipe's grad-weight
GEMM casts it (along the tokens, where the outlier tokens set the scales again, whatever the
forward's per-row scales did). The chosen recipe's GEMMs are also run: SQNR of the
output, grad-input and grad-weight products. Last, two forwards without grad say whether one
layer's fp8 error dominates the model output: every candidate layer in fp8, then all but the
worst one (which takes the first forward's Linear outputs up to the worst layer's call).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.utils import parametrize

from ampaudit.core.errors import USER_CODE_ERRORS, LoadError
from ampaudit.core.kept_attributes import attributes_kept
from ampaudit.core.tensors import dense_numel, given_labels, iter_tensors, linear_input, own_loss
from ampaudit.core.userframe import user_location
from ampaudit.graph import fp8_native
from ampaudit.graph.forward import ExampleInputs, describe_exception
from ampaudit.graph.fp8_casts import BLOCK, EPS, RECIPES, ROW, CastResult, Recipe, amax_of, cast, output_gemm

OUTLIER_RATIO = 20.0  # a token (row) or channel (column) whose amax exceeds this x the median one's
OPERANDS = ("input", "weight", "grad_output")
DIVISOR = 16  # torch._scaled_mm takes dims divisible by 16
# A layer whose input, weight and output gradient hold more than LARGE elements is measured on
# at most SAMPLE tokens, output and input features each (outliers always kept): casting every
# operand four ways costs as much as the GEMMs on a CPU. Rowwise and MX casts are row and block
# local, the per-tensor amax comes from the whole: each sampled element is cast exactly.
LARGE = 1 << 18
SAMPLE = 64
PERCENTILE_SAMPLE = 1 << 14  # elements for a large operand's 99.9th percentile of |x|
STARVED = 0.5  # an output feature is starved when flushing takes this share of its gradient's energy


def _db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _norm(x: torch.Tensor) -> float:
    """The sum of squares; in float64 where float32's overflows or underflows (elements past
    about 1e19 or all below about 1e-23): the SQNR read -inf for a finite input of 1e30."""
    n = float(torch.linalg.vector_norm(x))
    if (n == 0 or n == math.inf) and x.numel() and bool(x.any()):
        n = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    return n ** 2


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """10 log10(signal / noise) of ``value`` against ``reference``: inf when exact."""
    return _db(_norm(reference), _norm(reference - value))


@dataclass
class OperandStats:
    sqnr_db: float
    sqnr_rest_db: float  # outside outlier tokens and channels
    flushed: float  # share of the nonzero elements cast to 0
    saturated: float  # share clamped at the format's max
    # grad_output only: the share of output features (columns of the gradient, rows of the weight's
    # gradient dW = G^T X) with a nonzero gradient that lose at least STARVED of its energy to
    # flushing in the recipe's grad-weight cast: their weight rows get no other update
    starved_features: float | None = None
    # input only, where it has outlier tokens and an output gradient: SQNR of the ordinary tokens'
    # contribution to the weight gradient (G_o^T X_o) with X cast as the recipe's grad-weight GEMM
    # casts it - scaled along the tokens, so the outlier tokens set the scales again (inf: that
    # GEMM runs in high precision)
    sqnr_grad_weight_rest_db: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in asdict(self).items() if v is not None}


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
    zero_grad: bool = False  # its output's gradient was all zeros: the backward not measured (has_grad False)
    sampled: dict[str, int] = field(default_factory=dict)  # dim -> how many measured, where sampled
    # a subclass's own forward (or one wrapped on the instance): what it is, and how far its output
    # is from F.linear of its input (relative to its norm); None for nn.Linear's own forward
    own_forward: dict[str, Any] | None = None
    tied_to: list[str] = field(default_factory=list)  # other modules' parameters that are this weight
    # what computes the weight where it is no Parameter of its own (weight_norm, a parametrization)
    computed_weight: str | None = None
    permuted_input: str | None = None  # its input's shape and strides where it is a permuted view

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
                "gemms": {k: _num(v) for k, v in self.gemms.items()},
                "own_forward": None if self.own_forward is None else
                {**self.own_forward, "difference": _num(self.own_forward["difference"])},
                "tied_to": list(self.tied_to), "computed_weight": self.computed_weight,
                "permuted_input": self.permuted_input,
                **({"sampled": dict(self.sampled)} if self.sampled else {}),
                **({"grad_all_zero": True} if self.zero_grad else {})}


@dataclass
class Fp8Measurement:
    recipe: str
    layers: list[Fp8Layer]
    output_sqnr_db: float | None = None  # model output with every candidate layer in fp8
    dominant: str | None = None  # the layer whose fp8 error dominates it
    output_sqnr_without_db: float | None = None  # the same without the dominant layer in fp8
    seconds: dict[str, float] = field(default_factory=dict)
    reference: torch.Tensor | None = None  # the fp32 model output (flat), for ``dominance``
    # which of the output's float tensors the reference holds: those that depend on the weights
    outputs_kept: tuple[bool, ...] | None = None
    weight_amax: dict[int, torch.Tensor] = field(default_factory=dict)  # by module id, for ``dominance``
    # the chosen recipe's cast of each weight measured whole, by module id: the dominance forwards'
    # cast of it (the same cast of the same tensor; the forwards cast only the others)
    weight_cast: dict[int, CastResult] = field(default_factory=dict)


def _num(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _p999(a: torch.Tensor) -> float:
    """The 99.9th percentile of ``a`` (1-D): its k-th smallest element, k = ceil(0.999 n), found
    as the (n - k + 1)-th largest (topk of a 0.1% is 2-3x faster than kthvalue's selection)."""
    k = max(1, math.ceil(0.999 * a.numel()))
    return float(a.topk(a.numel() - k + 1).values[-1])


def _p999_index(n: int) -> int:
    """Where the 99.9th percentile of n elements sits among them sorted (0-based): ``_p999``'s."""
    return max(1, math.ceil(0.999 * n)) - 1


def outlier_ratio(x: torch.Tensor) -> float:
    a = x.detach().abs().flatten().float()
    return _ratio(float(a.max()), _p999(a))


def _ratio(amax: float, p: float) -> float:
    """amax over the 99.9th percentile of |x|."""
    return amax / p if p > 0 else (math.inf if amax > 0 else 1.0)


def _summaries(operands: dict[str, torch.Tensor | None]) -> dict[str, fp8_native.Summary] | None:
    """Each operand's ``fp8_native.summary`` (its 99.9th percentile of |x| the k-th); None where
    the kernel takes one of them not (the torch ops measure them all)."""
    found = {}
    for op, t in operands.items():
        if t is not None:
            found[op] = fp8_native.summary(t, _p999_index(t.numel())) if t.numel() else None
            if found[op] is None:
                return None
    return found


def _over_median(amax: torch.Tensor, largest: float) -> tuple[float, torch.Tensor | None, int]:
    """The largest of ``amax`` (``largest``) over their median, which are outliers (over
    OUTLIER_RATIO x the median: None where none is) and how many."""
    found = fp8_native.spread(amax, OUTLIER_RATIO)
    if found is not None:  # one C call where the torch ops are five
        m, count, _ = found
        # the threshold as torch computes it: the float32 product (m is a float32's value)
        over = amax > fp8_native.float32(OUTLIER_RATIO * m) if count else None
    else:
        median = amax.median()
        m, over = float(median), amax > OUTLIER_RATIO * median
        count = int(over.sum())
        over = over if count else None
    return (largest / m if m > 0 else math.inf), over, count


def _mask(over: torch.Tensor | None, n: int) -> torch.Tensor:
    """``_over_median``'s outliers as a mask of ``n``, all False where it found none."""
    return over if over is not None else torch.zeros(n, dtype=torch.bool)


def operand_stats(x: torch.Tensor, q: CastResult, rest: torch.Tensor | None, energy: float,
                  scratch: _Scratch | None = None) -> OperandStats:
    """``energy``: ``x``'s sum of squares; ``rest``: the mask of its ordinary elements, None
    where it has no outlier tokens or channels (then the rest is the whole); ``scratch``: where
    the error's buffer comes from and goes back to."""
    scratch = scratch or _Scratch()
    if rest is None:
        whole = rest_db = _db(energy, _cast_error_norm(x, q, scratch))
    else:
        error = scratch.sub(x, q.value)
        whole = _db(energy, _norm(error))
        rest_db = _db(_norm(x * rest), _norm(error.mul_(rest)))
        scratch.give(error)
    total = max(q.nonzero, 1)
    return OperandStats(whole, rest_db, q.flushed / total, q.saturated / max(x.numel(), 1))


class _Scratch:
    """Tensors a small layer's measurement gives back for the next one's temporaries: its cost is
    fixed costs, and a fresh tensor's page faults are one (on the 2-vCPU VM a 256 KB tensor's 64
    faults cost about as much as a pass over it). Lent again by shape and layout; where none of
    those is free, the smallest free one whose storage holds the layout is viewed as it, from its
    start (the alignment a fresh tensor has): a buffer serves later layers of other shapes."""

    SHARED = 1 << 14  # elements from which a miss looks for a larger buffer (smaller ones: the heap's, no page faults)

    def __init__(self) -> None:
        # by shape and strides: float32 tensors at their storage's start, and each storage's elements
        self.free: dict[tuple, list[tuple[torch.Tensor, int]]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor of ``like``'s shape, dtype and strides, given back before; None where none is."""
        return self._take(like.shape, like.stride()) if like.dtype == torch.float32 else None

    def take_contiguous(self, shape: torch.Size) -> torch.Tensor | None:
        """A contiguous 2-D float32 tensor of ``shape``, given back before; None where none is."""
        return self._take(shape, (shape[1], 1))

    def _take(self, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor | None:
        found = self.free.get((shape, stride))
        if found:
            return found.pop()[0]
        if shape.numel() < self.SHARED:
            return None
        n = _dense_size(shape, stride)
        if n is None:
            return None
        best = None  # (elements, key, index)
        for key, ts in self.free.items():
            for i, (_, size) in enumerate(ts):
                if size >= n and (best is None or size < best[0]):
                    best = size, key, i
        if best is None:
            return None
        return self.free[best[1]].pop(best[2])[0].as_strided(shape, stride, 0)

    def give(self, t: torch.Tensor) -> None:
        """``t``, no longer read nor written by anyone (its storage neither)."""
        if t.dtype == torch.float32 and t.storage_offset() == 0:
            n = t.numel()  # what a small one holds is never lent as another shape: no need to ask its storage
            size = t.untyped_storage().nbytes() // 4 if n >= self.SHARED else n
            self.free.setdefault((t.shape, t.stride()), []).append((t, size))

    def sub(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a - b`` (float32; ``b`` broadcast to ``a``'s shape), into a tensor given back, in the
        layout torch gives ``a - b`` - ``a``'s dims' order, dense (TensorIterator orders the dims
        by the first input whose strides differ) - so the values, their layout and the norms
        after are the same."""
        if a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype == torch.float32:
            buf = self._take(a.shape, a.stride())  # a's layout, dense or not, as torch keeps it
        else:  # a small one is the heap's (no page faults): not worth finding its layout
            layout = _difference_layout(a, b) if a.numel() >= self.SHARED else None
            buf = self._take(*layout) if layout is not None else None
        return a - b if buf is None else torch.sub(a, b, out=buf)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` (2-D float32), into a contiguous tensor given back, as mm's own result is."""
        shape = torch.Size((a.shape[0], b.shape[1]))
        buf = self._take(shape, (b.shape[1], 1)) if a.dtype == b.dtype == torch.float32 and b.shape[1] > 1 else None
        return torch.mm(a, b) if buf is None else torch.mm(a, b, out=buf)


def _difference_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Size, tuple[int, ...]] | None:
    """The shape and strides of ``a - b`` where ``a`` is a dense 2-D float32 tensor of two dims
    over 1 (its strides differ: they order the output's dims) and ``b`` a float32 tensor that
    broadcasts to it; None for any other."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.dim() != 2 or min(a.shape) < 2:
        return None
    # broadcast by hand: torch.broadcast_shapes's first call imports torch's refs (8,600 page faults)
    if (_dense_size(a.shape, a.stride()) is None or b.dim() > 2
            or any(m not in (1, n) for m, n in zip(reversed(b.shape), reversed(a.shape), strict=False))):
        return None
    rows, cols = a.shape
    return a.shape, ((cols, 1) if a.stride(0) > a.stride(1) else (1, rows))


def _dense_size(shape: torch.Size, stride: tuple[int, ...]) -> int | None:
    """The elements of a dense layout (``dense_numel``) of no empty dim; None for any other."""
    n = dense_numel(shape, stride)
    return n if n is not None and all(shape) else None


def _sqnr(reference: torch.Tensor, value: torch.Tensor, scratch: _Scratch | None) -> float:
    """``sqnr_db``, its difference in a scratch tensor (where there is a scratch)."""
    if scratch is None:
        return sqnr_db(reference, value)
    return _db(_norm(reference), _error_norm(reference, value, scratch))


def _error_norm(a: torch.Tensor, b: torch.Tensor, scratch: _Scratch) -> float:
    """``_norm(a - b)``: in one C pass where the kernel takes the two (one dense layout; the same
    float as torch's norm of torch's difference), else by torch ops into a scratch tensor (and
    where the kernel's sum is 0 or inf: ``_norm``'s float64 retry)."""
    n = fp8_native.error_norm(a, b)
    if n is not None and 0 < n < math.inf:
        return n ** 2
    error = scratch.sub(a, b)
    found = _norm(error)
    scratch.give(error)
    return found


def _cast_error_norm(x: torch.Tensor, q: CastResult, scratch: _Scratch) -> float:
    """``_error_norm(x, q.value)``: the one the cast's C pass measured where it cast ``x`` into
    this value's layout (the same kernel on the same elements: the same float), else anew."""
    kept = q.error_norm
    if kept is not None and kept[0] is x and q.value.stride() == x.stride() and 0 < kept[1] < math.inf:
        return kept[1] ** 2
    return _error_norm(x, q.value, scratch)


@dataclass
class _Record:
    module: nn.Linear
    x: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    out: torch.Tensor | None = None  # the output as fp32 computed it (the bias still in: taken off the sample)
    out_version: int | None = None  # its in-place version then: changed since, it is no longer the output
    grad_weight: torch.Tensor | None = None  # the weight's gradient from this run, when no other module shares it
    # not nn.Linear's forward: |output - F.linear(input)| / |output| on the first call (inf: not even its shape)
    own_difference: float | None = None
    calls: int = 0
    file: str | None = None
    line: int = 0
    pending: tuple[torch.Tensor, Any] | None = None  # this call's input and line, until its output is seen
    with_grad: bool = False  # the call measured computes a gradient: later calls are not measured
    grad_seen: torch.Tensor | None = None  # the output gradient recorded, as autograd gave it
    # grad @ W as the recording's backward computed it (_InputGradLinear), for the gradient recorded
    grad_input: torch.Tensor | None = None
    permuted: str | None = None  # the input's shape and strides, where it is a permuted view (``permuted_rows``)


def permuted_rows(x: torch.Tensor) -> str | None:
    """``x``'s shape and strides where its rows cannot be viewed as one matrix without a copy:
    an input of 3 or more dims that is a permuted view (``x.transpose(1, 2)`` into a Linear, as
    MLP-Mixer's token MLP and LeViT do). torchao's rowwise casts keep the input's layout (an
    elementwise op's output follows its strides) and then reshape it to (-1, in_features): on a
    permuted layout that reshape is a copy, which its Float8TrainingTensor refuses with axiswise
    scales ("aten.clone.default with axiswise scaling is not supported yet"). None: it can."""
    if x.dim() <= 2 or x.is_contiguous():  # a contiguous tensor views as any shape of its size
        return None
    try:  # empty_like keeps a dense layout's strides, as the cast's output does; no data is touched
        torch.empty_like(x, device="meta").view(-1, x.shape[-1])
    except RuntimeError:
        return f"shape {tuple(x.shape)}, strides {x.stride()}"
    return None


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` (subclasses too) by fully qualified name, once each."""
    seen, found = set(), []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in seen:
            seen.add(id(module))
            found.append((name, module))
    return found


def model_loss(output: Any, labelled: bool = False) -> torch.Tensor:
    """The model's own loss (``core.tensors.own_loss``; ``labelled``: the call passed targets),
    else the mean square of its outputs - or, where they are all exactly zero (a last layer
    initialised to zero: DiT's adaLN-Zero), whose mean square has no gradient at all, their
    mean squared error to fixed unit noise (a noise prediction's target)."""
    loss = own_loss(output, labelled)
    if loss is not None and loss.requires_grad:
        return loss.float()
    outputs = [t.float() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not outputs:
        raise LoadError("the model's output has no tensor that depends on its weights: nothing to train in fp8")
    if not any(bool(t.detach().any()) for t in outputs):
        generator = torch.Generator(device=outputs[0].device).manual_seed(0)
        return torch.stack([(t - torch.randn(t.shape, generator=generator, device=t.device)).square().mean()
                            for t in outputs]).sum()
    return torch.stack([t.square().mean() for t in outputs]).sum()


def _outputs(output: Any, kept: tuple[bool, ...] | None = None) -> torch.Tensor:
    """The output's float tensors, flat, one after the other; ``kept``: only those marked True
    (by position), as ``_weight_dependent`` marked them in the recording forward."""
    parts = [t for t in iter_tensors(output) if t.is_floating_point()]
    if kept is not None and len(kept) == len(parts):
        parts = [t for t, k in zip(parts, kept, strict=True) if k]
    parts = [t.detach().float().flatten() for t in parts]
    return torch.cat(parts) if parts else torch.empty(0)


def _weight_dependent(output: Any) -> tuple[bool, ...]:
    """Which of the output's float tensors depend on the weights (an input passed through, a
    count or a constant does not: its fp8 error is nil and would dilute the model output's)."""
    return tuple(t.requires_grad for t in iter_tensors(output) if t.is_floating_point())


class _InputGradLinear(torch.autograd.Function):
    """``F.linear`` whose backward gives only its input's gradient. The audit needs every
    Linear's output gradient, which flows through the inputs' gradients, not the weights' (a
    third of a Linear's GEMMs, forward and backward); each sampled grad-weight reference is
    recomputed from the recorded input and output gradient. The input's gradient is computed
    as autograd computes it for ``linear`` (``mm_mat1_backward``: ``grad @ W``, or its transpose
    for a column-major input), bit for bit, so every gradient upstream is unchanged. ``rec``:
    where ``grad @ W`` is kept when ``grad`` is the output gradient it recorded (the same tensor):
    the measurement's grad-input reference of a layer measured whole (the same product).
    ``call``: the call a hook-free recording forward measures (``_recording_forward``): its
    backward records the output gradient itself - the one a tensor hook on the output would see."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rec: _Record | None = None, call: _Call | None = None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.rec, ctx.call = rec, call
        ctx.column_major = x.dim() == 2 and x.shape[1] > 1 and x.stride(0) == 1 and x.stride(1) == x.shape[0]
        out = nn.functional.linear(x, weight, bias)
        if out._is_view():  # a flattened input's 2-D product viewed back: autograd would forbid an
            # in-place op on a custom Function's view (timm's LayerScale `x.mul_(gamma)`), so the
            # same storage is handed out as a tensor of its own, as linear's own _unsafe_view does
            out = torch.ops.aten._unsafe_view(out._base, out.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (weight,) = ctx.saved_tensors
        rec, ctx.rec = ctx.rec, None
        if rec is not None and ctx.call is not None and ctx.call.measured and rec.grad is None:
            # the measured call's output gradient, as the tensor hook of the hooked path keeps it
            rec.grad = grad.detach().float().reshape(-1, grad.shape[-1])
            rec.grad_seen = grad
        g = grad.reshape(-1, grad.shape[-1])
        gi = weight.t().mm(g.t()).t() if ctx.column_major else g.mm(weight)
        if rec is not None and not ctx.column_major and _same_tensor(grad, rec.grad_seen) and \
                weight.dtype == gi.dtype == torch.float32 and g.numel() + weight.numel() + gi.numel() <= LARGE:
            rec.grad_input = gi
        return gi.reshape(*grad.shape[:-1], weight.shape[1]), None, None, None, None


@dataclass
class _Call:
    """One call of a hook-free recording forward: whether it is the call measured (its output
    needs a gradient), which its backward then records."""

    measured: bool = False


def _same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``a`` is ``b`` or views the same elements of it the same way."""
    return b is not None and (a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
                                         and a.shape == b.shape and a.stride() == b.stride()))


def _is_float8_linear(module: nn.Module) -> bool:
    """torchao's Float8Linear (a model converted already): F.linear with its operands cast to fp8."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.split(".")[0] == "torchao"


def float8_linears(model: nn.Module) -> list[str]:
    """The Linears of ``model`` that torchao's convert_to_float8_training converted already."""
    return [name for name, module in linears(model) if _is_float8_linear(module)]


def _own_difference(module: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> float:
    """How far a Linear's output is from F.linear of its input, relative to the output's norm:
    torchao's Float8Linear computes F.linear and nothing else (inf: not even the same shape)."""
    if out.shape != (x.shape[0], module.out_features):
        return math.inf
    with torch.no_grad():
        bias = None if module.bias is None else module.bias.detach().float()
        lin = nn.functional.linear(x, module.weight.detach().float(), bias)
        norm = float(torch.linalg.vector_norm(out))
        diff = float(torch.linalg.vector_norm(out - lin))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def _input_grad_only(module: nn.Linear, rec: _Record | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature: fc(input=x) too
        return _InputGradLinear.apply(input, module.weight, module.bias, rec)

    return forward


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks (its own or every module's): they may replace its
    input or output, or wrap them for a backward hook - then what the recording keeps is what the
    hooks saw, and only hooks of its own see it."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks
                or any(getattr(torch_module, name, None) for name in (
                    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                    "_global_backward_pre_hooks")))


def _recording_forward(module: nn.Linear, rec: _Record) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plain Linear's forward in the recording, where no hook runs around it: it records what
    ``record``'s pre- and post-hooks and its output's tensor hook would (the same tensors, the
    same calls: its output is the module's), without them - hooks put every call of the module
    on nn.Module's slow path (with the tensor hook, about 0.1 ms a Linear here)."""
    def forward(input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature: fc(input=x) too
        rec.calls += 1
        measure = not rec.with_grad and isinstance(input, torch.Tensor)
        loc = user_location(sys._getframe(1)) if measure else None
        call = _Call() if measure else None
        output = _InputGradLinear.apply(input, module.weight, module.bias, rec, call)
        if measure and (rec.x is None or output.requires_grad):  # else: measured without a gradient already
            _keep_call(rec, input, output, loc)
            call.measured = output.requires_grad
        return output

    return forward


def _keep_call(rec: _Record, x: torch.Tensor, output: torch.Tensor, loc: Any) -> None:
    """A measured call's input, output and line, kept in ``rec`` (its gradient comes later)."""
    rec.permuted = permuted_rows(x)
    rec.x = x.detach().float().reshape(-1, x.shape[-1])
    rec.file, rec.line = (loc.file, loc.line) if loc is not None else (None, 0)
    # not copied (a pass over every output): kept with its version, it is known unchanged or not
    rec.out = output.detach().float().reshape(-1, output.shape[-1])
    rec.out_version = _version(rec.out)
    if output.requires_grad:
        rec.with_grad = True


def record(model: nn.Module, inputs: ExampleInputs) -> tuple[dict[str, _Record], torch.Tensor, tuple[bool, ...]]:
    """One fp32 forward and backward: each Linear's input and output gradient, on its first call
    that computes a gradient (its first call, where none does): under reentrant activation
    checkpointing a Linear's first call runs without grad and its recomputation in the backward
    with it."""
    records = {name: _Record(module) for name, module in linears(model)}
    by_id = {id(r.module): r for r in records.values()}
    handles = []

    def pre(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        rec = by_id[id(module)]
        rec.calls += 1
        if not rec.with_grad and (x := linear_input(args, kwargs)) is not None:
            rec.pending = (x, user_location(sys._getframe(1)))

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        rec = by_id[id(module)]
        pending, rec.pending = rec.pending, None
        if pending is None or not isinstance(output, torch.Tensor):
            return
        if rec.x is not None and not output.requires_grad:  # measured without a gradient already
            return
        x, loc = pending
        _keep_call(rec, x, output, loc)
        if id(module) not in plain and rec.x is not None:
            rec.own_difference = _own_difference(module, rec.x, rec.out)
        if output.requires_grad:

            def keep(g: torch.Tensor, rec: _Record = rec) -> None:
                if rec.grad is None:
                    rec.grad = g.detach().float().reshape(-1, g.shape[-1])
                    rec.grad_seen = g
            output.register_hook(keep)

    params = list(model.parameters())
    saved = [p.grad for p in params]  # the user's gradients stay as they were
    for p in params:
        p.grad = None
    # Linears whose forward is nn.Linear's (not a subclass's own, not wrapped on the instance as
    # accelerate's hooks do) compute no weight gradient; attributes_kept takes the instance
    # attributes ``forward`` away again. A model converted already (torchao's Float8Linear) is
    # recorded as the fp32 model it was: its forward is F.linear in fp8, the reference is fp32's
    plain = {id(rec.module) for rec in records.values()
             if (type(rec.module).forward is nn.Linear.forward or _is_float8_linear(rec.module))
             and "forward" not in vars(rec.module)}
    # of those, the ones no hook runs around record themselves, in their forward and backward
    direct = {i for i in plain if not _hooked(by_id[i].module)}
    for rec in records.values():
        if id(rec.module) not in direct:
            handles.append(rec.module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(rec.module.register_forward_hook(post))
    try:
        with attributes_kept(model), torch.enable_grad(), _modules_called():
            for rec in records.values():
                if id(rec.module) in direct:
                    rec.module.forward = _recording_forward(rec.module, rec)
                elif id(rec.module) in plain:
                    rec.module.forward = _input_grad_only(rec.module, rec)
            try:
                output = model(*inputs.args, **inputs.kwargs)
                loss = model_loss(output, given_labels(model.forward, inputs.args, inputs.kwargs))
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
            weight = rec.module.weight
            g = weight.grad if weight.is_leaf else None  # weight_norm's: computed, its grad is g's and v's
            # a tied weight's gradient is a sum; a plain Linear's weight got none from its own GEMM
            if g is not None and owners.get(id(rec.module.weight)) == 1 and id(rec.module) not in plain:
                rec.grad_weight = g.detach().float()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    kept = _weight_dependent(output)  # the reference: the outputs that depend on the weights
    return records, _outputs(output, kept), kept


def _tied(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Each parameter (by id) held by several modules: the modules and their names for it."""
    held: dict[int, list[tuple[nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            entry = (module, f"{prefix}.{name}" if prefix else name)
            if all(m is not module for m, _ in held.get(id(p), [])):
                held.setdefault(id(p), []).append(entry)
    return {k: v for k, v in held.items() if len(v) > 1}


def measure_fp8(model: nn.Module, inputs: ExampleInputs, recipe: str) -> Fp8Measurement:
    """Every Linear of ``model`` under every recipe; the GEMMs under ``recipe``."""

    start = time.perf_counter()
    records, reference, kept = record(model, inputs)
    recorded = time.perf_counter()
    empty = next((name for name, rec in records.items() if rec.x is not None and rec.x.numel() == 0), None)
    if empty is not None:  # amax over no elements: torch raises IndexError
        raise LoadError(f"the example inputs give nn.Linear {empty or '(model)'!r} no rows (a batch of 0?): "
                        "nothing to measure in fp8")
    # a Linear never called on the example inputs has nothing to measure
    weight_amax: dict[int, torch.Tensor] = {}
    # inference mode: a few hundred small ops a layer, on tensors no gradient will ever flow
    # through, each spared autograd's dispatch (~10% of this part's time; the same numbers)
    weight_cast: dict[int, CastResult] = {}
    scratch = _Scratch()  # the layers' temporaries, from one layer to the next
    with torch.inference_mode():
        layers = [_measure_layer(name, rec, RECIPES[recipe], weight_amax, scratch, weight_cast)
                  for name, rec in records.items() if rec.x is not None]
    tied = _tied(model)
    for layer in layers:
        layer.tied_to = [n for module, n in tied.get(id(records[layer.name].module.weight), [])
                         if module is not records[layer.name].module]
    done = time.perf_counter()
    return Fp8Measurement(recipe, layers, seconds={"forward_backward": recorded - start, "casts": done - recorded},
                          reference=reference, outputs_kept=kept, weight_amax=weight_amax, weight_cast=weight_cast)


class _Casts:
    """One layer's operands (or the sampled rows and columns of each, by view name), each cast
    at most once per way of casting it: rowwise and rowwise_with_gw_hp share casts, a per-tensor
    cast is the same along either dim, and the chosen recipe's GEMMs reuse the statistics' ones."""

    def __init__(self, tensors: dict[str, torch.Tensor], amax: dict[str, torch.Tensor] | None = None,
                 nonzero: dict[str, int] | None = None, scratch: _Scratch | None = None) -> None:
        self.tensors = tensors
        self.scratch = scratch  # where the casts' values come from and go back to (``release``)
        self.lent: list[torch.Tensor] = []
        self.amax = amax or {}  # view -> the whole operand's amax (a sampled view's per-tensor scale)
        # a sample's statistics count flushes per row (_sampled_stats): its casts count only MX saturation
        self.count = amax is None
        # nonzero: each operand's, where the caller counted them
        self.nonzero = nonzero or {op: int(torch.count_nonzero(t)) if self.count else 0 for op, t in tensors.items()}
        self.memo: dict[tuple, CastResult] = {}
        self.raw: dict[tuple, CastResult] = {}  # MX casts of a transposed operand, in its layout (``get``)

    def get(self, op: str, how: Any, dim: int, pow2: bool, any_layout: bool = False) -> CastResult:
        """``any_layout``: the caller reads the value in any layout (a statistic of its elements
        against the operand's, in the operand's layout): MX's value of a transposed operand is left
        in that layout where the kernel writes it - the same values, without the contiguous copy a
        GEMM reads (made where a later caller asks for it)."""
        key = (op, how, None if how.granularity == "tensor" else dim, pow2 and how.granularity != "block")
        found = self.memo.get(key)
        if found is not None:
            return found
        raw = self.raw.get(key)
        if raw is not None:
            if any_layout:
                return raw
            # the value as the cast gives it otherwise: contiguous (the same copy _cast_from_amax makes)
            dense = self.scratch.take_contiguous(raw.value.shape)
            value = raw.value.contiguous() if dense is None else dense.copy_(raw.value)
            if value is dense:
                self.lent.append(dense)
            self.memo[key] = replace(raw, value=value)
            return self.memo[key]
        x = self.tensors[op]
        # the kernel writes into x's layout; MX's value of a transposed x is a contiguous copy
        lend = self.scratch is not None and how.fmt is not None
        keep = lend and any_layout and how.granularity == "block" and not x.is_contiguous()
        out = self.scratch.take(x) if lend else None
        dense = None
        if out is not None and how.granularity == "block" and not x.is_contiguous() and not keep:
            dense = self.scratch.take_contiguous(x.shape)
        # a statistic's cast (any_layout) measures its error in the same C call
        found = cast(x, how, dim, pow2=pow2, nonzero=self.nonzero[op], amax=self.amax.get(op),
                     count=self.count or how.granularity == "block", out=out, dense=dense, keep_layout=keep,
                     norm=any_layout)
        for t in (out, dense):  # the one holding the value is lent; the other is free again
            if t is not None:
                if found.value is t:
                    self.lent.append(t)
                else:
                    self.scratch.give(t)
        # kept in x's layout (where the torch ops cast, it is contiguous already: as any caller takes it)
        (self.raw if keep and not found.value.is_contiguous() else self.memo)[key] = found
        return found

    def release(self, kept: CastResult | None = None) -> None:
        """The casts' values back to the scratch: nothing reads them any more (but ``kept``'s)."""
        for t in self.lent:
            if kept is None or t is not kept.value:
                self.scratch.give(t)
        self.lent, self.memo, self.raw = [], {}, {}


def sample_index(amax: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most ``limit`` of ``amax``'s indices, deterministic: its outliers (amax over
    OUTLIER_RATIO x the median) and its largest always (up to half the sample, more where the
    others are fewer), evenly spaced among the others; sorted, with how many indices each
    stands for (its stratum's size over its sample's)."""
    outliers = amax > OUTLIER_RATIO * amax.median()
    outliers[int(amax.argmax())] = True
    strata = (outliers.nonzero().flatten(), (~outliers).nonzero().flatten())
    take_out = min(len(strata[0]), max(limit // 2, limit - len(strata[1])))
    picked, weights = [], []
    for idx, take in zip(strata, (take_out, min(len(strata[1]), limit - take_out)), strict=True):
        if take == 0:
            continue
        weights.append(torch.full((take,), len(idx) / take))
        if take < len(idx):  # linspace's steps are >= 1 apart: distinct after rounding
            idx = idx[torch.linspace(0, len(idx) - 1, take).round().long()]
        picked.append(idx)
    index = torch.cat(picked)
    order = index.argsort()
    return index[order], torch.cat(weights)[order]


@dataclass
class _Axis:
    """One dim of a Linear (tokens, out_features, in_features): the indices measured (None:
    all) and how many each stands for."""

    index: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    @classmethod
    def of(cls, amax: torch.Tensor, sampled: bool) -> _Axis:
        if not sampled or amax.numel() <= SAMPLE:
            return cls()
        return cls(*sample_index(amax, SAMPLE))

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t if self.index is None else t.index_select(dim, self.index)


def _squares(sq: torch.Tensor, rows: _Axis, cols: _Axis) -> float:
    """The sum of ``sq`` (squares) over the whole it samples: each row and column counted as
    many times as it stands for (one of them weighted at least)."""
    if rows.weight is not None:
        sq = sq.sum(dim=1) if cols.weight is None else (sq * cols.weight).sum(dim=1)
        return float((sq * rows.weight).sum())
    return float((sq.sum(dim=0) * cols.weight).sum())


def _weighted(x: torch.Tensor, rows: _Axis, cols: _Axis) -> float:
    """``x``'s sum of squares over the whole it samples."""
    if rows.weight is None and cols.weight is None:
        return _norm(x)
    found = _squares(x.square(), rows, cols)
    if found == 0 or found == math.inf:  # past float32's range (as _norm)
        found = _squares(x.double().square(), rows, cols)
    return found


def _sampled_sqnr(reference: torch.Tensor, value: torch.Tensor, rows: _Axis, cols: _Axis) -> float:
    return _db(_weighted(reference, rows, cols), _weighted(reference - value, rows, cols))


@dataclass
class _Signal:
    """What every cast of one (sampled) operand is measured against, computed once for all
    of them: its energy, its ordinary elements' energy, its nonzero elements."""

    energy: float
    rest_energy: float
    nonzero: torch.Tensor
    total: float  # nonzero elements, in the whole the sample stands for


def _signal(x: torch.Tensor, rest: torch.Tensor | None, rows: _Axis, cols: _Axis) -> _Signal:
    energy = _weighted(x, rows, cols)
    rest_energy = energy if rest is None else _weighted(x * rest, rows, cols)
    nonzero = x.bool()  # x != 0 (NaN counts), in a sixth of the comparison's time on a CPU
    if rows.weight is None and cols.weight is None:  # this operand was not sampled
        total = float(torch.count_nonzero(nonzero))
    else:
        dim, axis = (1, rows) if rows.weight is not None else (0, cols)
        total = float((nonzero.sum(dim=dim, dtype=torch.int32) * axis.weight).sum())
    return _Signal(energy, rest_energy, nonzero, total)


def _sampled_stats(x: torch.Tensor, q: CastResult, signal: _Signal, rest: torch.Tensor | None, rows: _Axis,
                   cols: _Axis) -> OperandStats:
    """operand_stats on a sample of rows or columns, each weighted by what it stands for."""
    error = x - q.value
    if rows.weight is None and cols.weight is None:
        whole = _db(signal.energy, _norm(error))
        rest_db = whole if rest is None else _db(signal.rest_energy, _norm(error.mul_(rest)))
    else:  # squared in place once; rest is 0 or 1, so (error rest)^2 = error^2 rest exactly
        sq = error.square_()
        whole = _db(signal.energy, _squares(sq, rows, cols))
        rest_db = whole if rest is None else _db(signal.rest_energy, _squares(sq.mul_(rest), rows, cols))
    flushed = torch.gt(signal.nonzero, q.value.bool())  # nonzero, cast to 0: (q == 0) & nonzero, 4x faster
    if rows.weight is None and cols.weight is None:
        lost = float(torch.count_nonzero(flushed))
    else:
        # counted in int32 (a third faster than int64 here; exact, as the float32 product after)
        dim, axis = (1, rows) if rows.weight is not None else (0, cols)
        lost = float((flushed.sum(dim=dim, dtype=torch.int32) * axis.weight).sum())
    return OperandStats(whole, rest_db, lost / max(signal.total, 1.0), q.saturated / max(x.numel(), 1))


def starved_features(x: torch.Tensor, q: CastResult, col_energy: torch.Tensor, sq: torch.Tensor,
                     cols: _Axis) -> float:
    """The share of ``x``'s columns (all rows present; each standing for ``cols.weight`` where
    sampled) with a nonzero energy ``col_energy`` of which flushing to zero in ``q`` took at
    least STARVED. ``sq``: ``x`` squared."""
    live = col_energy > 0
    if q.value is x or not bool(live.any()):  # high precision: nothing flushed
        return 0.0
    lost = torch.where(q.value.bool(), 0.0, sq).sum(dim=0)
    starved = live & (lost >= STARVED * col_energy)
    if cols.weight is None:
        return int(starved.sum()) / int(live.sum())
    return float((starved * cols.weight).sum() / (live * cols.weight).sum())


def grad_weight_rest_db(g_ordinary: torch.Tensor, x_ordinary: torch.Tensor, q: CastResult, ordinary: torch.Tensor,
                        signal: float, rows: _Axis, cols: _Axis) -> float:
    """SQNR of the ordinary tokens' contribution to the weight gradient, ``G_o^T X_o``, with
    ``X`` cast as ``q`` (the recipe's grad-weight cast, scaled along the tokens, every token -
    the outlier ones too - counted in each scale) against fp32. The gradient stays exact: what
    is measured is what the outlier tokens' scales cost the others. ``g_ordinary``,
    ``x_ordinary``: the ordinary tokens' rows of G (every token's rows in ``ordinary``) and X;
    ``signal``: the sum of squares of ``G_o^T X_o`` over the whole it samples (``rows``: the
    output features, ``cols``: the input features)."""
    error = x_ordinary - q.value[ordinary]
    return _db(signal, _weighted(g_ordinary.t() @ error, rows, cols))


class _StarvedFeatures:
    """AMP704's measure of one layer, by its recipe's grad-weight cast of the output gradient
    (``g_cols``: every token, the sampled features): the share of output features starved
    (``starved_features``). Each cast is measured once; the squares, once for all of them."""

    def __init__(self, casts: _Casts, g_cols: str, cols: _Axis, col_amax: torch.Tensor | None = None) -> None:
        self.casts, self.g_cols, self.cols = casts, g_cols, cols
        self._by_cast: dict[int, float] = {}
        self._col_sq: tuple[torch.Tensor, torch.Tensor] | None = None  # its squares, their sum per column
        self._col_amax: float | None = None  # its smallest nonzero column amax
        self._col_amaxes = col_amax  # each column's amax, where the caller has them
        if col_amax is not None and (found := fp8_native.spread(col_amax, OUTLIER_RATIO)) is not None:
            self._col_amax = found[2]  # the least positive (inf: none is)

    def __call__(self, r: Recipe) -> float:
        g = self.casts.tensors[self.g_cols]
        # scaled per column (or 32-token block of one) by its own amax, a column keeps its largest
        # element, and the ones that flush are 2^-17 of it: under 2^-34 of its energy each, never
        # half of it with fewer than 2^33 tokens - unless its amax is below the scale's floor
        # (EPS), where the cast decides
        if r.grad_output_for_grad_weight.granularity in (ROW, BLOCK) and self._smallest_column_amax(g) >= EPS:
            return 0.0
        q = self.casts.get(self.g_cols, r.grad_output_for_grad_weight, 0, r.pow2_scales)
        if id(q) not in self._by_cast:
            if q.value is g or (self.casts.count and q.flushed == 0):
                self._by_cast[id(q)] = 0.0
            else:
                if self._col_sq is None:
                    sq = g.square()
                    self._col_sq = sq, sq.sum(dim=0)
                self._by_cast[id(q)] = starved_features(g, q, self._col_sq[1], self._col_sq[0], self.cols)
        return self._by_cast[id(q)]

    def _smallest_column_amax(self, g: torch.Tensor) -> float:
        if self._col_amax is None:
            live = amax_of(g, 0) if self._col_amaxes is None else self._col_amaxes
            live = live[live > 0]  # a column without gradient is not starved
            self._col_amax = float(live.min()) if live.numel() else math.inf
        return self._col_amax


class _OrdinaryGradWeight:
    """AMP702's grad-weight measure of one layer with outlier tokens, by its recipe's grad-weight
    cast of the input (``x_cols``; ``g_cols`` the output gradient, both every token and the
    sampled features): the SQNR of the ordinary tokens' part of the weight gradient
    (``grad_weight_rest_db``) - the GEMM's input is scaled along the tokens, where the outlier
    tokens set the scales again. Each cast is measured once; the ordinary rows, once for all."""

    def __init__(self, casts: _Casts, x_cols: str, g_cols: str, tokens: torch.Tensor, rows: _Axis,
                 cols: _Axis) -> None:
        self.casts, self.x_cols, self.g_cols, self.rows, self.cols = casts, x_cols, g_cols, rows, cols
        self.ordinary = ~tokens
        self._by_cast: dict[int, float] = {}
        self._parts: tuple[torch.Tensor, torch.Tensor, float] | None = None  # G_o, X_o, the signal

    def __call__(self, r: Recipe) -> float:
        if r.input_for_grad_weight.fmt is None:  # high precision: exact
            return math.inf
        q = self.casts.get(self.x_cols, r.input_for_grad_weight, 0, r.pow2_scales)
        if id(q) not in self._by_cast:
            if self._parts is None:
                tensors = self.casts.tensors
                g_o, x_o = tensors[self.g_cols][self.ordinary], tensors[self.x_cols][self.ordinary]
                self._parts = g_o, x_o, _weighted(g_o.t() @ x_o, self.rows, self.cols)
            g_o, x_o, signal = self._parts
            self._by_cast[id(q)] = grad_weight_rest_db(g_o, x_o, q, self.ordinary, signal, self.rows, self.cols)
        return self._by_cast[id(q)]


def _sampled_outlier_ratio(x: torch.Tensor, amax: float) -> float:
    """outlier_ratio from an even sample of elements (a stride coprime with the row length:
    every column is visited) against the whole tensor's amax."""
    step = max(1, x.numel() // PERCENTILE_SAMPLE)
    while math.gcd(step, x.shape[-1]) != 1:
        step += 1
    p = _p999(x.reshape(-1)[::step].abs())
    return amax / p if p > 0 else (math.inf if amax > 0 else 1.0)


def computed_weight(linear: nn.Module) -> str | None:
    """What computes a Linear's weight where it is no Parameter of its own - the old
    ``torch.nn.utils.weight_norm`` or ``spectral_norm`` (a forward pre-hook), a parametrization
    (``torch.nn.utils.parametrizations.weight_norm``, ``orthogonal``) - or None."""
    if isinstance(linear._parameters.get("weight"), nn.Parameter):
        return None

    if parametrize.is_parametrized(linear, "weight"):
        names = [type(p).__name__.lstrip("_") for p in linear.parametrizations.weight]
        return f"a parametrization ({', '.join(names)})"
    hooks = [type(h).__name__ for h in linear._forward_pre_hooks.values()]
    for hook, what in (("WeightNorm", "torch.nn.utils.weight_norm"), ("SpectralNorm", "torch.nn.utils.spectral_norm")):
        if hook in hooks:
            return what
    return "its forward's own code"


def _require_finite(name: str, operand: str, amax: torch.Tensor) -> None:
    """An inf or NaN in fp32 already: no fp8 cast can be measured against it (its SQNR read -inf
    and the layer passed as fp8). One line, as bad example inputs are."""
    if not math.isfinite(float(amax)):
        raise LoadError(f"the fp32 forward and backward on the example inputs give nn.Linear {name or '(model)'!r} "
                        f"a non-finite {operand} (inf or NaN): fp8 cannot be measured against it")


def _measure_layer(name: str, rec: _Record, chosen: Recipe, weight_amax: dict[int, torch.Tensor],
                   scratch: _Scratch | None = None, weight_cast: dict[int, CastResult] | None = None) -> Fp8Layer:
    """``weight_amax``: gets the weight's amax, by module id (the dominance forwards' per-tensor scale);
    ``scratch``: the temporaries of a layer measured whole come from it and go back to it;
    ``weight_cast``: gets the chosen recipe's cast of a weight measured whole, by module id."""
    x, g = rec.x, rec.grad
    w = rec.module.weight.detach().float()
    # a small layer's operands summed up in one C pass each (its fixed cost is the small ops'); the
    # output gradient's nonzero count says whether it is all zeros (any() is a slower pass here)
    summaries = None
    if x.numel() + w.numel() + (g.numel() if g is not None else 0) <= LARGE:
        summaries = _summaries({"input": x, "weight": w, "grad_output": g})
    zero_grad = False  # a zero-initialised layer downstream: nothing to measure
    if g is not None:
        zero_grad = summaries["grad_output"].nonzero == 0 if summaries is not None else not bool(g.any())
    if zero_grad:
        g = None
        if summaries is not None:
            del summaries["grad_output"]
    layer = Fp8Layer(name, rec.module.in_features, rec.module.out_features, x.shape[0], rec.file,
                     rec.line, {}, 0, 0, has_grad=g is not None, zero_grad=zero_grad, permuted_input=rec.permuted)
    if rec.own_difference is not None:
        instance = "forward" in vars(rec.module)
        # what Float8Linear.from_float does not keep: parameters beside weight and bias, submodules
        extra = [n for n, _ in rec.module.named_parameters(recurse=False) if n not in ("weight", "bias")]
        extra += [n for n, _ in rec.module.named_children()]
        layer.own_forward = {"class": type(rec.module).__name__, "instance": instance,
                             "difference": rec.own_difference, "extra": extra}
    layer.computed_weight = computed_weight(rec.module)
    size = x.numel() + w.numel() + (g.numel() if g is not None else 0)
    sampled = size > LARGE
    if summaries is None and not sampled:  # all-zero gradient the torch ops found: the others' summaries
        summaries = _summaries({"input": x, "weight": w, "grad_output": g})
    if summaries is not None:
        row_amax, col_amax, x_amax = summaries["input"].row_amax, summaries["input"].col_amax, summaries["input"].amax
    else:
        row_amax, col_amax = amax_of(x, 1).flatten(), amax_of(x, 0).flatten()
        x_amax = float(row_amax.max())
    _require_finite(name, "input", x_amax)
    if g is not None:
        _require_finite(name, "output gradient", summaries["grad_output"].amax if summaries else amax_of(g))
    # the largest row amax is the largest column amax: the input's amax
    layer.token_ratio, tokens, layer.outlier_tokens = _over_median(row_amax, x_amax)
    layer.channel_ratio, channels, layer.outlier_channels = _over_median(col_amax, x_amax)
    # tokens sampled by the input's row amax (massive tokens always kept), the input's columns by
    # theirs (outlier channels kept), the weight's rows (out_features) by theirs
    tok, k_ax = _Axis.of(row_amax, sampled), _Axis.of(col_amax, sampled)
    n_amax = summaries["weight"].row_amax if summaries else amax_of(w, 1).flatten()
    _require_finite(name, "weight", summaries["weight"].amax if summaries else n_amax.max())
    n_ax = _Axis.of(n_amax, sampled)
    weight_amax[id(rec.module)] = n_amax.max()
    full = _Axis()
    if not sampled:
        tensors = {"input": x, "weight": w.t()}
        if g is not None:
            tensors["grad_output"] = g
        if summaries is not None:  # the weight's summary is w's: the same elements as w.t()
            layer.outlier_ratio = {op: _ratio(summaries[op].amax, summaries[op].kth) for op in tensors}
            casts = _Casts(tensors, nonzero={op: summaries[op].nonzero for op in tensors}, scratch=scratch)
        else:
            layer.outlier_ratio = {op: outlier_ratio(t) for op, t in tensors.items()}
            casts = _Casts(tensors)
        views = {"input_cols": "input", "weight_rows": "weight", "grad_output_cols": "grad_output"}
    else:
        amax = {"input": row_amax.max(), "weight": weight_amax[id(rec.module)]}
        if g is not None:
            amax["grad_output"] = amax_of(g)
        layer.outlier_ratio = {op: _sampled_outlier_ratio(t, float(amax[op]))
                               for op, t in (("input", x), ("weight", w), ("grad_output", g)) if op in amax}
        tensors = {"input": tok.take(x, 0), "weight": n_ax.take(w, 0).t(), "input_cols": k_ax.take(x, 1),
                   "weight_rows": k_ax.take(w, 1).t()}
        if g is not None:
            tensors.update(grad_output=tok.take(g, 0), grad_output_cols=n_ax.take(g, 1))
        op_amax = {v: amax[v.split("_cols")[0].split("_rows")[0]] for v in tensors}
        casts = _Casts(tensors, op_amax)
        views = {v: v for v in ("input_cols", "weight_rows", "grad_output_cols")}
        layer.sampled = {k: int(a.index.numel()) for k, a in (("tokens", tok), ("out_features", n_ax),
                                                               ("in_features", k_ax)) if a.index is not None}
    rest = None  # the input's ordinary elements, where it has outlier tokens or channels
    if layer.outlier_tokens or layer.outlier_channels:
        tokens, channels = _mask(tokens, row_amax.numel()), _mask(channels, col_amax.numel())
        rest = (~(tok.take(tokens, 0)[:, None] | channels[None, :])).float()
    axes = {"input": (tok, full), "weight": (full, n_ax), "grad_output": (tok, full)}
    energy = {op: _norm(t) for op, t in tensors.items() if op in axes} if not sampled else {}
    done: dict[int, OperandStats] = {}  # by cast: rowwise and rowwise_with_gw_hp share theirs
    signals: dict[str, _Signal] = {}
    # the grad-weight GEMM's operands read every token and the sampled features
    starved = (_StarvedFeatures(casts, views["grad_output_cols"], n_ax,
                                summaries["grad_output"].col_amax if summaries else None) if g is not None else None)
    ordinary_gw = (_OrdinaryGradWeight(casts, views["input_cols"], views["grad_output_cols"], tokens, n_ax, k_ax)
                   if g is not None and layer.outlier_tokens else None)
    for rname, r in RECIPES.items():
        hows = {"input": (r.input, -1), "weight": (r.weight, 0), "grad_output": (r.grad_output, -1)}
        stats = {}
        for op in ("input", "weight", "grad_output"):
            if op not in tensors:
                continue
            # a layer measured whole: its statistics read the cast's values in the operand's layout
            q = casts.get(op, *hows[op], r.pow2_scales, any_layout=not sampled)
            if id(q) not in done:
                mask = rest if op == "input" else None
                if sampled and op not in signals:
                    signals[op] = _signal(tensors[op], mask, *axes[op])
                done[id(q)] = (_sampled_stats(tensors[op], q, signals[op], mask, *axes[op]) if sampled
                               else operand_stats(tensors[op], q, mask, energy[op], casts.scratch))
            stats[op] = done[id(q)]
        if starved is not None:
            stats["grad_output"] = replace(stats["grad_output"], starved_features=starved(r))
        if ordinary_gw is not None:
            stats["input"] = replace(stats["input"], sqnr_grad_weight_rest_db=ordinary_gw(r))
        layer.operands[rname] = stats
    # the chosen recipe's GEMMs, on the sampled rows and columns of their products: each product
    # element reduces over a whole dim, so its value is exact; only the SQNR is over a sample
    p2 = chosen.pow2_scales
    pool = casts.scratch  # a layer measured whole: its products' tensors come from the scratch and go back
    mm = pool.mm if pool is not None else torch.mm
    made: list[torch.Tensor] = []  # the products made here, for the scratch
    xq, wq = casts.get("input", chosen.input, -1, p2), casts.get("weight", chosen.weight, 0, p2)
    output = mm(xq.value, wq.value)
    made.append(output)
    # called more than once: the recorded products are the first call's; a forward of its own: the
    # recorded output and weight gradient are not F.linear's - recomputed from the input and weight
    once = rec.calls == 1 and rec.own_difference is None
    if once and rec.out is not None and rec.out_version is not None and _version(rec.out) == rec.out_version:
        reference = n_ax.take(tok.take(rec.out, 0), 1)
        if rec.module.bias is not None:  # x @ W.T as fp32 computed it: the output less the bias
            bias = n_ax.take(rec.module.bias.detach().float(), 0)
            reference = pool.sub(reference, bias) if pool is not None else reference - bias
            made.append(reference)
    else:
        reference = tensors["input"] @ tensors["weight"]  # the sampled rows of x and W, taken once above
    layer.gemms["output"] = (_sampled_sqnr(reference, output, tok, n_ax) if sampled else
                             _sqnr(reference, output, pool))
    if layer.outlier_tokens:  # the ordinary tokens' output rows: what their lost input bits cost
        ordinary = ~tok.take(tokens, 0)
        rows = _Axis(None, None if tok.weight is None else tok.weight[ordinary])
        layer.gemms["output_ordinary_tokens"] = (
            _sampled_sqnr(reference[ordinary], output[ordinary], rows, n_ax) if sampled
            else sqnr_db(reference[ordinary], output[ordinary]))
    if g is not None:
        go = casts.get("grad_output", chosen.grad_output, -1, p2)
        w_gi = casts.get(views["weight_rows"], chosen.weight_for_grad_input, -1, p2)
        grad_input = mm(go.value, w_gi.value.t())
        # not the gradient autograd gave x: x may feed other layers too (q, k and v share theirs);
        # a layer measured whole and called once: the recording's backward computed this product
        if once and not sampled and rec.grad_input is not None:
            ref_gi = rec.grad_input
            made.append(grad_input)
        else:
            ref_gi = mm(tensors["grad_output"], tensors[views["weight_rows"]].t())
            made += [grad_input, ref_gi]
        layer.gemms["grad_input"] = (_sampled_sqnr(ref_gi, grad_input, tok, k_ax) if sampled else
                                     _sqnr(ref_gi, grad_input, pool))
        go_gw = casts.get(views["grad_output_cols"], chosen.grad_output_for_grad_weight, 0, p2)
        x_gw = casts.get(views["input_cols"], chosen.input_for_grad_weight, 0, p2)
        grad_weight = mm(go_gw.value.t(), x_gw.value)  # (N,K), as weight.grad
        made.append(grad_weight)
        if once and rec.grad_weight is not None:
            ref_gw = k_ax.take(n_ax.take(rec.grad_weight, 0), 1)
        elif go_gw.value is tensors[views["grad_output_cols"]] and x_gw.value is tensors[views["input_cols"]]:
            # a grad-weight GEMM in high precision (rowwise_with_gw_hp): the product just made is
            # the reference's own - the same operands, the same mm, the same bits
            ref_gw = grad_weight
        else:
            ref_gw = mm(tensors[views["grad_output_cols"]].t(), tensors[views["input_cols"]])
            made.append(ref_gw)
        layer.gemms["grad_weight"] = (_sampled_sqnr(ref_gw, grad_weight, n_ax, k_ax) if sampled else
                                      _sqnr(ref_gw, grad_weight, pool))
    if weight_cast is not None and not sampled:  # the whole weight's cast: the dominance forwards take it
        weight_cast[id(rec.module)] = wq
    if pool is not None:  # nothing reads them any more (but that cast)
        for t in made:
            pool.give(t)
        casts.release(wq)
    return layer


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None where it has none (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


class _Replay:
    """The fp8 Linears' calls of one fp8 forward (input, output, by module and call), kept for a
    second forward that differs from it in one layer only: until that layer runs, every call
    gets the same input and gives the same output, so the second forward takes the first's
    (its prefix casts and GEMMs are not done twice). An input is reused only where it is equal
    to the one kept, element for element, and neither tensor was changed in place since."""

    def __init__(self, last: int) -> None:
        self.calls: dict[tuple[int, int], tuple[torch.Tensor, int, torch.Tensor, int]] = {}
        self.counts: dict[int, int] = {}
        self.recording = True
        self.diverged = False  # a call's input differed: the rest of the forward runs
        self.last = last  # the module (id) after whose first call nothing is kept

    def start(self, recording: bool) -> None:
        self.counts, self.recording, self.diverged = {}, recording, False

    def key(self, module: nn.Module) -> tuple[int, int]:
        n = self.counts.get(id(module), 0)
        self.counts[id(module)] = n + 1
        return id(module), n

    def get(self, key: tuple[int, int], x: torch.Tensor) -> torch.Tensor | None:
        if self.recording or self.diverged:
            return None
        kept = self.calls.get(key)
        if (kept is None or _version(kept[0]) != kept[1] or _version(kept[2]) != kept[3] or None in (kept[1], kept[3])
                or kept[0].shape != x.shape or kept[0].dtype != x.dtype or not torch.equal(kept[0], x)):
            self.diverged = True
            return None
        return kept[2]

    def put(self, key: tuple[int, int], x: torch.Tensor, out: torch.Tensor) -> None:
        if self.recording:
            self.calls[key] = (x, _version(x), out, _version(out))
            # the second forward runs every call from the worst layer's on anew: keeping the later
            # ones would only hold their tensors (memory the forward then takes in fresh pages)
            self.recording = key[0] != self.last


@contextlib.contextmanager
def _modules_called() -> Iterator[None]:
    """nn.TransformerEncoderLayer's fast path (eval mode, no grad) computes its Linears in one
    fused kernel without calling them: the fp8 forward ran every one of them in fp32 (a
    TransformerEncoder's output read 135 dB SQNR with all its Linears 'in fp8'). Off meanwhile."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "get_fastpath_enabled"):
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)


def fp8_forward(model: nn.Module, inputs: ExampleInputs, names: set[str], recipe: Recipe,
                weights: dict[int, CastResult] | None = None,
                weight_amax: dict[int, torch.Tensor] | None = None, replay: _Replay | None = None,
                kept: tuple[bool, ...] | None = None) -> torch.Tensor:
    """The model's output (no grad) with the Linears named in ``names`` computing in fp8.
    ``weights``: each module's weight as cast, by id, kept from one call to the next;
    ``weight_amax``: each one's amax, where the measurement already took it; ``replay``: the
    calls kept from a previous forward (``_Replay``), or to keep for the next."""
    weights = {} if weights is None else weights
    weight_amax = weight_amax or {}
    # the input as cast, by tensor: q, k and v projections read the same one (unchanged since:
    # its version); kept while this forward runs, so the id is not reused
    inputs_cast: dict[int, tuple[torch.Tensor, int | None, CastResult]] = {}

    def cast_input(x: torch.Tensor, x2: torch.Tensor, how: Any, dim: int) -> CastResult:
        kept = inputs_cast.get(id(x))
        version = _version(x)
        if kept is not None and kept[0] is x and version is not None and kept[1] == version:
            return kept[2]
        q = cast(x2, how, dim, pow2=recipe.pow2_scales, count=False)  # only the value is needed: no counts
        inputs_cast[id(x)] = (x, version, q)
        return q

    def fp8_linear(module: nn.Linear) -> Callable[..., Any]:
        original = module.forward

        # in place of the module's forward, not after it: the fp32 GEMM would be wasted work
        def forward(*args: Any, **kwargs: Any) -> Any:
            x = linear_input(args, kwargs)
            if x is None:
                return original(*args, **kwargs)
            key = replay.key(module) if replay is not None else None
            if replay is not None and (kept := replay.get(key, x)) is not None:
                return kept
            x2 = x.detach().float().reshape(-1, x.shape[-1])

            def cast_fn(t: torch.Tensor, how: Any, dim: int) -> CastResult:
                if t is x2:
                    return cast_input(x, x2, how, dim)
                if id(module) not in weights:
                    weights[id(module)] = cast(t, how, dim, pow2=recipe.pow2_scales, count=False,
                                               amax=weight_amax.get(id(module)))
                return weights[id(module)]

            out, _ = output_gemm(x2, module.weight.detach().float(), recipe, cast_fn)
            if module.bias is not None:  # in place: the GEMM's output is new (a new tensor costs its page faults)
                out.add_(module.bias.detach().float())
            out = out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
            if replay is not None:
                replay.put(key, x, out)
            return out

        return forward

    # attributes_kept takes the instance attributes ``forward`` away again
    with attributes_kept(model), torch.no_grad(), _modules_called():
        for name, module in linears(model):
            if name in names:
                module.forward = fp8_linear(module)
            elif _is_float8_linear(module):  # converted already: the layers not in fp8 run in fp32
                module.forward = nn.Linear.forward.__get__(module)
        try:
            return _outputs(model(*inputs.args, **inputs.kwargs), kept)
        finally:
            inputs_cast.clear()


def dominance(model: nn.Module, inputs: ExampleInputs, measurement: Fp8Measurement, candidates: list[str],
              min_layers: int = 2) -> None:
    """Whether one of ``candidates``' fp8 error dominates the model output: the output SQNR
    with every candidate in fp8, and without the one whose own GEMM output is the worst."""

    reference = measurement.reference
    # both forwards cast the same weights; those measured whole, the measurement cast already
    # (held only until here)
    weights, measurement.weight_cast = measurement.weight_cast, {}
    if not candidates or reference is None or reference.numel() == 0 or not bool(reference.any()):
        return  # an all-zero fp32 output (a zero-initialised last layer) is no measure of any error
    start = time.perf_counter()
    recipe = RECIPES[measurement.recipe]
    second = len(candidates) >= max(2, min_layers)  # with fewer, no one layer is said to dominate: no second run
    by_name = {layer.name: layer for layer in measurement.layers}
    worst = min(candidates, key=lambda n: by_name[n].gemms.get("output", math.inf)) if second else None
    # the second forward takes the first's calls up to the worst layer
    replay = _Replay(id(dict(linears(model))[worst])) if second else None
    measurement.output_sqnr_db = sqnr_db(reference, fp8_forward(model, inputs, set(candidates), recipe, weights,
                                                                     measurement.weight_amax, replay,
                                                                     measurement.outputs_kept))
    if second:
        measurement.dominant = worst
        rest = set(candidates) - {worst}
        replay.start(recording=False)
        measurement.output_sqnr_without_db = sqnr_db(reference, fp8_forward(model, inputs, rest, recipe, weights,
                                                                              measurement.weight_amax, replay,
                                                                              measurement.outputs_kept))
    measurement.seconds["dominance"] = time.perf_counter() - start
