"""The fp8 cast's C pass (graph/fp8_cast.c) gives the bits the torch ops give: its rounding
against torch's own float32 -> float8 conversion (every fp32 pattern was checked once, off
line, in 2^26-element chunks: 0 mismatches for e4m3fn and e5m2; here a spread sample and every
boundary), and each cast of each recipe - values, flushed, saturated, nonzero - against the
torch path, contiguous and transposed, with padding, zeros and outliers."""

from __future__ import annotations

import pytest
import torch

from ampaudit.core.dtypes import E4M3, E5M2
from ampaudit.graph import fp8_casts, fp8_native
from ampaudit.graph.fp8_casts import RECIPES, cast

pytestmark = pytest.mark.skipif(not fp8_native.available(), reason="no C compiler: the torch ops only")
ONE = torch.ones((), dtype=torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _near(value: float, ulps: int = 3) -> list[int]:
    """fp32 bit patterns within ``ulps`` of ``value`` and of -``value``."""
    bits = int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
    near = [b for b in range(bits - ulps, bits + ulps + 1) if 0 <= b < 2 ** 31]
    return near + [b - 2 ** 32 + 2 ** 31 for b in near]  # the same magnitudes, negative


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_rounding_equals_torchs_conversion_on_a_spread_of_patterns_and_every_boundary(fmt):
    spread = torch.arange(-(2 ** 31), 2 ** 31, 4099, dtype=torch.int64)  # ~1M patterns, every exponent
    edges = []
    for k in range(-40, 20):  # each power of two, and the ties halfway between fp8 neighbours
        for m in range(16):
            edges += _near((1 + m / 16) * 2.0 ** k)
    for v in (fmt.max, fmt.overflow_at, fmt.normal, fmt.tiniest, fmt.tiniest / 2, 1e30, float("inf")):
        edges += _near(v)
    bits = torch.cat([spread, torch.tensor(edges, dtype=torch.int64)]).to(torch.int32)
    x = bits[: bits.numel() // 64 * 64].view(torch.float32).reshape(-1, 64)
    got, *_ = fp8_native.cast(x, ONE, fmt)
    assert _same_bits(got, x.to(fmt.torch).float())


def _operands() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(48, 80, generator=g) * torch.exp2(torch.randint(-30, 30, (48, 80), generator=g).float())
    tokens = torch.randn(64, 96, generator=g)
    tokens[3] *= 30000.0  # a massive-activation token
    tokens[:, 5] *= 500.0  # an outlier channel
    tokens[10:20] = 0.0
    tiny = torch.randn(40, 70, generator=g) * 1e-6  # what e4m3 flushes once an outlier sets the scale
    tiny[0, 0] = 1e4
    odd = torch.randn(7, 45, generator=g)  # MX pads 45 to 64
    return {"wide": wide, "tokens": tokens, "tiny": tiny, "transposed": tokens.t(), "odd": odd}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_cast_of_every_recipe_equals_the_torch_path(recipe, monkeypatch):
    recipe = RECIPES[recipe]
    hows = {recipe.input, recipe.weight, recipe.grad_output, recipe.input_for_grad_weight,
            recipe.weight_for_grad_input, recipe.grad_output_for_grad_weight} - {fp8_casts.HP}
    results = []
    for use_c in (True, False):
        if not use_c:
            monkeypatch.setattr(fp8_native, "cast", lambda *a, **k: None)
        results.append([cast(x, how, dim, pow2=recipe.pow2_scales) for x in _operands().values()
                        for how in sorted(hows, key=lambda h: h.short) for dim in (0, -1)])
    c_path, torch_path = results
    assert len(c_path) == len(torch_path) > 0
    for a, b in zip(c_path, torch_path, strict=True):
        assert _same_bits(a.value, b.value)
        assert a.value.stride() == b.value.stride()  # the GEMM reads the same layout
        assert (a.flushed, a.saturated, a.nonzero) == (b.flushed, b.saturated, b.nonzero)
    assert any(r.flushed for r in c_path)  # the inputs reach the flushing and saturating paths
    if recipe.name == "mxfp8":
        assert any(r.saturated for r in c_path)


def test_a_non_finite_amax_takes_the_torch_path_and_keeps_its_nan():
    x = torch.randn(8, 16)
    x[2, 3] = float("inf")
    got = cast(x, fp8_casts.Cast(E4M3, fp8_casts.ROW), -1, pow2=True)
    assert got.value[2].isnan().all() and got.value[[0, 1, 3]].isfinite().all()


def test_the_kernel_declines_what_it_does_not_walk():
    x = torch.randn(8, 16)
    assert fp8_native.cast(x[:, ::2], ONE, E4M3) is None  # neither contiguous nor transposed
    assert fp8_native.cast(x.double(), ONE, E4M3) is None
    assert fp8_native.cast(x, ONE.double(), E4M3) is None


def test_scales_computed_in_the_kernel_equal_the_torch_ops_near_a_power_of_two(monkeypatch):
    # rows whose amax puts the scale (448 / amax: rowwise's power-of-two rounding) or the amax
    # itself (MX's floor(log2)) within a few ulps of a power of two, where torch's float32 log2
    # rounds up across it
    near = [448.0 * 2.0 ** -k * (1 + j * 2.0 ** -23) for k in (-3, 0, 5, 20) for j in range(-4, 5)]
    near += [2.0 ** k * (1 + j * 2.0 ** -24) for k in (-130, -20, 0, 7) for j in range(-4, 5)]
    g = torch.Generator().manual_seed(1)
    x = torch.rand(len(near), 64, generator=g) * 0.5
    x[:, 7] = torch.tensor(near)
    row, block = fp8_casts.Cast(E4M3, fp8_casts.ROW), fp8_casts.Cast(E4M3, fp8_casts.BLOCK)
    for t in (x, x.t().contiguous().t()):  # contiguous and transposed
        for how, pow2 in ((row, True), (row, False), (block, True)):
            assert fp8_native.cast(t, fp8_native.FromAmax(-1, pow2 and how is row), E4M3, block=how is block)
            got = cast(t, how, -1, pow2=pow2)
            with monkeypatch.context() as m:
                m.setattr(fp8_native, "cast", lambda *a, **k: None)
                want = cast(t, how, -1, pow2=pow2)
            assert _same_bits(got.value, want.value) and got.flushed == want.flushed
            assert got.saturated == want.saturated


def test_the_kernel_computes_a_per_tensor_scale_from_the_amax_it_is_given():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    given = cast(x, fp8_casts.Cast(E4M3, fp8_casts.TENSOR), -1, pow2=False, amax=torch.tensor(100.0))
    assert _same_bits(given.value, (x * (448.0 / 100.0)).to(torch.float8_e4m3fn).float() / (448.0 / 100.0))
    assert fp8_native.cast(x, fp8_native.FromAmax(None, amax=float("nan")), E4M3) is None


def test_a_casts_error_norm_measured_in_its_c_call_is_error_norms_float():
    """``cast(norm=True)`` measures ||x - value|| in the cast's own C call: the float
    ``fp8_native.error_norm`` gives for that tensor and value, for every granularity, both
    layouts, dims that leave a tail of the eight lanes; none where MX's value of a transposed x
    is copied to a contiguous one (x - value is two layouts then: error_norm declines it), none
    without ``norm``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 83, generator=g) * torch.logspace(-6, 6, 83)
    x[5] = 0.0
    hows = [fp8_casts.Cast(E4M3, fp8_casts.TENSOR), fp8_casts.Cast(E5M2, fp8_casts.TENSOR),
            fp8_casts.Cast(E4M3, fp8_casts.ROW), fp8_casts.Cast(E4M3, fp8_casts.BLOCK)]
    measured = 0
    for t in (x, x.t().contiguous().t(), x.t()):  # contiguous, transposed, transposed (83, 37)
        for how in hows:
            for dim in (0, -1):
                for keep in (False, True):
                    q = cast(t, how, dim, pow2=how.granularity != fp8_casts.TENSOR, norm=True, keep_layout=keep)
                    if q.value.stride() != t.stride():
                        assert q.error_norm is None
                        continue
                    want = fp8_native.error_norm(t, q.value)
                    assert q.error_norm is not None and q.error_norm[0] is t and q.error_norm[1] == want
                    measured += 1
    assert measured == 44  # all but MX's copied value of a transposed tensor (2 dims x 2 tensors)
    assert cast(x, hows[0], -1, pow2=False).error_norm is None


def test_an_operands_summary_equals_the_torch_ops():
    # amax per row, per column and in all, nonzero elements, the 99.9th percentile of |x| (the
    # k-th smallest, as topk finds it): on spreads, ties, zeros, one element, transposed
    from ampaudit.graph.fp8_measure import _p999, _p999_index

    g = torch.Generator().manual_seed(3)
    ties = torch.randint(-3, 4, (50, 40), generator=g).float()  # mostly equal magnitudes
    cases = [*_operands().values(), ties, torch.zeros(5, 7), torch.tensor([[-2.5]]), torch.randn(3000, 1, generator=g)]
    for x in cases:
        s = fp8_native.summary(x, _p999_index(x.numel()))
        assert torch.equal(s.row_amax, x.abs().amax(1)) and torch.equal(s.col_amax, x.abs().amax(0))
        assert s.amax == float(x.abs().max()) and s.nonzero == int(torch.count_nonzero(x))
        assert s.kth == _p999(x.abs().flatten())


def test_an_amax_arrays_median_outliers_and_least_positive_equal_the_torch_ops():
    g = torch.Generator().manual_seed(4)
    cases = [torch.rand(64, generator=g), torch.rand(65, generator=g), torch.tensor([3.0]), torch.zeros(6),
             torch.tensor([0.0, 1.0, 1.0, 1.0, 25.0, 20.0]), torch.randint(0, 3, (50,), generator=g).float()]
    cases[0][5] = 1e4  # an outlier token
    for amax in cases:
        median, over, least = fp8_native.spread(amax, 20.0)
        assert median == float(amax.median()) and over == int((amax > 20.0 * amax.median()).sum())
        positive = amax[amax > 0]
        assert least == (float(positive.min()) if positive.numel() else float("inf"))


def test_the_error_norm_is_torchs_norm_of_torchs_difference_bit_for_bit():
    # the kernel sums in torch's order (eight lanes, groups of four, fused multiply-adds for the
    # last 1-3): every length's tail, contiguous and transposed, 30 decades, zeros, NaN
    assert fp8_native._agrees(torch.get_num_threads())
    g = torch.Generator().manual_seed(1)
    cases = [(r, c) for r in (1, 3, 8, 64) for c in range(1, 24)] + [(64, 384), (384, 128), (130, 257)]
    for i, (r, c) in enumerate(cases):
        x = torch.randn(r, c, generator=g) * 10.0 ** (i % 31 - 15)
        v = x + torch.randn(r, c, generator=g) * 10.0 ** (i % 31 - 18)
        x[0, 0] = v[0, -1] = 0.0
        if i % 2:
            x, v = x.t().contiguous().t(), v.t().contiguous().t()  # dense, column-major
        for a, b in ((x, v), (x, None)):
            want = float(torch.linalg.vector_norm(a if b is None else a - b))
            assert fp8_native.error_norm(a, b) == want, (r, c, b is None)
    nan = torch.ones(4, 9)
    nan[2, 3] = float("nan")
    assert fp8_native.error_norm(nan, torch.zeros(4, 9)) != fp8_native.error_norm(nan, torch.zeros(4, 9))  # NaN


def test_the_error_norm_declines_layouts_it_does_not_walk():
    x = torch.randn(8, 16)
    assert fp8_native.error_norm(x[:, ::2], x[:, ::2]) is None  # not dense
    assert fp8_native.error_norm(x, x.t().contiguous().t()) is None  # two layouts
    assert fp8_native.error_norm(x, x.double()) is None
    assert fp8_native.error_norm(x[2:], x[2:]) == float(torch.linalg.vector_norm(x[2:] - x[2:]))  # offset: its start


def test_a_kernel_that_sums_otherwise_than_torch_is_not_used(monkeypatch):
    # another torch build or CPU (16 lanes, another tail): the first-use probe finds the
    # difference and the measurement keeps torch's subtraction and norm. Here a kernel one
    # float32 ulp off where a tail of four or more follows the lanes
    import numpy as np

    real = fp8_native._functions()

    def off(x, v, n):
        found = real[4](x, v, n)
        return float(np.nextafter(np.float32(found), np.float32(np.inf))) if n % 8 >= 4 else found

    monkeypatch.setattr(fp8_native, "_functions", lambda: (*real[:4], off))
    fp8_native._agrees.cache_clear()
    try:
        assert not fp8_native._agrees(torch.get_num_threads())
        assert fp8_native.error_norm(torch.randn(8, 8), torch.randn(8, 8)) is None
    finally:
        fp8_native._agrees.cache_clear()
