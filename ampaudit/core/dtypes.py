"""Where a low-precision dtype's range ends: shared by check's range probe and watch."""

from __future__ import annotations

import math

import torch


def overflow_at(dtype: torch.dtype) -> float:
    """The smallest magnitude that becomes Inf when cast to ``dtype``: its max plus half an
    ulp, where round-to-nearest-even breaks the tie upwards (65520 for float16)."""
    info = torch.finfo(dtype)
    digits = 1 - round(math.log2(info.eps))  # significand bits, the implicit one included
    return info.max + math.ldexp(1.0, math.frexp(info.max)[1] - digits - 1)
