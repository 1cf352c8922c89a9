"""Per-tensor statistics without host syncs, in as few passes as the hardware allows.

Each tensor becomes one *raw row*: 1024 counts of ``|x|``'s top float bits (8 exponent
bits and the 2 leading mantissa bits: one shift) plus its finite absmax. Bin 0 holds
exact zeros only (fp32 subnormals too small to reach bin 1 are moved there). That single
histogram holds everything: zeros and underflow (the low exponents), overflow (the
exponents at or beyond the audited dtype's rounding limit, rounded to the next power of two
(float16: |x| >= 2**16), and Inf), Inf (exponent 255, mantissa 0) and NaN (exponent 255
with the quiet bit - every NaN an operation produces), and the log2-magnitude histogram.
On CUDA one Triton kernel builds the row (``triton_stats``), on the CPU one C kernel
(``cpu_kernel``, compiled on first use); without them a handful of torch passes do. Rows
are reduced to the summary's Stats in one batched step at the step boundary
(``compact``), right before the one host sync.
"""

from __future__ import annotations

import math
import sys

import torch

from ampaudit.watch import cpu_kernel

BINS = 256 * 4
RAW = BINS + 1  # counts, then absmax
FIELDS = ("numel", "nan", "inf", "overflow", "underflow", "zero", "absmax")
HIST = len(FIELDS)  # compact rows: the fields above, then 256 exponent counts
WIDTH = HIST + 256


class Limits:
    """The audited dtype's limits, in fp32 bits."""

    def __init__(self, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.max = info.max
        # Round to nearest: from max + half an ulp up a value becomes inf; counted from the
        # next power of two (the histogram's resolution), so 65520 <= |x| < 65536 is missed.
        overflow_at = info.max + info.max * info.eps / 4
        self.overflow_bin = min(255, math.floor(math.log2(overflow_at)) + 1 + 127)
        self.normal_bin = math.frexp(info.smallest_normal)[1] - 1 + 127  # lower bins: underflow (bin 0: zero)


def raw_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1024 bin counts, finite absmax) of ``x``, on x's device (no host sync). Two tensors
    rather than one row: joining them would cost small ops on every tensor; the step
    boundary stacks them all at once (``stack_raw``)."""
    if x.device.type == "cuda":
        from ampaudit.watch import triton_stats

        if triton_stats.available():
            return triton_stats.raw_row(x)
    elif x.device.type == "cpu" and cpu_kernel.available():
        return cpu_kernel.raw_row(x)
    return torch_raw_row(x)


def _top_bits(a: torch.Tensor) -> torch.Tensor:
    """The 10 bits above the low 21 of each fp32 in ``a`` (>= 0): exponent and 2 mantissa bits."""
    if sys.byteorder == "little":  # the high half-word of each float, read in place: half the bytes
        return a.view(torch.int16)[1::2] >> 5
    return a.view(torch.int32) >> 21


def torch_raw_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.detach().reshape(-1).float().abs()  # a new tensor: modified in place below, never x
    counts = torch.bincount(_top_bits(a), minlength=BINS)
    zeros = a.numel() - torch.count_nonzero(a)
    counts[1] += counts[0] - zeros  # subnormals below 2**-128 share bin 0 with the zeros
    counts[0] = zeros
    absmax = a.nan_to_num_(nan=0.0, posinf=0.0).amax() if a.numel() else a.new_zeros(())
    return counts, absmax


def stack_raw(rows: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Raw rows as one N x RAW float64 matrix."""
    counts = torch.stack([c.to(device) for c, _ in rows]).to(torch.float64)
    absmax = torch.stack([m.to(device) for _, m in rows]).to(torch.float64)
    return torch.cat([counts, absmax[:, None]], dim=1)


def compact(raw: torch.Tensor, limits: Limits) -> torch.Tensor:
    """Raw rows (N x RAW) to Stats rows (N x WIDTH): all tensors of a step at once."""
    counts = raw[:, :BINS].reshape(-1, 256, 4)
    hist = counts.sum(-1)
    nan = counts[:, 255, 1:].sum(1)
    inf = counts[:, 255, 0]
    zero = counts[:, 0, 0]
    hist[:, 0] -= zero  # exponent 0 without the zeros: the fp32 subnormals
    overflow = hist[:, limits.overflow_bin:].sum(1) - nan  # inf, and finite values that round to inf
    underflow = hist[:, :limits.normal_bin].sum(1)
    head = torch.stack([counts.sum((1, 2)), nan, inf, overflow, underflow, zero, raw[:, BINS]], dim=1)
    return torch.cat([head, hist], dim=1)


def nonfinite(raw: torch.Tensor) -> torch.Tensor:
    """Per raw row: whether the tensor held NaN or Inf (exponent 255)."""
    return raw[:, 255 * 4: 256 * 4].sum(1) > 0


def to_stats(row: list[float]) -> dict:
    """A compact row read back on the host, as the summary's Stats: counts, absmax, and the
    histogram as [floor(log2 |x|), count] pairs for the finite nonzero values seen (-127:
    the fp32 subnormals, all below 2**-126)."""
    stats = {name: (float(row[i]) if name == "absmax" else int(row[i])) for i, name in enumerate(FIELDS)}
    stats["hist"] = [[e - 127, int(c)] for e, c in enumerate(row[HIST:]) if c and e < 255]
    return stats


def add_stats(total: dict, more: dict) -> dict:
    if not total:
        return {k: (list(map(list, v)) if k == "hist" else v) for k, v in more.items()}
    for key in FIELDS:
        total[key] = max(total[key], more[key]) if key == "absmax" else total[key] + more[key]
    hist = dict(map(tuple, total["hist"]))
    for exponent, count in more["hist"]:
        hist[exponent] = hist.get(exponent, 0) + count
    total["hist"] = [[e, c] for e, c in sorted(hist.items())]
    return total
