"""The statistics row in one Triton kernel (CUDA): a single pass over the tensor computes
every count, the absmax and the exponent histogram, accumulating with atomics.

``available()`` is False without Triton or without CUDA; callers then use the torch path.
Set TRITON_INTERPRET=1 to run the kernel on the CPU (how the tests check it without a GPU).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from ampaudit.watch import stats

BLOCK = 1024


@cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def row_kernel(x_ptr, out_ptr, n, limit, normal_bin, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offsets = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(x)
        bits = a.to(tl.int32, bitcast=True)
        exponent = bits >> 23
        is_nan = a != a
        is_inf = (exponent == 255) & ~is_nan
        finite = exponent < 255
        tl.atomic_add(out_ptr + 1, tl.sum((is_nan & mask).to(tl.float32), axis=0))
        tl.atomic_add(out_ptr + 2, tl.sum((is_inf & mask).to(tl.float32), axis=0))
        tl.atomic_add(out_ptr + 3, tl.sum(((a > limit) & mask).to(tl.float32), axis=0))
        under = (exponent >= 1) & (exponent < normal_bin) & mask
        tl.atomic_add(out_ptr + 4, tl.sum(under.to(tl.float32), axis=0))
        tl.atomic_add(out_ptr + 5, tl.sum(((exponent == 0) & mask).to(tl.float32), axis=0))
        tl.atomic_max(out_ptr + 6, tl.max(tl.where(finite & mask, a, 0.0), axis=0))
        tl.atomic_add(out_ptr + 7 + exponent, mask.to(tl.float32), mask=mask)

    return row_kernel


@cache
def available() -> bool:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def row(x: torch.Tensor, limits: stats.Limits) -> torch.Tensor:
    """The same row as ``stats.torch_row``, from one kernel launch."""
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.zeros(stats.WIDTH, dtype=torch.float32, device=flat.device)
    n = flat.numel()
    if n:
        grid = (triton_cdiv(n, BLOCK),)
        _kernel()[grid](flat, out, n, float(limits.max), limits.normal_bin, BLOCK=BLOCK)
    out[stats.NUMEL] = float(n)
    return out.to(torch.float64)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
