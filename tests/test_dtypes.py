"""core/dtypes.LowDtype: one value type for the audited dtype, exact against torch.finfo."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from ampaudit.core.dtypes import BFLOAT16, E4M3, E5M2, FLOAT16, FP8_FORMATS, LOW_DTYPES, LowDtype
from ampaudit.core.errors import UsageError


@pytest.mark.parametrize("low", [FLOAT16, BFLOAT16, E4M3, E5M2])
def test_limits_match_torch_finfo(low):
    info = torch.finfo(low.torch)
    assert low.max == info.max
    assert low.normal == info.smallest_normal
    assert low.eps == info.eps
    assert low.tiniest == info.smallest_normal * info.eps
    assert low.mantissa == -round(math.log2(info.eps))


@pytest.mark.parametrize("low", [FLOAT16, BFLOAT16])
def test_overflow_threshold_is_exactly_where_the_cast_becomes_inf(low):
    # fp32, as the audited tensors are (torch casts float64 to float16 through float32)
    at = torch.tensor(low.overflow_at, dtype=torch.float32)
    below = torch.nextafter(at, torch.tensor(0.0))
    assert torch.isinf(at.to(low.torch)) and not torch.isinf(below.to(low.torch))
    # and the smallest subnormal's half rounds to zero, just above it does not
    half = torch.tensor(low.tiniest / 2, dtype=torch.float32)
    assert half.to(low.torch).item() == 0.0
    assert torch.nextafter(half, torch.tensor(1.0)).to(low.torch).item() == low.tiniest


@pytest.mark.parametrize("value, expected", [
    ("float16", FLOAT16), ("fp16", FLOAT16), ("half", FLOAT16), ("FP16", FLOAT16), ("torch.float16", FLOAT16),
    (torch.float16, FLOAT16), ("bfloat16", BFLOAT16), ("bf16", BFLOAT16), (torch.bfloat16, BFLOAT16),
    (BFLOAT16, BFLOAT16),
])
def test_parse_accepts_every_spelling(value, expected):
    assert LowDtype.parse(value) is expected


@pytest.mark.parametrize("value", ["float32", torch.float32, "fp8", "", None, 16])
def test_parse_refuses_anything_else_with_one_line(value):
    with pytest.raises(UsageError, match=r"^dtype must be float16 or bfloat16 \(got .*\)$"):
        LowDtype.parse(value)


def test_fp8_formats_are_the_ocp_ones():
    assert (E4M3.max, E4M3.normal, E4M3.tiniest) == (448.0, 2.0**-6, 2.0**-9)
    assert (E5M2.max, E5M2.normal, E5M2.tiniest) == (57344.0, 2.0**-14, 2.0**-16)
    assert FP8_FORMATS == {"e4m3": E4M3, "e5m2": E5M2}
    # half the smallest subnormal rounds to zero in the cast, just above it does not
    for low in (E4M3, E5M2):
        half = torch.tensor(low.tiniest / 2, dtype=torch.float32)
        assert half.to(low.torch).item() == 0.0
        assert torch.nextafter(half, torch.tensor(1.0)).to(low.torch).float().item() == low.tiniest


def test_names_and_printing():
    assert LOW_DTYPES == ("float16", "bfloat16")
    assert (str(FLOAT16), FLOAT16.short, BFLOAT16.short) == ("float16", "fp16", "bf16")
    assert f"{BFLOAT16}" == "bfloat16" and f"{FLOAT16} max" == "float16 max"


def test_importing_it_does_not_import_torch():
    code = "import sys, ampaudit.core.dtypes as d; d.FLOAT16.max; d.BFLOAT16.overflow_at; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
