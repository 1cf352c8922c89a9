"""The raw statistics row in one Triton kernel (CUDA): a single pass over the tensor builds
the bin histogram, the counts that round to Inf and that are -inf, and the finite absmax,
and for parameter gradients the sum of squares and the count that overflows at the loss
scale. Each program histograms BLOCK elements on chip and adds its bins to the row with
integer atomics - one atomic per bin per block, not per element, so a tensor whose values
share a few bins does not serialise on them. The row is a slice of the step's arena:
recording a tensor is one kernel launch. The row's bins and slots are ``layout.LAYOUT``'s,
passed to the kernel as constexpr arguments.

``available()`` is False without Triton or without CUDA; callers then use the torch path.
Set TRITON_INTERPRET=1 to run the kernel on the CPU (how the tests check it without a GPU).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from ampaudit.watch.layout import LAYOUT

BLOCK = 8192
# The layout, as the kernel's constexpr arguments (part of its compile key), and fp32's -inf
# (0xff800000) as an int32
_CONSTANTS = {"BINS": LAYOUT.bins, "SHIFT": LAYOUT.bin_shift, "OVERFLOW_SLOT": LAYOUT.count["overflow"],
              "NEGINF_SLOT": LAYOUT.count["neginf"], "SCALED_SLOT": LAYOUT.count["scaled"],
              "ABSMAX_SLOT": LAYOUT.extra["absmax"], "SUMSQ_SLOT": LAYOUT.extra["sumsq"],
              "NEG_INF_BITS": -(1 << 23)}


@cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def row_kernel(x_ptr, counts_ptr, extras_ptr, scale_ptr, n, overflow_at, limit,
                   BLOCK: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr, BINS: tl.constexpr,
                   SHIFT: tl.constexpr, OVERFLOW_SLOT: tl.constexpr, NEGINF_SLOT: tl.constexpr,
                   SCALED_SLOT: tl.constexpr, ABSMAX_SLOT: tl.constexpr, SUMSQ_SLOT: tl.constexpr,
                   NEG_INF_BITS: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        v = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        neginf = (v.to(tl.int32, bitcast=True) == NEG_INF_BITS) & mask
        a = tl.abs(v)
        bits = a.to(tl.int32, bitcast=True)
        key = bits >> SHIFT
        key = tl.where((key == 0) & (bits != 0), 1, key)  # bin 0: exact zeros only
        hist = tl.histogram(key, BINS)
        # Masked-off lanes load 0.0 and land in bin 0: take them back out (older Triton has
        # no histogram mask).
        pad = BLOCK - tl.minimum(n - start, BLOCK)
        bins = tl.arange(0, BINS)
        hist = tl.where(bins == 0, hist - pad, hist)
        tl.atomic_add(counts_ptr + bins, hist.to(tl.int64))
        finite = (bits < 0x7F800000) & mask
        tl.atomic_max(extras_ptr + ABSMAX_SLOT, tl.max(tl.where(finite, a, 0.0), axis=0))
        rounds_to_inf = (a >= overflow_at) & mask  # NaN compares False
        tl.atomic_add(counts_ptr + OVERFLOW_SLOT, tl.sum(rounds_to_inf.to(tl.int64), axis=0))
        tl.atomic_add(counts_ptr + NEGINF_SLOT, tl.sum(neginf.to(tl.int64), axis=0))
        if NORM:
            tl.atomic_add(extras_ptr + SUMSQ_SLOT, tl.sum(a * a, axis=0))  # masked lanes are 0
        if SCALED:
            over = (a * tl.load(scale_ptr) > limit) & mask
            tl.atomic_add(counts_ptr + SCALED_SLOT, tl.sum(over.to(tl.int64), axis=0))

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


def fill_row(x: torch.Tensor, counts: torch.Tensor, extras: torch.Tensor, overflow_at: float, *,
             norm: bool = False, scale: torch.Tensor | None = None, limit: float = 0.0) -> None:
    """``stats.fill_row`` in one kernel launch: counts (int64) and extras (float32) are a
    zeroed arena row on x's device, laid out as ``LAYOUT`` says."""
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n:
        scale_arg = scale.to(torch.float32) if scale is not None else extras
        _kernel()[(-(-n // BLOCK),)](flat, counts, extras, scale_arg, n, float(overflow_at), float(limit),
                                     BLOCK=BLOCK, NORM=norm, SCALED=scale is not None, **_CONSTANTS)

