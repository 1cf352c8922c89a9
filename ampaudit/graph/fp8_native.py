"""fp8 casts emulated in one C pass (``fp8_cast.c``): scale, round as torch's ``.to(float8_*)``
rounds, dequantize, and count, where the torch ops (``fp8_casts``) take seven passes and
torch's float32 -> float8 conversion is a per-element function on a CPU. Built by
``core.native`` on first use; without a compiler (or with ``AMPAUDIT_CPU_KERNEL=0``)
``available()`` is False and ``fp8_casts`` uses the torch ops, which give the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ampaudit.core import native
from ampaudit.core.dtypes import LowDtype
from ampaudit.core.tensors import dense_numel

SOURCE = Path(__file__).with_name("fp8_cast.c")


@cache
def _functions() -> tuple[ctypes._CFuncPtr, ...] | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    fn = lib.ampaudit_fp8_cast
    p, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    fn.argtypes = [p, p, i64, i64, p, i64, i64, u32, u32, ctypes.c_float, u32, u32, ctypes.c_float, ctypes.c_int, p,
                   ctypes.c_int]
    fn.restype = None
    amax = lib.ampaudit_fp8_cast_amax
    amax.argtypes = [p, p, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int, u32, u32,
                     ctypes.c_float, u32, u32, ctypes.c_float, p, ctypes.c_int, p]
    amax.restype = ctypes.c_int
    summary = lib.ampaudit_fp8_summary
    summary.argtypes = [p, i64, i64, p, p, i64, p, p, p]
    summary.restype = ctypes.c_int
    spread = lib.ampaudit_fp8_spread
    spread.argtypes = [p, i64, ctypes.c_float, p, p, p]
    spread.restype = ctypes.c_int
    norm = lib.ampaudit_fp8_error_norm
    norm.argtypes = [p, p, i64]
    norm.restype = ctypes.c_float
    return fn, amax, summary, spread, norm


def available() -> bool:
    return _functions() is not None


@dataclass(frozen=True)
class FromAmax:
    """Scales the kernel computes itself from the amaxes, as ``fp8_casts`` computes them:
    ``dim``: the dim each scale is taken along (the GEMM's reduction dim; None: one scale for
    the tensor, from ``amax`` where given, else the tensor's own); ``pow2``: rounded down to a
    power of two. With ``block``: MX's E8M0 scales of 32-element blocks along ``dim``."""

    dim: int | None
    pow2: bool = False
    amax: float | None = None


@cache
def _format(fmt: LowDtype) -> tuple[int, int, float, int, int, float]:
    """The kernel's constants for ``fmt``: mantissa shift, smallest normal's bits, the
    subnormal rounding's magic number, the max's bits, what beyond it becomes, the max."""
    over = fmt.max if fmt.finite_only else float("inf")  # e4m3fn saturates, e5m2 overflows
    bits = native.float_bits
    return (23 - fmt.mantissa, bits(fmt.normal), fmt.tiniest * 2.0 ** 23, bits(fmt.max), bits(over), fmt.max)


def _walk(x: torch.Tensor) -> tuple[int, int, tuple[int, int]] | None:
    """A 2-D tensor's dense layout as (outer, inner, which logical dim is outer and inner),
    or None where it is not one the kernel walks (contiguous or transposed-contiguous)."""
    rows, cols = x.shape
    if x.is_contiguous():
        return rows, cols, (0, 1)
    if x.stride(0) == 1 and x.stride(1) == rows:
        return cols, rows, (1, 0)
    return None


def cast(x: torch.Tensor, scale: torch.Tensor | FromAmax, fmt: LowDtype, *, block: bool = False,
         out: torch.Tensor | None = None, dense: torch.Tensor | None = None, keep_layout: bool = False,
         norm: list[float] | None = None) -> tuple[torch.Tensor, int, int, int] | None:
    """``x`` (2-D float32, CPU) cast with ``scale`` (broadcastable to it, float32): the
    dequantized value (in ``x``'s layout), nonzero x, nonzero after the cast, saturated.
    ``block``: MX (divide by the scale, clamp to the max, multiply back); else multiply, and
    divide back. ``scale`` a ``FromAmax``: the kernel computes the scales (one pass for the
    amaxes, a tensor's six small torch ops spared). None where the kernel does not take these
    tensors, or declines an amax (not finite): the caller's torch ops do. ``out`` (with a
    ``FromAmax``): where the value goes, a tensor of x's shape and strides; ``dense``: where MX's
    value of a transposed ``x`` is copied (contiguous, as the torch ops give it) in place of a
    new tensor; ``keep_layout``: MX's value is left in x's layout (the same values, for a reader
    that takes any layout). ``norm`` (with a ``FromAmax``): a list that gets ``error_norm(x, value)``
    - computed in the same call, the same float - where the value keeps x's layout and the
    kernel's norm is torch's (``_agrees``); left empty otherwise."""
    fns = _functions()
    walk = _walk(x) if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" else None
    if fns is None or walk is None:
        return None
    outer, inner, dims = walk
    if isinstance(scale, FromAmax):
        if out is not None and (out.shape != x.shape or out.stride() != x.stride() or out.dtype != torch.float32):
            out = None
        if dense is not None and (dense.shape != x.shape or not dense.is_contiguous() or dense.dtype != torch.float32):
            dense = None
        return _cast_from_amax(fns[1], x, outer, inner, dims, scale, fmt, block, out, dense, keep_layout, norm)
    fn = fns[0]
    if scale.dtype != torch.float32 or scale.device.type != "cpu":
        return None
    spread = scale.expand(x.shape)
    so, si = spread.stride(dims[0]), spread.stride(dims[1])
    out = torch.empty_like(x)
    counts = (ctypes.c_int64 * 3)()
    fn(x.data_ptr(), out.data_ptr(), outer, inner, spread.data_ptr(), so, si, *_format(fmt), int(block), counts,
       torch.get_num_threads())
    return out, counts[0], counts[1], counts[2]


def float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even), as a Python float."""
    return ctypes.c_float(value).value


@cache
def _mx_emax(fmt: LowDtype) -> int:
    return int(torch.finfo(fmt.torch).max).bit_length() - 1  # e4m3's largest exponent: 8


def _cast_from_amax(fn: ctypes._CFuncPtr, x: torch.Tensor, outer: int, inner: int, dims: tuple[int, int],
                    how: FromAmax, fmt: LowDtype, block: bool, out: torch.Tensor | None = None,
                    dense: torch.Tensor | None = None, keep_layout: bool = False, norm: list[float] | None = None
                    ) -> tuple[torch.Tensor, int, int, int] | None:
    if how.dim is None:
        if block:
            return None
        if how.amax is not None and not 0 <= how.amax < float("inf"):
            return None  # a non-finite amax: the torch ops' NaN scale
        gran, amax = 0, -1.0 if how.amax is None else how.amax
    else:
        along_inner = how.dim % 2 == dims[1]  # each scale along the run: one per outer index
        gran, amax = (3 if along_inner else 4) if block else (1 if along_inner else 2), -1.0
    out = torch.empty_like(x) if out is None else out
    counts = (ctypes.c_int64 * 3)()
    # MX's torch ops give a contiguous value whatever x's layout (the GEMM reads that one): then
    # x - value is no longer one layout, and error_norm would have declined it
    copied = block and not keep_layout and not out.is_contiguous()
    found = ctypes.c_float() if norm is not None and not copied and _agrees(torch.get_num_threads()) else None
    declined = fn(x.data_ptr(), out.data_ptr(), outer, inner, gran, amax, int(how.pow2), _mx_emax(fmt) if block else 0,
                  *_format(fmt), counts, torch.get_num_threads(), None if found is None else ctypes.byref(found))
    if declined:
        return None
    if found is not None:
        norm.append(found.value)
    if copied:
        out = out.contiguous() if dense is None else dense.copy_(out)
    return out, counts[0], counts[1], counts[2]


@dataclass
class Summary:
    """One operand's amax per row and per column (float32), whole amax, nonzero elements, and
    its ``k``-th smallest magnitude (0-based)."""

    row_amax: torch.Tensor
    col_amax: torch.Tensor
    amax: float
    nonzero: int
    kth: float


def summary(x: torch.Tensor, k: int) -> Summary | None:
    """``x`` (2-D float32, CPU) summed up in one C pass and a selection (the torch ops: a dozen,
    and topk's); None where the kernel does not walk it. The same values as the torch ops:
    maxima and an order statistic are exact."""
    fns = _functions()
    walk = _walk(x) if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" else None
    if fns is None or walk is None or not 0 <= k < x.numel():
        return None
    outer, inner, dims = walk
    amaxes = torch.empty(outer + inner)
    nonzero, kth, amax = ctypes.c_int64(), ctypes.c_float(), ctypes.c_float()
    if fns[2](x.data_ptr(), outer, inner, amaxes.data_ptr(), amaxes.data_ptr() + 4 * outer, k, ctypes.byref(nonzero),
              ctypes.byref(kth), ctypes.byref(amax)):
        return None
    by_dim = (amaxes[:outer], amaxes[outer:]) if dims[0] == 0 else (amaxes[outer:], amaxes[:outer])
    return Summary(by_dim[0], by_dim[1], amax.value, nonzero.value, kth.value)


def spread(amax: torch.Tensor, ratio: float) -> tuple[float, int, float] | None:
    """``amax`` (1-D contiguous float32, CPU, each >= 0): its lower median (``torch.median``'s),
    how many exceed ``ratio`` x it (compared in float32, as ``amax > ratio * amax.median()``),
    and its least positive element (inf where none is); None where the kernel is not here."""
    fns = _functions()
    if (fns is None or amax.dim() != 1 or not amax.numel() or amax.dtype != torch.float32
            or amax.device.type != "cpu" or not amax.is_contiguous()):
        return None
    median, over, least = ctypes.c_float(), ctypes.c_int64(), ctypes.c_float()
    if fns[3](amax.data_ptr(), amax.numel(), ratio, ctypes.byref(median), ctypes.byref(over), ctypes.byref(least)):
        return None
    return median.value, over.value, least.value


def error_norm(x: torch.Tensor, v: torch.Tensor | None = None) -> float | None:
    """``float(torch.linalg.vector_norm(x - v))`` (of ``x`` where ``v`` is None) in one C pass,
    the same float: the kernel sums in torch's order, checked against torch's norm on first use
    (per torch thread count). ``x`` and ``v``: float32 CPU tensors of one shape and strides,
    dense; None where they are not, or where this torch sums otherwise (the caller's torch ops)."""
    fns = _functions()
    if fns is None or x.dtype is not torch.float32 or not x.is_cpu or not _agrees(torch.get_num_threads()):
        return None
    if v is not None and (v.dtype is not torch.float32 or not v.is_cpu or v.stride() != x.stride()
                          or v.shape != x.shape):
        return None
    if not x.is_contiguous() and (x.dim() != 2 or _walk(x) is None) and dense_numel(x.shape, x.stride()) is None:
        return None
    return fns[4](x.data_ptr(), 0 if v is None else v.data_ptr(), x.numel())


@cache
def _agrees(threads: int) -> bool:
    """Whether the kernel's norm is torch's, bit for bit, on probes that tell summation orders
    apart: six vectors of every length to 20 (each tail of the eight lanes and of the groups of
    four, with and without a body: a tail's rounding shows in some of them), a long one with
    elements over 30 decades and zeros, one past torch's grain, a transposed matrix; differences
    of two tensors and single tensors. About 2 ms, once."""
    fn = _functions()[4]
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 40_003, generator=g)
    x, v = noise[0], noise[0] + noise[1] * 1e-3
    wide = x[:4099] * torch.full((4099,), 10.0).pow_(torch.randint(-15, 16, (4099,), generator=g))
    wide[::11] = 0
    probes = [(x[k * 20:k * 20 + n], v[k * 20:k * 20 + n]) for n in range(1, 21) for k in range(6)]
    # past torch's grain (32768: where a reduction could be split across threads); dense, column-major
    probes += [(wide, v[:4099]), (x, v), (x[:4096].view(64, 64).t(), v[:4096].view(64, 64).t())]
    for a, b in probes:
        for c in (b, None):
            want = float(torch.linalg.vector_norm(a if c is None else a - c))
            if fn(a.data_ptr(), 0 if c is None else c.data_ptr(), a.numel()) != want:
                return False
    return True
