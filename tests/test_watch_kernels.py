"""The raw statistics row from each backend - torch ops, the C kernel, Triton - is the same, and
laid out as ``layout.LAYOUT`` says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import cpu_kernel, stats
from ampaudit.watch.layout import LAYOUT
from tests.conftest import ROOT

SPECIAL = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 70000.0, -1e5, 6.1e-5, 6e-5, 1e-7, 6e-8, 3e-8, 1e-30,
           1e-40, 3.4e38, float("inf"), -float("inf"), float("nan")]

FP16 = LowDtype.parse(torch.float16)
BINS = LAYOUT.bins
NAN_BINS = slice(LAYOUT.nonfinite_bins.start + 1, LAYOUT.nonfinite_bins.stop)  # exponent 255, mantissa bits
INF_BIN = LAYOUT.nonfinite_bins.start
QUIET_NAN_BIN = 0x7FC00000 >> LAYOUT.bin_shift


def c_fill(x, counts, extras, limits):
    cpu_kernel.fill_row(x, counts, extras, limits.overflow_at)


def _row(fill, x):
    """(counts, extras) of ``x`` by one backend, audited for float16."""
    counts, extras = stats.new_row(x.device)
    fill(x, counts, extras, FP16)
    return counts, extras


needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason=f"no C kernel: {cpu_kernel.status()}")


def _values(n: int, dtype: torch.dtype) -> torch.Tensor:
    """n values over 60 decades with every special value in front, in ``dtype``."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.logspace(-30, 30, n, dtype=torch.float64)
    x[: len(SPECIAL)] = torch.tensor(SPECIAL[:n], dtype=torch.float64)
    return x.to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 19, 4099, 3 * 65536 + 7])  # 3 * 65536 + 7: several pieces, on threads
def test_c_kernel_matches_the_torch_ops(dtype, n):
    x = _values(n, dtype)
    for limits in (FP16, LowDtype.parse(torch.bfloat16)):
        (counts, extras), (want_counts, want_extras) = stats.new_row(x.device), stats.new_row(x.device)
        c_fill(x, counts, extras, limits)
        stats.torch_fill_row(x, want_counts, want_extras, limits)
        assert int(counts[:BINS].sum()) == n
        # which quiet NaN a conversion makes is the library's choice
        assert torch.equal(counts[: NAN_BINS.start], want_counts[: NAN_BINS.start])
        assert int(counts[NAN_BINS].sum()) == int(want_counts[NAN_BINS].sum())
        assert torch.equal(counts[BINS:], want_counts[BINS:])  # the count slots: overflow, -inf
        assert torch.equal(extras, want_extras)  # the finite absmax


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 513, 3 * 65536 + 7])  # one thread; several pieces on threads
def test_c_kernel_sums_squares_in_the_same_pass(dtype, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 30).to(dtype)
    (counts, extras), (plain_counts, plain_extras) = stats.new_row(x.device), stats.new_row(x.device)
    cpu_kernel.fill_row(x, counts, extras, FP16.overflow_at, norm=True)
    cpu_kernel.fill_row(x, plain_counts, plain_extras, FP16.overflow_at)
    sumsq = LAYOUT.extra["sumsq"]
    assert float(extras[sumsq]) == pytest.approx(float(x.double().pow(2).sum()), rel=1e-7)  # fp64, stored in fp32
    assert torch.equal(counts, plain_counts) and float(plain_extras[sumsq]) == 0.0  # the rest as without it
    assert torch.equal(extras[: sumsq], plain_extras[: sumsq])
    for special, want in ((float("nan"), "nan"), (float("-inf"), "inf")):
        bad = x.clone() if n else torch.zeros(1, dtype=dtype)
        bad[-1] = special
        counts, extras = stats.new_row(x.device)
        cpu_kernel.fill_row(bad, counts, extras, FP16.overflow_at, norm=True)
        assert str(float(extras[sumsq])) == want  # as a dot product: NaN stays NaN, an infinity inf


@needs_kernel
@pytest.mark.parametrize("scale", [None, 3.0, 2.0**16])  # 3: products that round, as torch's do
def test_the_parameter_rows_in_one_call_are_the_rows_one_at_a_time(scale):
    # a step boundary's parameter gradients: one C call for all, each row as fill_row with its
    # norm makes it, and the count over the loss scale as the torch ops count it
    grads = [_values(n, dtype) for n, dtype in ((19, torch.float32), (4099, torch.float16), (513, torch.bfloat16),
                                                (0, torch.float32), (3 * 65536 + 7, torch.float32))]
    grads.append(torch.full((64,), 65504.0 / 3.0).nextafter(torch.tensor(1e9)))  # |x| * 3 just past the max
    rows = [stats.new_row(g.device) for g in grads]
    cpu_kernel.fill_param_rows(grads, [(c.data_ptr(), e.data_ptr()) for c, e in rows], FP16.overflow_at, scale,
                               FP16.max)
    for g, (counts, extras) in zip(grads, rows, strict=True):
        want_counts, want_extras = stats.new_row(g.device)
        cpu_kernel.fill_row(g, want_counts, want_extras, FP16.overflow_at, norm=True)
        stats.fill_param_extras(g, want_counts, want_extras, FP16, norm=False,
                                scale=torch.tensor(scale) if scale is not None else None)
        assert torch.equal(counts, want_counts), g.dtype
        assert torch.equal(extras.nan_to_num(7.0), want_extras.nan_to_num(7.0))
    scaled = [int(c[LAYOUT.count["scaled"]]) for c, _ in rows]
    assert scaled[-1] == (64 if scale is not None else 0)
    assert scaled[0] > 0 if scale is not None else scaled == [0] * len(grads)


def _flags(counts: torch.Tensor) -> tuple[int, int, int]:
    """What stats.nonfinite and stats.harmful read of a row: NaN, +-Inf, -inf."""
    return int(counts[NAN_BINS].sum()), int(counts[INF_BIN]), int(counts[LAYOUT.count["neginf"]])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 19, 513, 4099])  # 513: a block and one more
def test_the_flags_only_pass_counts_the_non_finite_values_of_the_whole_row(dtype, n):
    values = _values(n, dtype)
    shuffled = values[torch.randperm(n, generator=torch.Generator().manual_seed(0))]  # specials in later blocks
    patterns = torch.arange(-(2**15), 2**15).to(torch.int16).view(torch.float16).to(dtype)
    for x in (values, shuffled, patterns):
        (counts, extras), (whole, _) = stats.new_row(x.device), _row(c_fill, x)
        cpu_kernel.fill_nonfinite(x, counts)
        assert _flags(counts) == _flags(whole)
        assert int(counts.sum()) == sum(_flags(counts)) and not extras.any()  # nothing else written
        assert (stats.nonfinite(stats.raw_matrix(counts[None], extras[None])).item(),
                stats.harmful(stats.raw_matrix(counts[None], extras[None])).item()) == (
            bool(x.isnan().any() or x.isinf().any()), bool(x.isnan().any() or (x == float("inf")).any()))


@pytest.mark.parametrize("kernel", [True, False])
def test_a_candidate_first_nonfinite_is_flagged_with_or_without_the_c_kernel(monkeypatch, kernel):
    # Without the C kernel (or off the CPU) the flags come from the whole row instead.
    if kernel and not cpu_kernel.available():
        pytest.skip(f"no C kernel: {cpu_kernel.status()}")
    monkeypatch.setattr(cpu_kernel, "available", lambda: kernel)
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, float("nan")])
    counts, extras = stats.new_row(x.device)
    stats.fill_nonfinite(x, counts, extras, FP16)
    raw = stats.raw_matrix(counts[None], extras[None])
    assert _flags(counts) == (2, 2, 1)
    assert (stats.nonfinite(raw).item(), stats.harmful(raw).item()) == (True, True)


@needs_kernel
def test_the_flags_only_pass_tells_signalling_nans_and_minus_inf_apart():
    signalling = torch.tensor([0x7F800001, 0xFF800010, 0xFF800000]).to(torch.int32).view(torch.float32)
    counts, _ = stats.new_row(signalling.device)
    cpu_kernel.fill_nonfinite(signalling, counts)
    assert _flags(counts) == (2, 1, 1)
    half = torch.tensor([0x7C01, 0xFC01, 0x7C00, 0xFC00]).to(torch.int16).view(torch.float16)
    counts, _ = stats.new_row(half.device)
    cpu_kernel.fill_nonfinite(half, counts)
    assert _flags(counts) == (2, 2, 1)


@needs_kernel
def test_c_kernel_reads_views_and_counts_known_fields():
    base = torch.tensor(SPECIAL * 4).reshape(4, -1)
    x = base.t()  # not contiguous
    row = stats.tensor_stats(x, FP16, fill=c_fill)
    # per copy: NaN; +-Inf; 65520, 70000, -1e5, 3.4e38 (and the infs) round to Inf in fp16 (65504 does not);
    # 6.1e-5 .. 1e-40 below its normals
    assert {k: row[k] for k in ("numel", "nan", "inf", "neginf", "overflow", "underflow", "zero")} == {
        "numel": 76, "nan": 4, "inf": 8, "neginf": 4, "overflow": 24, "underflow": 28, "zero": 8}
    assert row["absmax"] == pytest.approx(3.4e38)


@needs_kernel
def test_c_kernel_counts_every_nan_as_nan():
    # A signalling NaN whose payload sits in the low bits looks like Inf to the top-bits
    # histogram; the kernel makes every NaN the quiet one first.
    signalling = torch.tensor([0x7F800001, 0xFF800010]).to(torch.int32).view(torch.float32)
    counts, extras = _row(c_fill, signalling)
    assert int(counts[QUIET_NAN_BIN]) == 2 and float(extras[LAYOUT.extra["absmax"]]) == 0.0
    assert int(counts[LAYOUT.count["neginf"]]) == 0  # 0xFF800010 is a NaN, not -inf
    half = torch.tensor([0x7C01, 0xFC01, 0x7C00]).to(torch.int16).view(torch.float16)
    counts, _ = _row(c_fill, half)
    assert (int(counts[QUIET_NAN_BIN]), int(counts[INF_BIN]), int(counts[LAYOUT.count["neginf"]])) == (2, 1, 0)


@needs_kernel
def test_stats_uses_the_c_kernel_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernel, "fill_row", lambda x, *row_and_threshold, **norm: calls.append(x))
    stats.tensor_stats(torch.ones(3), FP16)
    assert len(calls) == 1 and calls[0].shape == (3,)


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = ("from ampaudit.core.dtypes import LowDtype\nfrom ampaudit.watch import cpu_kernel, stats\nimport torch\n"
            "row = stats.tensor_stats(torch.tensor([1.0, 0.0, 7e4]), LowDtype.parse(torch.float16))\n"
            "assert (row['numel'], row['zero'], row['overflow'], row['absmax']) == (3, 1, 1, 7e4)\n"
            "print(cpu_kernel.status())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.parametrize(("env", "says"), [
    ({"AMPAUDIT_CPU_KERNEL": "0"}, "torch ops (AMPAUDIT_CPU_KERNEL=0)"),
    ({"CC": "/nonexistent/cc"}, "torch ops (/nonexistent/cc could not build cpu_stats.c"),
    ({"CC": "false"}, "torch ops (false could not build cpu_stats.c"),
])
def test_without_a_working_compiler_rows_fall_back_to_torch(tmp_path, env, says):
    assert _status_in_subprocess({**env, "AMPAUDIT_CACHE_DIR": str(tmp_path)}).startswith(says)
    assert not list(tmp_path.glob("*.so"))  # nothing half-built left behind
    assert not list(tmp_path.iterdir())


@needs_kernel
def test_the_build_is_cached(tmp_path):
    env = {"AMPAUDIT_CACHE_DIR": str(tmp_path)}
    assert _status_in_subprocess(env).startswith("C kernel")
    (built,) = tmp_path.iterdir()
    stamp = built.stat().st_mtime_ns
    assert _status_in_subprocess({**env, "CC": "false"}).startswith("C kernel")  # no compiler needed now
    assert built.stat().st_mtime_ns == stamp


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_c_kernel_on_every_16_bit_pattern(dtype):
    x = torch.arange(-(2**15), 2**15).to(torch.int16).view(dtype)
    quiet = torch.where(x.isnan(), torch.tensor(float("nan"), dtype=dtype), x)  # the one NaN torch makes
    (counts, extras), (want_counts, want_extras) = _row(c_fill, x), _row(stats.torch_fill_row, quiet)
    assert torch.equal(counts, want_counts), (counts - want_counts).nonzero().flatten().tolist()
    absmax = LAYOUT.extra["absmax"]
    assert float(extras[absmax]) == float(want_extras[absmax]) == float(torch.finfo(dtype).max)
    assert int(counts[LAYOUT.count["neginf"]]) == 1  # one bit pattern is -inf


@pytest.mark.parametrize("backend", ["torch", "c"])
def test_fp32_subnormals_are_underflow_not_zeros(backend):
    if backend == "c" and not cpu_kernel.available():
        pytest.skip(f"no C kernel: {cpu_kernel.status()}")
    x = torch.tensor([0.0, -0.0, 1e-45, 1e-40, -1e-39, 2.0**-126, 1.0])  # 3 subnormals, 2 of them below 2**-128
    row = stats.tensor_stats(x, FP16, fill=stats.torch_fill_row if backend == "torch" else c_fill)
    assert (row["zero"], row["underflow"]) == (2, 4)  # the subnormals and 2**-126, all below fp16's normals
    assert row["hist"] == [[-127, 3], [-126, 1], [0, 1]]


@pytest.mark.parametrize("backend", ["torch", "c"])
def test_overflow_counts_exactly_what_rounds_to_inf(backend):
    if backend == "c" and not cpu_kernel.available():
        pytest.skip(f"no C kernel: {cpu_kernel.status()}")
    x = torch.tensor([65504.0, 65519.996, 65520.0, -65535.0, 65536.0, float("nan")])
    assert torch.isinf(x.half()).tolist() == [False, False, True, True, True, False]  # what the cast does
    row = stats.tensor_stats(x, FP16, fill=stats.torch_fill_row if backend == "torch" else c_fill)
    assert (row["overflow"], row["inf"], row["nan"]) == (3, 0, 1)


def test_overflow_threshold_is_max_plus_half_an_ulp():
    assert LowDtype.parse(torch.float16).overflow_at == 65520.0
    assert LowDtype.parse(torch.bfloat16).overflow_at == torch.finfo(torch.bfloat16).max + 2.0**119
    for dtype in (torch.float16, torch.bfloat16):
        at = torch.tensor(LowDtype.parse(dtype).overflow_at)  # fp32, as audited tensors are
        below = torch.nextafter(at, torch.tensor(0.0))
        assert torch.isinf(at.to(dtype)) and not torch.isinf(below.to(dtype))


def test_index_tensors_are_made_once_and_bounded():
    from ampaudit.watch import arena

    first = arena.index_tensor([3, 1, 2], torch.device("cpu"))
    assert first.tolist() == [3, 1, 2] and first.dtype == torch.int64
    assert arena.index_tensor([3, 1, 2], torch.device("cpu")) is first  # the same tensor, step after step
    for i in range(100):
        arena.index_tensor([i], torch.device("cpu"))
    assert len(arena._INDEXES) == 64 and arena.index_tensor([3, 1, 2], torch.device("cpu")) is not first


def _specials(dtype: torch.dtype) -> torch.Tensor:
    """-inf, +inf, NaN, signed zeros, fp32 and fp16 subnormals, values at and beyond fp16's
    max, and ordinary ones, repeated past one C piece (65536) and one Triton block (8192)."""
    inf, nan = float("inf"), float("nan")
    values = [-inf, inf, -inf, nan, 0.0, -0.0, 1e-45, -1e-40, 2.0**-130, 6e-8, -3e-6, 6.1e-5, 65504.0, 65519.0,
              65520.0, -70000.0, 1e5, 3.0e38, -1.0, 0.5, 3.0, -inf]
    x = torch.tensor(values * 3001, dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "c"])
def test_neginf_is_counted_exactly_and_inf_keeps_meaning_every_infinity(backend, dtype):
    if backend == "c" and not cpu_kernel.available():
        pytest.skip(f"no C kernel: {cpu_kernel.status()}")
    x = _specials(dtype)
    row = stats.tensor_stats(x, FP16, fill=stats.torch_fill_row if backend == "torch" else c_fill)
    assert row["neginf"] == int((x == float("-inf")).sum()) >= 3 * 3001  # fp16: -70000 and -inf alike
    assert row["inf"] == int(x.isinf().sum()) > row["neginf"]
    assert row["nan"] == int(x.isnan().sum()) == 3001
    assert row["numel"] == x.numel()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_c_kernel_and_torch_ops_agree_on_special_values(dtype):
    x = _specials(dtype)
    for limits in (FP16, LowDtype.parse(torch.bfloat16)):
        (counts, extras), (want_counts, want_extras) = stats.new_row(x.device), stats.new_row(x.device)
        c_fill(x, counts, extras, limits)
        stats.torch_fill_row(x, want_counts, want_extras, limits)
        same = torch.ones(LAYOUT.counts, dtype=torch.bool)
        same[NAN_BINS] = False  # which quiet NaN a conversion makes is the library's choice
        assert torch.equal(counts[same], want_counts[same]), (counts - want_counts).nonzero().flatten().tolist()
        assert int(counts[NAN_BINS].sum()) == int(want_counts[NAN_BINS].sum())
        assert torch.equal(extras, want_extras)
        stats_c = stats.to_stats(stats.compact(stats.raw_matrix(counts[None], extras[None]), limits)[0].tolist())
        assert stats_c == stats.tensor_stats(x, limits, fill=stats.torch_fill_row)


def _number_literals(path) -> set[int]:
    """The integer literals in a source file's code (comments and docstrings left out)."""
    import io
    import re
    import tokenize

    text = path.read_text()
    if path.suffix == ".c":
        code = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
        return {int(n, 0) for n in re.findall(r"\b(0x[0-9a-fA-F]+|\d+)u?\b", code)}
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NUMBER and re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok.string):
            found.add(int(tok.string, 0))
    return found


def test_the_layout_is_the_one_source_of_offsets():
    from ampaudit.watch import arena, layout, stats_merge, triton_stats

    assert (LAYOUT.bins, LAYOUT.counts, LAYOUT.extras) == (1024, 1027, 2)
    assert [LAYOUT.count[k] for k in ("scaled", "overflow", "neginf")] == [1024, 1025, 1026]
    # No other watch source writes the row's offsets or widths down again.
    offsets = {LAYOUT.bins, *LAYOUT.count.values(), LAYOUT.counts, LAYOUT.raw, LAYOUT.width, LAYOUT.bins - 2}
    watch = ROOT / "ampaudit" / "watch"
    for path in [*watch.glob("*.py"), watch / "cpu_stats.c", watch / "log_text.c"]:
        if path.name != "layout.py":
            assert not _number_literals(path) & offsets, path.name
    for path in watch.glob("*.py"):
        assert 'FIELDS.index("absmax")' not in path.read_text(), path.name
    # Each user reads it: the arena's rows, the Stats fields, the Triton kernel's constants.
    rows = arena.RowArena(chunk=1)
    _, counts, extras = rows.take(torch.device("cpu"))
    assert (counts.numel(), extras.numel()) == (LAYOUT.counts, LAYOUT.extras)
    assert stats_merge.FIELDS == stats.FIELDS == LAYOUT.fields and LAYOUT.width == stats.WIDTH
    assert triton_stats._CONSTANTS["BINS"] == LAYOUT.bins
    assert triton_stats._CONSTANTS["NEGINF_SLOT"] == LAYOUT.count["neginf"]
    assert {f.name for f in layout.FIELDS if f.reduce == layout.MAX} == {"absmax"}


@needs_kernel
def test_the_c_kernel_is_built_from_the_layout():
    import ctypes

    assert cpu_kernel.available()
    built = ctypes.CDLL(str(cpu_kernel._cached()))
    assert built.ampaudit_bins() == LAYOUT.bins
    assert f"-DAMPAUDIT_BIN_SHIFT={LAYOUT.bin_shift}" in cpu_kernel.DEFINES


def test_a_library_that_disagrees_with_the_layout_is_not_used(tmp_path):
    # a build whose bins differ from the layout's (a stale or foreign library) falls back to torch
    code = ("import sys; from ampaudit.watch import cpu_kernel\n"
            "cpu_kernel.DEFINES[:] = ['-DAMPAUDIT_BIN_SHIFT=22']\n"
            "print(cpu_kernel.status())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AMPAUDIT_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "no C compiler" in proc.stdout or "could not build" in proc.stdout:
        pytest.skip(proc.stdout)
    assert proc.stdout.strip() == "torch ops (cpu_stats.c has 512 bins, the layout 1024)"


_ROWS_IN_SUBPROCESS = """
import json, sys, torch
from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import cpu_kernel, stats
from tests.test_watch_kernels import _values
cpu_kernel.DEFINES += sys.argv[1:]
assert cpu_kernel.available(), cpu_kernel.status()
rows = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    every_half = torch.arange(-(2**15), 2**15).to(torch.int16).view(torch.float16)
    for x in (_values(3 * 65536 + 7, dtype), every_half.to(dtype)):
        counts, extras = stats.new_row(x.device)
        cpu_kernel.fill_row(x, counts, extras, LowDtype.parse(torch.float16).overflow_at)
        rows.append([counts.tolist(), extras.tolist()])
        counts, extras = stats.new_row(x.device)
        cpu_kernel.fill_nonfinite(x, counts)
        rows.append(counts.tolist())
print(json.dumps(rows))
"""


@needs_kernel
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize("flags", [["-DAMPAUDIT_NO_CLONES"], ["-DAMPAUDIT_NO_CLONES", "-march=x86-64-v3"]])
def test_every_cpu_clone_of_the_kernel_makes_the_same_rows(tmp_path, flags, rows_this_cpu_picks):
    # The library holds a baseline, an AVX2 and an AVX-512 build of each loop, and the CPU
    # picks one: the baseline and AVX2 builds, forced here, agree with the one this CPU picks.
    if "-march=x86-64-v3" in flags and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    assert _rows_in_subprocess(flags, str(tmp_path)) == rows_this_cpu_picks


def _rows_in_subprocess(extra: list[str], cache: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _ROWS_IN_SUBPROCESS, *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "AMPAUDIT_CACHE_DIR": cache})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def rows_this_cpu_picks() -> str:
    return _rows_in_subprocess([], str(cpu_kernel.cache_dir()))


def test_the_torch_path_reads_an_expanded_gradient():
    # sum()'s gradient is an expanded tensor (stride 0): viewing it as half-words raised, and
    # without the C kernel that broke the user's backward
    limits = LowDtype.parse("float16")
    expanded = torch.tensor([float("inf")]).expand(4)
    rows = []
    for x in (expanded, expanded.contiguous()):
        counts, extras = stats.new_row(x.device)
        stats.torch_fill_row(x, counts, extras, limits)
        rows.append((counts.clone(), extras.clone()))
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_c_compact_makes_the_torch_ops_stats_rows(dtype):
    # the step boundary compacts CPU arena rows in C (cpu_kernel.compact): every field and
    # exponent count equal to the torch ops', for rows with zeros, subnormals, NaN, +-inf,
    # overflow, and a strided view of the arena
    limits = LowDtype.parse(dtype)
    counts = torch.zeros(12, LAYOUT.counts, dtype=torch.int64)
    extras = torch.zeros(12, LAYOUT.extras)
    for i in range(12):
        stats.fill_row(_values(500 + 97 * i, torch.float32) * 10.0 ** (i - 6), counts[i], extras[i], limits)
    counts[3, LAYOUT.count["scaled"]] = 7
    rows = cpu_kernel.compact(counts, extras, limits.normal_exponent)
    assert torch.equal(rows, stats._compact(counts, extras[:, LAYOUT.extra["absmax"]], limits))
    assert rows[:, LAYOUT.field["nan"]].sum() > 0 and rows[:, LAYOUT.field["neginf"]].sum() > 0
    part = cpu_kernel.compact(counts[2:9:3], extras[2:9:3], limits.normal_exponent)
    assert torch.equal(part, rows[2:9:3])
    assert cpu_kernel.compact(counts[:0], extras[:0], limits.normal_exponent).shape == (0, LAYOUT.width)


@needs_kernel
@pytest.mark.parametrize("with_scale", [False, True])
def test_the_c_step_buffer_is_the_torch_ops_buffer(monkeypatch, with_scale):
    # a logged CPU step's buffer is built in C (cpu_kernel.step_buffer): the same float64
    # buffer as the torch ops' - sums and maxima per key, an event in no key, a row two
    # events share, -inf masks under each mode, parameters' norms and overflow at scale
    from ampaudit.watch.arena import RowArena
    from ampaudit.watch.reducer import ANY, HARMFUL, IGNORED, StepReducer

    cpu = torch.device("cpu")
    arena, handles = RowArena(chunk=4), []  # several chunks
    xs = [_values(300 + 31 * i, torch.float32) * 10.0 ** (i % 5 - 2) for i in range(9)]
    xs[1] = torch.randn(50)
    xs[2] = torch.zeros(40).masked_fill(torch.arange(40) > 30, -float("inf"))  # a mask: -inf only
    for x in xs:
        handle, counts, extras = arena.take(cpu)
        stats.fill_row(x, counts, extras, FP16, norm=True, scale=torch.tensor(2.0**12) if with_scale else None)
        handles.append(handle)
    events = [handles[i] for i in (1, 2, 3, 3, 4, 5, 0)]  # handles[3] twice: one tensor, two events
    keys, modes = [0, 1, 1, 2, -1, 0, 2], [ANY, HARMFUL, ANY, IGNORED, ANY, ANY, HARMFUL]
    params = handles[6:]
    scale = torch.tensor(2.0**12) if with_scale else None
    found_inf = torch.tensor([1.0]) if with_scale else None
    for event_modes in (modes, None, [HARMFUL] * len(events)):
        got, buf = StepReducer().step_buffer(arena, events, keys, 3, params, FP16, found_inf, scale, event_modes)
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
        want, _ = StepReducer().step_buffer(arena, events, keys, 3, params, FP16, found_inf, scale, event_modes)
        monkeypatch.undo()
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))  # to the bit, NaN norms too
        assert got[buf.first] < 2**62  # some event is a candidate first non-finite


@pytest.mark.parametrize("fill", ["torch", "c", "c sampled"])
def test_a_float64_tensor_keeps_its_finite_and_nonzero_values(fill):
    """A float64 module output (exp() of a double, a likelihood) is read as float32: a finite
    value past fp32's range is not an Inf (that made AMP605 and a first non-finite of a finite
    run), a nonzero one below it not a zero; the real Inf, -inf and NaN stay what they are."""
    if fill != "torch" and not cpu_kernel.available():
        pytest.skip(f"no C kernel: {cpu_kernel.status()}")
    values = [1e300, -1e40, 1e-300, -1e-50, 0.0, 1.0, float("inf"), -float("inf"), float("nan")]
    x = torch.tensor(values * 1000, dtype=torch.float64)  # 9000 elements: over the sampled rows' 8192
    filler = {"torch": stats.torch_fill_row, "c": c_fill, "c sampled": stats.fill_sampled_row}[fill]
    row = stats.tensor_stats(x, FP16, fill=filler)
    assert (row["nan"], row["inf"], row["neginf"]) == (1000, 2000, 1000)
    assert (row["zero"], row["underflow"], row["overflow"]) == (1000, 2000, 4000)  # overflow: the infinities too
    assert row["absmax"] == float(torch.finfo(torch.float32).max)  # the finite max, as far as fp32 says


def _without_cache_env(tmp_path) -> dict[str, str]:
    """No cache folder named, a HOME that cannot hold one (under a file: even root cannot), the
    temporary folder ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("AMPAUDIT_CACHE_DIR", "XDG_CACHE_HOME")}
    return {**env, "HOME": "/dev/null/home", "TMPDIR": str(tmp_path)}


@needs_kernel
def test_a_home_that_cannot_hold_the_cache_builds_in_a_temporary_folder_of_the_user_s_own(tmp_path):
    """Run as a user whose HOME is not writable (a container's random uid; setpriv as nobody),
    the kernels could not be built into ~/.cache and watch silently took the torch ops. They are
    built in a folder of the user's own in the temporary folder, closed to others."""
    proc = subprocess.run([sys.executable, "-c", "from ampaudit.watch import cpu_kernel\nprint(cpu_kernel.status())"],
                          cwd=ROOT, env=_without_cache_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("C kernel"), proc.stdout + proc.stderr[-2000:]
    own = tmp_path / f"ampaudit-{os.getuid()}"
    assert own.stat().st_mode & 0o777 == 0o700 and list(own.glob("cpu_stats-*.so"))


def test_a_temporary_cache_folder_open_to_others_is_not_loaded_from(tmp_path):
    """Another user could have made that folder first, open to all, with a library of theirs in
    it: a folder not closed to others is not used."""
    from ampaudit.core import native

    own = tmp_path / f"ampaudit-{os.getuid()}"
    own.mkdir()
    own.chmod(0o777)
    env = _without_cache_env(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "from ampaudit.core import native\nprint(native.build_dir())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() != str(own) and proc.stdout.strip().startswith("/dev/null/home"), proc.stderr
    assert native.build_dir() != own
