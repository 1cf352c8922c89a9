"""The raw statistics row in one Triton kernel (CUDA): a single pass over the tensor builds
the key histogram and the finite absmax, accumulating with atomics. (fp32 counts: exact
up to 2**24 elements per bin.)

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
    def raw_row_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.abs(tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
        bits = a.to(tl.int32, bitcast=True)
        tl.atomic_add(out_ptr + (bits >> 21), tl.full([BLOCK], 1.0, tl.float32), mask=mask)
        finite = (bits < 0x7F800000) & mask
        tl.atomic_max(out_ptr + 1024, tl.max(tl.where(finite, a, 0.0), axis=0))

    return raw_row_kernel


@cache
def available() -> bool:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def raw_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (counts, absmax) as ``stats.torch_raw_row``, from one kernel launch."""
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.zeros(stats.RAW, dtype=torch.float32, device=flat.device)
    n = flat.numel()
    if n:
        _kernel()[(triton_cdiv(n, BLOCK),)](flat, out, n, BLOCK=BLOCK)
    return out[: stats.BINS].to(torch.int64), out[stats.BINS]


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
