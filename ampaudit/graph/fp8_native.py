"""fp8 casts emulated in one C pass (``fp8_cast.c``): scale, round as torch's ``.to(float8_*)``
rounds, dequantize, and count, where the torch ops (``fp8_casts``) take seven passes and
torch's float32 -> float8 conversion is a per-element function on a CPU. Built by
``core.native`` on first use; without a compiler (or with ``AMPAUDIT_CPU_KERNEL=0``)
``available()`` is False and ``fp8_casts`` uses the torch ops, which give the same bits.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from ampaudit.core import native
from ampaudit.core.dtypes import LowDtype

SOURCE = Path(__file__).with_name("fp8_cast.c")


@cache
def _function() -> ctypes._CFuncPtr | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    fn = lib.ampaudit_fp8_cast
    p, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    fn.argtypes = [p, p, i64, i64, p, i64, i64, u32, u32, ctypes.c_float, u32, u32, ctypes.c_float, ctypes.c_int, p,
                   ctypes.c_int]
    fn.restype = None
    return fn


def available() -> bool:
    return _function() is not None


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


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: LowDtype, *, block: bool = False
         ) -> tuple[torch.Tensor, int, int, int] | None:
    """``x`` (2-D float32, CPU) cast with ``scale`` (broadcastable to it, float32): the
    dequantized value (in ``x``'s layout), nonzero x, nonzero after the cast, saturated.
    ``block``: MX (divide by the scale, clamp to the max, multiply back); else multiply, and
    divide back. None where the kernel does not take these tensors (the caller's torch ops do)."""
    fn = _function()
    walk = _walk(x) if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" else None
    if fn is None or walk is None or scale.dtype != torch.float32 or scale.device.type != "cpu":
        return None
    outer, inner, dims = walk
    spread = scale.expand(x.shape)
    so, si = spread.stride(dims[0]), spread.stride(dims[1])
    out = torch.empty_like(x)
    counts = (ctypes.c_int64 * 3)()
    fn(x.data_ptr(), out.data_ptr(), outer, inner, spread.data_ptr(), so, si, *_format(fmt), int(block), counts,
       torch.get_num_threads())
    return out, counts[0], counts[1], counts[2]
