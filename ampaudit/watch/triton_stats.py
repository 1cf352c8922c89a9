"""The raw statistics row in one Triton kernel (CUDA): a single pass over the tensor builds
the key histogram and the finite absmax. Each program histograms BLOCK elements on chip
and adds its 1024 bins to the row with integer atomics - one atomic per bin per block,
not per element, so a tensor whose values share a few bins does not serialise on them.

``available()`` is False without Triton or without CUDA; callers then use the torch path.
Set TRITON_INTERPRET=1 to run the kernel on the CPU (how the tests check it without a GPU).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from ampaudit.watch import stats

BLOCK = 8192


@cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def raw_row_kernel(x_ptr, counts_ptr, absmax_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.abs(tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
        bits = a.to(tl.int32, bitcast=True)
        # Masked-off lanes load 0.0 and land in bin 0: the host subtracts them once (older
        # Triton has no histogram mask).
        key = bits >> 21
        key = tl.where((key == 0) & (bits != 0), 1, key)  # bin 0: exact zeros only
        tl.atomic_add(counts_ptr + tl.arange(0, 1024), tl.histogram(key, 1024))
        finite = (bits < 0x7F800000) & mask
        tl.atomic_max(absmax_ptr, tl.max(tl.where(finite, a, 0.0), axis=0))

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
    counts = torch.zeros(stats.BINS, dtype=torch.int32, device=flat.device)
    absmax = torch.zeros((), dtype=torch.float32, device=flat.device)
    n = flat.numel()
    if n:
        blocks = -(-n // BLOCK)
        _kernel()[(blocks,)](flat, counts, absmax, n, BLOCK=BLOCK)
        counts[0] -= blocks * BLOCK - n  # the masked-off lanes of the last block
    return counts.to(torch.int64), absmax
