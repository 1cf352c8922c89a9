"""Where a low-precision dtype's range ends, in the terms both range audits need: check's
range probe (graph/range_probe.py) and watch's statistics (watch/stats.py)."""

from __future__ import annotations

import math

import torch


def overflow_at(dtype: torch.dtype) -> float:
    """The smallest magnitude that becomes Inf when cast to ``dtype``: its max plus half an
    ulp, where round-to-nearest-even breaks the tie upwards (65520 for float16)."""
    info = torch.finfo(dtype)
    digits = 1 - round(math.log2(info.eps))  # significand bits, the implicit one included
    return info.max + math.ldexp(1.0, math.frexp(info.max)[1] - digits - 1)


def fp32_exponent(value: float) -> int:
    """The biased fp32 exponent field of ``value`` > 0 (fp32 subnormals share 0 with zero)."""
    return max(0, math.frexp(value)[1] - 1 + 127)


class Limits:
    """The audited dtype's limits, and where they fall among fp32 exponents (the histograms
    both audits keep are indexed by fp32 exponent)."""

    def __init__(self, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.max = info.max
        self.normal = info.smallest_normal
        self.tiniest = info.smallest_normal * info.eps  # the smallest subnormal
        self.mantissa = -round(math.log2(info.eps))  # stored mantissa bits
        self.overflow_at = overflow_at(dtype)
        # Round to nearest: below half the smallest subnormal a value becomes 0.
        self.flush_exponent = fp32_exponent(self.tiniest / 2)  # exponents below flush to 0
        self.normal_exponent = fp32_exponent(self.normal)  # exponents below are subnormal
        self.overflow_exponent = fp32_exponent(self.overflow_at)  # above: overflow; this one: compare
