"""The low-precision dtype an audit is for: one value type that every pillar passes around.

Check's graph rules and range probe, convert's plan and watch's statistics all ask the same
questions of it - its name, its torch dtype, where its range ends (max, the overflow
threshold, the smallest normal and subnormal) and how many mantissa bits it keeps. The
numbers follow from the format's bit widths, so this module needs no torch: the lint (which
never imports torch) names dtypes with it too. ``tests/test_dtypes.py`` checks every number
against ``torch.finfo``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ampaudit.core.errors import UsageError


def fp32_exponent(value: float) -> int:
    """The biased fp32 exponent field of ``value`` > 0 (fp32 subnormals share 0 with zero)."""
    return max(0, math.frexp(value)[1] - 1 + 127)


@dataclass(frozen=True)
class LowDtype:
    """A binary floating-point format narrower than fp32: float16, bfloat16 or an fp8 format."""

    name: str  # torch's name: "float16", "bfloat16", "float8_e4m3fn"
    short: str  # what tables print: "fp16", "bf16", "e4m3"
    exponent_bits: int
    mantissa: int  # stored mantissa bits (the implicit leading one not counted)
    # OCP's e4m3 ("fn": finite, NaN only) has no infinities: its top exponent holds normal numbers,
    # all but the all-ones mantissa (NaN), so its max is 448 where an IEEE-style layout gives 240.
    finite_only: bool = False

    @cached_property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch on first use)."""
        import torch

        return getattr(torch, self.name)

    @cached_property
    def eps(self) -> float:
        return math.ldexp(1.0, -self.mantissa)

    @cached_property
    def max(self) -> float:
        bias = 2 ** (self.exponent_bits - 1) - 1
        if self.finite_only:
            return math.ldexp(2.0 - 2 * self.eps, bias + 1)
        return math.ldexp(2.0 - self.eps, bias)

    @cached_property
    def normal(self) -> float:
        """The smallest positive normal number."""
        return math.ldexp(1.0, 2 - 2 ** (self.exponent_bits - 1))

    @cached_property
    def tiniest(self) -> float:
        """The smallest positive subnormal number; below half of it a value rounds to 0."""
        return self.normal * self.eps

    @cached_property
    def overflow_at(self) -> float:
        """The smallest magnitude that becomes Inf when cast: max plus half an ulp, where
        round-to-nearest-even breaks the tie upwards (65520 for float16)."""
        return self.max + math.ldexp(1.0, math.frexp(self.max)[1] - (self.mantissa + 1) - 1)

    # Where the limits fall among fp32 exponents: both range audits keep histograms by them.
    @cached_property
    def flush_exponent(self) -> int:
        """fp32 exponents below this flush to zero in this dtype."""
        return fp32_exponent(self.tiniest / 2)

    @cached_property
    def normal_exponent(self) -> int:
        """fp32 exponents below this are subnormal in this dtype."""
        return fp32_exponent(self.normal)

    @cached_property
    def overflow_exponent(self) -> int:
        """fp32 exponents above this overflow; at this one, compare with ``overflow_at``."""
        return fp32_exponent(self.overflow_at)

    @classmethod
    def parse(cls, value: Any) -> LowDtype:
        """From ``"fp16"``, ``"float16"``, ``"half"``, ``"bf16"``, ``"bfloat16"``, a
        ``torch.dtype`` or a LowDtype; anything else is a UsageError."""
        if isinstance(value, LowDtype):
            return value
        key = str(value).lower().removeprefix("torch.")
        found = _BY_ALIAS.get(key)
        if found is None:
            raise UsageError(f"dtype must be float16 or bfloat16 (got {value!r})")
        return found

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple:
        # by name: the cached torch dtype would make unpickling import torch (a report from the child process)
        return _by_name, (self.name,)


FLOAT16 = LowDtype("float16", "fp16", exponent_bits=5, mantissa=10)
BFLOAT16 = LowDtype("bfloat16", "bf16", exponent_bits=8, mantissa=7)
LOW_DTYPES: tuple[str, ...] = (FLOAT16.name, BFLOAT16.name)  # the choices the CLI and config accept
# fp8 (OCP): what fp8 training casts GEMM operands to, each tensor scaled first. Not among LOW_DTYPES:
# an fp8 audit chooses a recipe (which format each operand gets, how it is scaled), not one dtype.
E4M3 = LowDtype("float8_e4m3fn", "e4m3", exponent_bits=4, mantissa=3, finite_only=True)
E5M2 = LowDtype("float8_e5m2", "e5m2", exponent_bits=5, mantissa=2)
FP8_FORMATS: dict[str, LowDtype] = {E4M3.short: E4M3, E5M2.short: E5M2}
# the fp8 training recipes ampaudit emulates (graph/fp8_casts.py); torch-free, for the CLI's choices
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
_BY_ALIAS = {
    "float16": FLOAT16, "fp16": FLOAT16, "half": FLOAT16,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
}
_BY_NAME = {d.name: d for d in (FLOAT16, BFLOAT16, E4M3, E5M2)}


def _by_name(name: str) -> LowDtype:
    """A LowDtype unpickled: by its name, fp8 formats too (an fp8 audit's report names e4m3)."""
    return _BY_NAME[name]
