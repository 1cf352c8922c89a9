"""fp8 training's casts, emulated exactly as torchao computes them: what each GEMM operand of
an ``nn.Linear`` becomes under a recipe, in fp32, with what the cast flushed and saturated.

A Linear trains with three GEMMs, each with two fp8 operands scaled along its reduction dim:

    output      = X (M,K)   @ Wt (K,N)      X along K (rows),   Wt along K
    grad_input  = G (M,N)   @ Wt.T (N,K)    G along N (rows),   Wt along N
    grad_weight = G.T (N,M) @ X (M,K)       G along M (columns), X along M

A scale is ``fmax / max(amax, 1e-12)`` computed in float64 then rounded to float32 (torchao's
``amax_to_scale``), rounded down to a power of two where the recipe says so; the element is
``x * scale`` clamped to ``±fmax`` and cast; the GEMM multiplies the dequantized operands
(``q / scale``) in fp32, as torchao's ``emulate=True`` does. MXFP8 (OCP MX v1.0, as torchao's
``to_mx`` in its default FLOOR mode): blocks of 32 along the reduction dim, an E8M0 scale
``2^(floor(log2(amax)) - 8)`` (e4m3's largest exponent is 8), elements clamped and cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ampaudit.core.dtypes import E4M3, E5M2, LowDtype
from ampaudit.graph import fp8_native

EPS = 1e-12  # torchao's amax floor (float8_utils.EPS)
MX_BLOCK = 32
_E8M0_MIN, _E8M0_MAX = -127, 127  # float8_e8m0fnu's exponents (255 is NaN)

# how one operand is cast for one GEMM: "tensor", "row" (per slice along the reduction dim),
# "block" (MX), or None (high precision: the GEMM does not run in fp8)
TENSOR, ROW, BLOCK = "tensor", "row", "block"


@dataclass(frozen=True)
class Cast:
    fmt: LowDtype | None  # None: kept in high precision
    granularity: str | None = None

    @property
    def short(self) -> str:
        if self.fmt is None:
            return "hp"
        return f"{self.fmt.short}/{self.granularity}"


HP = Cast(None)


@dataclass(frozen=True)
class Recipe:
    """The six casts of one recipe (torchao's CastConfig names) and its scale rounding."""

    name: str
    input: Cast
    weight: Cast
    grad_output: Cast
    input_for_grad_weight: Cast
    weight_for_grad_input: Cast
    grad_output_for_grad_weight: Cast
    pow2_scales: bool
    # the GEMM dims (in_features, out_features) its kernels take: torch._scaled_mm's 16, MX's block
    dim_multiple: int = 16

    @property
    def grad_output_format(self) -> LowDtype | None:
        return self.grad_output.fmt


RECIPES: dict[str, Recipe] = {
    "tensorwise": Recipe("tensorwise", Cast(E4M3, TENSOR), Cast(E4M3, TENSOR), Cast(E5M2, TENSOR),
                         Cast(E4M3, TENSOR), Cast(E4M3, TENSOR), Cast(E5M2, TENSOR), pow2_scales=False),
    "rowwise": Recipe("rowwise", Cast(E4M3, ROW), Cast(E4M3, ROW), Cast(E4M3, ROW),
                      Cast(E4M3, ROW), Cast(E4M3, ROW), Cast(E4M3, ROW), pow2_scales=True),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", Cast(E4M3, ROW), Cast(E4M3, ROW), Cast(E4M3, ROW),
                                 HP, Cast(E4M3, TENSOR), HP, pow2_scales=True),
    "mxfp8": Recipe("mxfp8", Cast(E4M3, BLOCK), Cast(E4M3, BLOCK), Cast(E4M3, BLOCK),
                    Cast(E4M3, BLOCK), Cast(E4M3, BLOCK), Cast(E4M3, BLOCK), pow2_scales=True, dim_multiple=MX_BLOCK),
}
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # Float8LinearConfig.from_recipe_name
EMITTED_RECIPES = (*TORCHAO_RECIPES, "mxfp8")  # and torchao's MXFP8TrainingOpConfig


@dataclass
class CastResult:
    """An operand as the GEMM sees it (dequantized, fp32), and what its cast lost."""

    value: torch.Tensor
    flushed: int  # nonzero elements that became 0
    saturated: int  # elements clamped to the format's max after scaling
    nonzero: int
    # where the C pass measured it (``cast(norm=True)``): the tensor cast, and the 2-norm of its
    # difference from ``value`` as ``fp8_native.error_norm`` gives it - for that tensor only
    error_norm: tuple[torch.Tensor, float] | None = None


def _scale(amax: torch.Tensor, fmt: LowDtype, pow2: bool) -> torch.Tensor:
    scale = (fmt.max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def amax_of(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # the same values as torch.amax(torch.abs(x)), without abs's copy; over the whole tensor
    # aminmax is one pass, half vector_norm's time on a CPU; along a dim, amax and amin are
    # each 6-10x faster than aminmax's or vector_norm(inf)'s reductions there (torch 2.13 CPU)
    if dim is None:
        if x.numel() == 0:
            return torch.zeros((), dtype=x.dtype)
        low, high = torch.aminmax(x)
        return torch.maximum(-low, high)
    return torch.maximum(x.amax(dim, keepdim=True), x.amin(dim, keepdim=True).neg_())


_E4M3_TO_F16 = -16512  # 0xBF80 as int16: the sign bit and the 7 bits e4m3's exponent and mantissa land in


_F16_BIAS = 2.0 ** 8  # e4m3's bits in float16's places read 2^-8 of the value (exponent bias 15, not 7)
_MIN_EXACT = 2.0 ** -118  # a scale at least this: scale / 2^8 is a normal float32, exact
_MAX_EXACT = 2.0 ** 119  # and at most this: scale * 2^8 is finite


def _dequantize(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, divide: bool = True) -> torch.Tensor:
    """``q / scale`` in float32 (as torchao's emulation: ``q.float() / scale``, bit for bit;
    ``divide=False``: ``q * scale``, MX's power-of-two scales), written into ``out`` (the
    scaled tensor ``q`` was cast from: no new float32 tensor; on a
    CPU a fresh multi-MB tensor costs its page faults, as much as a pass over it).

    torch's e4m3 -> float32 conversion is a per-element function on a CPU (5x the cost of the
    cast to e4m3): e4m3's bits are moved into float16's places instead (sign; exponent and
    mantissa 7 bits up), which converts in hardware, and the 2^8 between the two exponent
    biases is folded into the scale (dividing by scale / 2^8 is dividing 2^8 q by scale: one
    rounding either way) where the scale stays a normal float32 (``_foldable``).
    Every finite e4m3 value, subnormals included, comes out exactly; the NaN code would not
    (a caller with a non-finite scale uses ``q.float()``)."""
    if q.dtype != torch.float8_e4m3fn:
        out.copy_(q)
        return out.div_(scale) if divide else out.mul_(scale)
    h = q.view(torch.int8).to(torch.int16)  # sign-extended: the sign lands in bits 8-15
    h <<= 7
    h &= _E4M3_TO_F16  # the sign bit and the exponent and mantissa, nothing of the sign's extension
    out.copy_(h.view(torch.float16))
    if _foldable(scale, divide):
        return out.div_(scale / _F16_BIAS) if divide else out.mul_(scale * _F16_BIAS)
    out.mul_(_F16_BIAS)
    return out.div_(scale) if divide else out.mul_(scale)


def _foldable(scale: torch.Tensor, divide: bool) -> bool:
    return float(scale.min()) >= _MIN_EXACT if divide else float(scale.max()) <= _MAX_EXACT


def _count_nonzero8(q: torch.Tensor) -> int:
    """Nonzero elements of an fp8 tensor (-0 is zero): its bytes less the sign bit."""
    return int(torch.count_nonzero(q.view(torch.uint8) & 0x7F))


def _finite(amax: torch.Tensor) -> bool:
    """Whether every element of ``amax`` (amaxes: each >= 0 or NaN) is finite: its max, which
    propagates NaN (one reduction and one read, where isfinite(t).all() is six small ops)."""
    return math.isfinite(float(amax if amax.numel() == 1 else amax.max()))


def cast(x: torch.Tensor, how: Cast, dim: int, *, pow2: bool, nonzero: int | None = None,
         amax: torch.Tensor | None = None, count: bool = True, out: torch.Tensor | None = None,
         dense: torch.Tensor | None = None, keep_layout: bool = False, norm: bool = False) -> CastResult:
    """``x`` (2-D, fp32) cast as ``how`` says, scaled along ``dim`` (the GEMM's reduction dim).
    ``nonzero``: ``x``'s count of nonzero elements, when the caller knows it. ``amax``: the
    whole tensor's, for a per-tensor scale where ``x`` is a sample of its rows or columns (or
    ``x``'s own, known already): at least every ``|x|``.
    ``count=False``: the value only (flushed and nonzero left 0: two passes fewer). ``out``: a
    tensor of ``x``'s shape and layout the value may be written into (where the C pass casts);
    ``dense``: a contiguous one MX's value of a transposed ``x`` may be copied into;
    ``keep_layout``: where the C pass casts, MX's value stays in ``x``'s layout (no copy).
    ``norm``: where the C pass casts, it measures the error's norm too (``CastResult.error_norm``).

    Tensor and row scales come from the amax, so nothing saturates (x * fmax/amax <= fmax; a
    power-of-two scale is rounded down): only MX's floor-rounded block scales clamp values."""
    x = x if x.dtype == torch.float32 else x.float()
    if how.fmt is None:
        if nonzero is None:
            nonzero = int(torch.count_nonzero(x)) if count else 0
        return CastResult(x, 0, 0, nonzero)
    # one C pass with the scales computed in it (the torch ops below give the same bits)
    given = float(amax) if how.granularity == TENSOR and amax is not None else None
    along = None if how.granularity == TENSOR else dim
    found: list[float] | None = [] if norm else None
    done = fp8_native.cast(x, fp8_native.FromAmax(along, pow2 and how.granularity != BLOCK, given), how.fmt,
                           block=how.granularity == BLOCK, out=out, dense=dense, keep_layout=keep_layout, norm=found)
    if done is not None:
        result = _kernel_result(done[0], done, nonzero, count)
        if found:
            result.error_norm = (x, found[0])
        return result
    if how.granularity == BLOCK:
        return _mx_cast(x, how.fmt, dim, nonzero, count)
    if how.granularity != TENSOR or amax is None:
        amax = amax_of(x, None if how.granularity == TENSOR else dim)
    scale = _scale(amax, how.fmt, pow2)
    finite = _finite(amax)
    done = fp8_native.cast(x, scale, how.fmt) if finite else None
    if done is not None:  # one C pass: the same bits as the torch ops below
        return _kernel_result(done[0], done, nonzero, count)
    if nonzero is None:
        nonzero = int(torch.count_nonzero(x)) if count else 0
    # no clamp (torchao's): with an amax at least every |x|, x * fp32(fmax / amax) <= fmax (1 + 2^-23),
    # which the cast rounds to fmax all the same (a power-of-two scale is rounded down: less still)
    scaled = x * scale
    q8 = scaled.to(how.fmt.torch)
    flushed = nonzero - _count_nonzero8(q8) if count else 0  # a nonzero q comes from a nonzero x
    q = _dequantize(q8, scale, scaled) if finite else q8.float().div_(scale)
    return CastResult(q, flushed, 0, nonzero)


def _kernel_result(value: torch.Tensor, done: tuple[torch.Tensor, int, int, int], nonzero: int | None,
                   count: bool) -> CastResult:
    """``fp8_native.cast``'s counts as a CastResult: the caller's ``nonzero`` where it gave one;
    ``count=False``: the value only, as the torch path leaves it."""
    if not count:
        return CastResult(value, 0, 0, 0)
    _, nonzero_x, nonzero_q, saturated = done
    nonzero = nonzero_x if nonzero is None else nonzero
    return CastResult(value, nonzero - nonzero_q, saturated, nonzero)


def _mx_cast(x: torch.Tensor, fmt: LowDtype, dim: int, nonzero: int | None, count: bool = True) -> CastResult:
    moved = x.movedim(dim, -1)
    k = moved.shape[-1]
    pad = (-k) % MX_BLOCK
    padded = torch.nn.functional.pad(moved, (0, pad)) if pad else moved
    blocks = padded.reshape(*padded.shape[:-1], -1, MX_BLOCK)
    amax = amax_of(blocks, -1)
    # OCP MX: shared exponent = floor(log2(amax)) - emax of the element format (8 for e4m3)
    emax = int(torch.finfo(fmt.torch).max).bit_length() - 1
    exponent = torch.floor(torch.log2(amax)) - emax
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, _E8M0_MIN))
    scale = torch.exp2(exponent.clamp(_E8M0_MIN, _E8M0_MAX))
    finite = _finite(amax)
    done = fp8_native.cast(blocks.reshape(-1, MX_BLOCK), scale.reshape(-1, 1), fmt, block=True) if finite else None
    if done is not None:  # one C pass: the same bits as the torch ops below
        return _kernel_result(done[0].reshape(padded.shape)[..., :k].movedim(-1, dim).contiguous(), done, nonzero,
                              count)
    if nonzero is None:
        nonzero = int(torch.count_nonzero(x)) if count else 0
    scaled = blocks / scale
    saturated = int(torch.count_nonzero(scaled.abs() > fmt.max)) if count else 0
    q8 = scaled.clamp_(-fmt.max, fmt.max).to(fmt.torch)
    flushed = nonzero - _count_nonzero8(q8) if count else 0
    q = _dequantize(q8, scale, scaled, divide=False) if finite else q8.float().mul_(scale)
    value = q.reshape(padded.shape)[..., :k].movedim(-1, dim)
    return CastResult(value.contiguous(), flushed, saturated, nonzero)


@dataclass
class GemmResult:
    """One Linear's three GEMMs under a recipe (fp32 results of the dequantized operands) and
    each cast operand, by the name ``operand@gemm``."""

    output: torch.Tensor
    grad_input: torch.Tensor
    grad_weight: torch.Tensor
    casts: dict[str, CastResult]


CastFn = Callable[[torch.Tensor, Cast, int], CastResult]


def output_gemm(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe,
                cast_fn: CastFn | None = None) -> tuple[torch.Tensor, dict[str, CastResult]]:
    """``x`` (M,K) @ ``weight``.T (no bias) as the recipe computes it. ``cast_fn(x, how, dim)``
    replaces :func:`cast` (a caller that memoizes the casts it already made)."""
    pow2 = recipe.pow2_scales
    cast_fn = cast_fn or (lambda t, how, dim: cast(t, how, dim, pow2=pow2))
    xq = cast_fn(x, recipe.input, -1)
    wq = cast_fn(weight.t(), recipe.weight, 0)
    return torch.mm(xq.value, wq.value), {"input": xq, "weight": wq}


def linear_gemms(x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor | None,
                 recipe: Recipe, cast_fn: CastFn | None = None) -> GemmResult:
    """The three GEMMs of a Linear with input ``x`` (M,K), ``weight`` (N,K) and the gradient of
    its output ``grad_output`` (M,N); without a gradient, the forward only."""
    pow2 = recipe.pow2_scales
    cast_fn = cast_fn or (lambda t, how, dim: cast(t, how, dim, pow2=pow2))
    out, casts = output_gemm(x, weight, recipe, cast_fn)
    if grad_output is None:
        empty = torch.empty(0)
        return GemmResult(out, empty, empty, casts)
    wt = weight.t()
    go = cast_fn(grad_output, recipe.grad_output, -1)
    w_gi = cast_fn(wt, recipe.weight_for_grad_input, -1)
    grad_input = torch.mm(go.value, w_gi.value.t())
    go_gw = cast_fn(grad_output, recipe.grad_output_for_grad_weight, 0)
    x_gw = cast_fn(x, recipe.input_for_grad_weight, 0)
    grad_weight = torch.mm(go_gw.value.t(), x_gw.value)  # (N,K), as weight.grad
    casts.update({"grad_output": go, "weight@grad_input": w_gi, "grad_output@grad_weight": go_gw,
                  "input@grad_weight": x_gw})
    return GemmResult(out, grad_input, grad_weight, casts)
